"""The ordered dQ mode's turns (on the CPU): in each query block's row the kv blocks add
highest first, and a kv block waits only on higher ones, which the kernel starts before it."""

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from flash_msa import patterns  # noqa: E402
from flash_msa.ops.gluon.backward import entry_turns  # noqa: E402


@pytest.mark.parametrize(
    "layout",
    [
        patterns.causal(1000),
        patterns.sliding_window(2048, 512) | patterns.global_tokens(2048, 128),
        patterns.stack([patterns.random_blocks(1536, 3, seed=h) for h in range(3)]),
    ],
    ids=["causal", "window-sinks", "random-per-head"],
)
def test_turns_count_the_higher_kv_blocks_of_each_row(layout):
    turns = entry_turns(layout)
    transposed = layout.transpose()
    assert turns.dtype == torch.int32 and turns.shape == transposed.col_indices.shape
    expected = []
    for head in range(transposed.row_offsets.shape[0]):
        offsets = transposed.row_offsets[head]
        for kv_block in range(offsets.numel() - 1):
            for entry in range(int(offsets[kv_block]), int(offsets[kv_block + 1])):
                q_block = int(transposed.col_indices[entry])
                start, end = (int(x) for x in layout.row_offsets[head, q_block:q_block + 2])
                row = layout.col_indices[start:end]
                expected.append(int((row > kv_block).sum()))  # the higher ones add first
    assert turns.tolist() == expected
