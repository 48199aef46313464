"""benchmarks/common.py's cases: every layout builder runs on the CPU at a small length and
gives a valid layout that keeps to its case's mask (causal: nothing past the diagonal;
non-causal: blocks past it and dense global rows); the irregular case's rows differ as much
as it says; FLOP counts of non-causal cases are every pair of every active block; results
folders are named after the GPU model."""

import importlib.util
from pathlib import Path

import pytest
import torch

from flash_msa.layout import BlockLayout
from flash_msa.reference import layout_mask

COMMON = Path(__file__).parents[1] / "benchmarks" / "common.py"


def load_common():
    """benchmarks/common.py as a module (the scripts import it from their own folder)."""
    spec = importlib.util.spec_from_file_location("benchmarks_common", COMMON)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


common = load_common()
NON_CAUSAL = [name for name, case in common.CASES.items() if not case.causal]


def test_the_non_causal_cases_are_there():
    assert NON_CAUSAL == ["longformer-128k", "bigbird-128k"]
    assert common.CASES["irregular-128k"].causal


@pytest.mark.parametrize("name", list(common.CASES))
def test_every_case_builds_a_valid_layout_that_keeps_to_its_mask(name):
    case = common.CASES[name]
    layout = case.layout(4096, "cpu")
    sizes = {size: getattr(layout, size) for size in BlockLayout.SIZES}
    BlockLayout(layout.row_offsets, layout.col_indices, **sizes)  # validates
    blocks = layout.to_dense()  # [L, nq, nk]
    last_queries = (torch.arange(layout.num_q_blocks) + 1) * layout.q_block - 1
    first_keys = torch.arange(layout.num_kv_blocks) * layout.kv_block
    past_diagonal = first_keys[None, :] > last_queries[:, None]  # [nq, nk]: no causal pair
    if case.causal:
        assert not (blocks & past_diagonal).any()
    else:
        assert (blocks & past_diagonal).any()
        assert blocks[:, 0].all()  # the global tokens' row sees every key
        assert blocks[:, :, 0].all()  # and every query sees them


def test_irregular_rows_run_from_one_block_to_hundreds():
    layout = common.irregular_layout(128 * 1024, "cpu")
    counts = layout.row_counts()
    assert int(counts.min()) == 1 and int(counts.max()) >= 200
    assert int((counts <= 2).sum()) > 100 and int((counts >= 200).sum()) > 10
    assert 0.02 < layout.density < 0.06


@pytest.mark.parametrize("name", NON_CAUSAL)
def test_non_causal_flops_count_every_pair_of_every_active_block(name):
    """Against the pairs of the element mask, on a ragged length (a short last block)."""
    seq_len, heads_q = 4000, 2
    case = common.CASES[name]._replace(seq_len=seq_len, heads_q=heads_q, heads_kv=heads_q)
    layout = case.layout(seq_len, "cpu")
    pairs = int(layout_mask(layout, 1, heads_q, causal=False).sum())
    assert case.flops(layout) == 4 * common.HEAD_DIM * pairs


@pytest.mark.parametrize(
    ("name", "folder"),
    [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
     ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GeForce RTX 4090", "4090")],
)  # fmt: skip
def test_results_go_to_the_gpu_models_folder(name, folder):
    """Results land in a folder named after the GPU's model, not the last word of its name
    (an H100 80GB HBM3 is h100, not hbm3)."""
    assert common.gpu_folder(name) == folder
