"""benchmarks/bench_msa.py's report: each flash_msa row sets its main attention against
FlexAttention run on a selection of the same granularity and proxies (none: "-"), and its
step against dense cuDNN at the same length."""

import importlib
from pathlib import Path

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def msa_row(proxies: str, total_ms: float, main_ms: float) -> dict:
    return dict(seq_len=131072, impl="flash_msa", granularity="token", q_block=8,
                proxies=proxies, scores="bf16", fwd_bwd_ms=total_ms, selection_ms=15.0,
                main_attention_ms=main_ms, main_attention_tflops=355.0, kl_ms=41.0,
                peak_gib=9.6, commit="c")  # fmt: skip


def test_each_row_takes_the_flex_run_of_its_own_proxies(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import common from there
    bench_msa = importlib.import_module("bench_msa")
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
    assert rows["local"][11:15] == ["200.000", "2.50x", "1,800.0", "12.0x"]
    assert rows["random"][11:15] == ["-", "-", "1,800.0", "6.0x"]
