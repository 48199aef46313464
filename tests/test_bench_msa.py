"""benchmarks/bench_msa.py: FlexAttention's mask for a per-token selection attends to what
block_sparse_attn_func does; the report sets each flash_msa row's main attention against
FlexAttention run on a selection of the same granularity and proxies (none: "-"), and its
step against dense cuDNN at the same length."""

import importlib
import warnings
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from flash_msa import block_sparse_attn_func, patterns
from flash_msa.bench import flex_block_mask

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture
def bench_msa(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import common from there
    return importlib.import_module("bench_msa")


def test_flex_attends_to_a_per_token_selection_as_flash_msa(bench_msa):
    """A selection of 8-row tiles with a word of token bits per entry; flex runs it over
    64-row tiles of the union of their tokens' blocks, the mask_mod reading each token's."""
    seq_len, heads_proxy, heads_q, heads_kv, kv_block, q_block = 512, 4, 8, 2, 128, 8
    generator = torch.Generator().manual_seed(0)
    tokens, blocks = torch.arange(seq_len), torch.arange(seq_len // kv_block)
    chosen = torch.rand(heads_proxy, seq_len, blocks.numel(), generator=generator) < 0.5
    chosen &= blocks[None, None] * kv_block <= tokens[None, :, None]  # visible blocks
    chosen[:, tokens, tokens // kv_block] = True  # its own block
    tiles = chosen.view(heads_proxy, -1, q_block, blocks.numel())  # [H_p, nq, q_block, nk]
    layout = patterns.from_dense_mask(
        tiles.any(2), seq_len_q=seq_len, q_block=q_block, kv_block=kv_block
    )
    rows = layout.entry_rows()
    row_bits = tiles[rows // layout.num_q_blocks, rows % layout.num_q_blocks, :,
                     layout.col_indices.long()]  # fmt: skip  # [nnz, q_block]
    words = (row_bits.long() << torch.arange(q_block)).sum(1)
    assert torch.equal(bench_msa.token_blocks((layout, words), seq_len), chosen)
    q, k, v = (
        torch.randn(1, seq_len, heads, 16, generator=generator)
        for heads in (heads_q, heads_kv, heads_kv)
    )
    block_mask = flex_block_mask(
        bench_msa.tile_union(chosen, kv_block), heads_q, token_blocks=chosen
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # uncompiled flex: the reference implementation
        out = flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=block_mask,
                             enable_gqa=True).transpose(1, 2)  # fmt: skip
    expected = block_sparse_attn_func(q, k, v, layout, causal=True, query_masks=words)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def msa_row(proxies: str, total_ms: float, main_ms: float) -> dict:
    return dict(seq_len=131072, impl="flash_msa", granularity="token", q_block=8,
                proxies=proxies, scores="bf16", fwd_bwd_ms=total_ms, selection_ms=15.0,
                main_attention_ms=main_ms, main_attention_tflops=355.0, kl_ms=41.0,
                peak_gib=9.6, commit="c")  # fmt: skip


def test_each_row_takes_the_flex_run_of_its_own_proxies(tmp_path, bench_msa):
    records = [
        dict(seq_len=131072, impl="sdpa_cudnn", granularity=None, fwd_bwd_ms=1800.0,
             estimated=False, commit="c"),  # fmt: skip
        msa_row("local", 150.0, 80.0),
        dict(seq_len=131072, impl="flex", granularity="token", proxies="local",
             fwd_bwd_ms=200.0, commit="c"),  # fmt: skip
        msa_row("random", 300.0, 120.0),
    ]
    meta = dict(device="NVIDIA H200", torch="2.11", triton="3.6", date="2026-12-06", commit="c")
    bench_msa.write_reports(records, meta, tmp_path)
    rows = {
        cells[3]: cells
        for line in (tmp_path / "msa.md").read_text().splitlines()
        if line.startswith("| 131,072")
        for cells in [[cell.strip() for cell in line.strip("|").split("|")]]
    }
    assert rows["local"][-5:-1] == ["200.000", "2.50x", "1,800.0", "12.0x"]
    assert rows["random"][-5:-1] == ["-", "-", "1,800.0", "6.0x"]


def test_the_computed_tiles_cell_counts_whole_blocks_of_the_layout(bench_msa):
    """4 layout heads x 16,384 tiles of 8 tokens x 1,024 kv blocks at 128K: density 1 / 1024
    is 65,536 active blocks of 8 x 128 pairs; half of them selected doubles the TFLOP/s."""
    record = msa_row("local", 150.0, 80.0)
    record.update(density=1 / 1024, attended_pairs=65536 * 8 * 128 // 2)
    assert bench_msa.computed_cell(record) == "710.0 (0.500)"
    del record["attended_pairs"]  # a record from before the key was kept
    assert bench_msa.computed_cell(record) == "-"


def test_peak_sites_sum_the_allocations_alive_at_the_peak(monkeypatch):
    """profile_msa_step's trace walk: the peak counts the trace's own allocations only (a free
    of an earlier one is left out), and its sites are those alive at the peak, largest
    first."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    peak_sites = importlib.import_module("profile_msa_step").peak_sites

    def frame(site):
        return [{"filename": f"/x/flash_msa/{site}.py", "line": 1, "name": "f"}]

    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": frame("a")},
        {"action": "free_completed", "addr": 9, "size": 500},  # made before the trace
        {"action": "alloc", "addr": 2, "size": 300, "frames": frame("b")},
        {"action": "alloc", "addr": 3, "size": 50, "frames": frame("a")},
        {"action": "free_completed", "addr": 2, "size": 300},
        {"action": "alloc", "addr": 4, "size": 200, "frames": []},
    ]
    peak, sites = peak_sites(trace)
    assert peak == 450
    assert sites == {"b.py:1 f": [300, 1], "a.py:1 f": [150, 2]}
