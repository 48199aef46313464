"""MSA top-k block selection on the device, with no host synchronisation.

Query block b (positions [b * q_block, min((b + 1) * q_block, S))) has its diagonal kv block
d(b) = (min((b + 1) * q_block, S) - 1) // kv_block, the block of its last position and the
last with a causal pair; the earlier blocks are 0 .. d(b) - 1. A row keeps d(b) plus the
top_k - 1 best earlier blocks, so it has exactly min(top_k, d(b) + 1) blocks: the CSR offsets
depend on the geometry only and nnz is known on the host without reading the scores.
"""

from __future__ import annotations

import functools
import math

import torch

from flash_msa.layout import BLOCK_SIZES, BlockLayout

_INT64_MAX = torch.iinfo(torch.int64).max
_INT64_MIN = torch.iinfo(torch.int64).min
CHUNK_ELEMENTS = 1 << 26  # scores ranked at a time: 512 MiB of int64 keys


def _diagonals(num_q_blocks: int, seq_len: int, q_block: int, kv_block: int, device):
    """int64 [nq]: the diagonal kv block d(b) of each query block."""
    last = ((torch.arange(num_q_blocks, device=device) + 1) * q_block).clamp(max=seq_len) - 1
    return last // kv_block


@functools.lru_cache(maxsize=64)
def _blocks_per_layout(seq_len: int, q_block: int, kv_block: int, top_k: int) -> int:
    """sum over b of min(top_k, d(b) + 1), in Python so that no device value is read."""
    num_q_blocks = math.ceil(seq_len / q_block)
    return sum(
        min(top_k, (min((b + 1) * q_block, seq_len) - 1) // kv_block + 1)
        for b in range(num_q_blocks)
    )


def _ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys, one per score, all distinct within a row, ordered as (score, -index): an
    int32 whose order is the float32 order, shifted above the reversed column index."""
    # + 0.0 turns -0.0 into +0.0: equal scores must get equal bits.
    bits = (scores.float() + 0.0).view(torch.int32)
    # Negative floats order backwards as integers; flipping all but the sign bit fixes that.
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    num_kv_blocks = scores.shape[-1]
    reversed_index = num_kv_blocks - 1 - torch.arange(num_kv_blocks, device=scores.device)
    return ordered * (1 << 32) + reversed_index


def _check(scores, top_k, seq_len, q_block, kv_block) -> None:
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    if scores.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(
            f"scores must be float16, bfloat16 or float32, got {scores.dtype}; "
            "block_scores returns float32"
        )
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    for name, value in (("q_block", q_block), ("kv_block", kv_block)):
        if value not in BLOCK_SIZES:
            raise ValueError(f"{name} must be one of {BLOCK_SIZES}, got {value!r}")
    grid = (math.ceil(seq_len / q_block), math.ceil(seq_len / kv_block))
    if scores.dim() != 4 or tuple(scores.shape[2:]) != grid:
        raise ValueError(
            f"scores must have shape [B, H_p, ceil(seq_len / q_block), ceil(seq_len / kv_block)]"
            f" = [B, H_p, {grid[0]}, {grid[1]}], got {list(scores.shape)}"
        )


def _csr_rows(counts: torch.Tensor, num_layouts: int, per_layout: int):
    """CSR of num_layouts layouts whose rows hold counts [nq] entries each (per_layout =
    counts.sum(), known on the host): row_offsets int64 [L, nq + 1], and for each of the nnz
    entries its flat row (layout * nq + row) and its slot within that row, int64 [nnz]."""
    device = counts.device
    nnz = num_layouts * per_layout
    row_offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # [nq + 1]
    row_offsets = torch.arange(num_layouts, device=device)[:, None] * per_layout + row_offsets
    rows = torch.repeat_interleave(
        torch.arange(num_layouts * counts.numel(), device=device),
        counts.repeat(num_layouts),
        output_size=nnz,
    )  # [nnz]
    slots = torch.arange(nnz, device=device) - row_offsets[:, :-1].flatten()[rows]
    return row_offsets, rows, slots


def select_blocks(
    scores: torch.Tensor, top_k: int, *, seq_len: int, q_block: int, kv_block: int
) -> BlockLayout:
    """BlockLayout (layout_batch = B, layout_heads = H_p) of the diagonal plus the top_k - 1
    highest-scoring earlier blocks of each row of scores [B, H_p, nq, nk]; ties go to the lower
    block index. Scores past the diagonal are ignored; NaN ranks above every number."""
    _check(scores, top_k, seq_len, q_block, kv_block)
    batch, heads, num_q_blocks, num_kv_blocks = scores.shape
    device = scores.device
    diagonals = _diagonals(num_q_blocks, seq_len, q_block, kv_block, device)  # [nq]
    columns = torch.arange(num_kv_blocks, device=device)
    picks = min(top_k, num_kv_blocks)
    # Rows in chunks: the int64 keys and their temporaries stay near CHUNK_ELEMENTS each.
    rows_per_chunk = max(1, CHUNK_ELEMENTS // (batch * heads * num_kv_blocks))
    chosen = []
    for first in range(0, num_q_blocks, rows_per_chunk):
        rows = slice(first, first + rows_per_chunk)
        keys = _ordered_keys(scores[:, :, rows])  # [B, H_p, rows, nk]
        keys.masked_fill_(columns > diagonals[rows, None], _INT64_MIN)
        keys.masked_fill_(columns == diagonals[rows, None], _INT64_MAX)
        chosen.append(keys.topk(picks, dim=-1).indices)  # [B, H_p, rows, picks], best first
    chosen = torch.cat(chosen, dim=2)  # [B, H_p, nq, picks]
    counts = (diagonals + 1).clamp(max=top_k)  # [nq]
    # Slots past a row's count hold ignored blocks: push them to the end, then sort ascending.
    beyond = torch.arange(picks, device=device) >= counts[:, None]  # [nq, picks]
    chosen = chosen.masked_fill(beyond, num_kv_blocks).sort(dim=-1).values

    per_layout = _blocks_per_layout(seq_len, q_block, kv_block, top_k)
    row_offsets, rows, slots = _csr_rows(counts, batch * heads, per_layout)
    col_indices = chosen.reshape(-1, picks)[rows, slots]
    return BlockLayout(
        row_offsets.int(),
        col_indices.int(),
        seq_len_q=seq_len,
        q_block=q_block,
        kv_block=kv_block,
        layout_batch=batch,
        layout_heads=heads,
        validate=False,
    )


def causal_blocks(seq_len: int, *, q_block: int, kv_block: int, device=None) -> BlockLayout:
    """Every block with a causal pair: row b holds kv blocks 0 .. d(b) (MSA's warm-up)."""
    num_q_blocks = math.ceil(seq_len / q_block)
    counts = _diagonals(num_q_blocks, seq_len, q_block, kv_block, device) + 1  # [nq]
    per_layout = _blocks_per_layout(seq_len, q_block, kv_block, math.ceil(seq_len / kv_block))
    row_offsets, _, slots = _csr_rows(counts, 1, per_layout)
    return BlockLayout(
        row_offsets.int(), slots.int(), seq_len_q=seq_len, q_block=q_block, kv_block=kv_block,
        validate=False,
    )  # fmt: skip
