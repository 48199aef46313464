"""flash-msa bench: the CPU run writes its table, JSON and PNG with SDPA agreeing with
flash-msa on every layout; the peers' masks keep flash-msa's pairs; bad options end in
argparse errors."""

import json
import shlex
import sys
from pathlib import Path

import pytest
import torch

from flash_msa import bench, patterns
from flash_msa.cli import main
from flash_msa.reference import layout_mask

README = Path(__file__).parents[1] / "README.md"


def readme_command() -> list[str]:
    """The arguments of README.md's CPU command line (`flash-msa bench ...`)."""
    (line,) = [
        line for line in README.read_text().splitlines() if line.startswith("flash-msa bench")
    ]
    return shlex.split(line)[1:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run (FlexAttention skipped)")
def test_readme_cpu_run_writes_table_json_and_png(tmp_path, capsys):
    """README's command (its --out here in tmp_path): GQA, every layout, both modes."""
    assert main([*readme_command(), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    table = (tmp_path / "bench.md").read_text()
    for text in (printed, table):
        assert "| layout" in text and "fwd_bwd speed-up" in text
        assert "[1] skipped: no CUDA device" in text
    run = json.loads((tmp_path / "bench.json").read_text())
    assert run["run"]["heads_q"] == 2 and run["run"]["heads_kv"] == 1  # GQA
    assert run["run"]["flash_msa_backend"] == "torch"
    records = {(r["layout"], r["impl"]): r for r in run["records"]}
    assert set(records) == {(name, impl) for name in bench.LAYOUTS for impl in bench.IMPLS}
    for name in bench.LAYOUTS:
        ours, sdpa = records[name, "flash_msa"], records[name, "sdpa"]
        assert records[name, "flex"]["skipped"].startswith("no CUDA device")
        assert sdpa["rel_diff_vs_flash_msa"] < 1e-5  # the same pairs: SDPA's mask is right
        for mode in ("fwd", "fwd_bwd"):
            assert ours[f"{mode}_ms"] > 0 and ours[f"{mode}_tflops"] > 0
            assert sdpa[f"{mode}_speedup"] == pytest.approx(sdpa[f"{mode}_ms"] / ours[f"{mode}_ms"])
            row = f"| {name} ".ljust(12) + "| sdpa "
            assert row in printed and f"{sdpa[f'{mode}_speedup']:.2f}x" in printed
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "options, message",
    [
        (["--seq-len", "12x"], "'12x' is not a token count"),
        (["--seq-len", "64"], "seq_len must be at least 128 tokens"),
        (["--heads", "0"], "heads must be a positive int, got '0'"),
        (["--head-dim", "two"], "head_dim must be a positive int, got 'two'"),
        (["--layouts", "window,stripes"], "unknown layouts ['stripes']: choose among window"),
        (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        (["--mode", "bwd"], "argument --mode: invalid choice: 'bwd'"),
        (["--heads", "4", "--kv-heads", "3"], "heads 4 must be a multiple of kv_heads 3"),
    ],
)
def test_bad_options_end_in_an_argparse_error(options, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit:
        main(["bench", *options, "--out", str(tmp_path)])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("usage: flash-msa bench") and message in error
    assert not any(tmp_path.iterdir())  # refused before measuring


def test_missing_matplotlib_is_named_before_measuring(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # its import now fails
    with pytest.raises(SystemExit) as exit:
        main(["bench", "--out", str(tmp_path)])
    assert exit.value.code == 2
    assert "pip install 'flash-msa[plot]'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("documents, causal", [(False, True), (True, True), (False, False)])
def test_flex_block_mask_keeps_the_layout_and_masks_only_partial_blocks(documents, causal):
    """The BlockMask's blocks are the layout's; its full blocks keep every pair the element
    masks (causal, one document) keep, and its partial blocks are exactly the others: none
    without causal, where every pair of every block is kept."""
    seq_len, block = 200, 16  # ragged: the last block holds 8 tokens
    cu_seqlens = torch.tensor([0, 70, 72, 150, seq_len], dtype=torch.int32)
    window = patterns.sliding_window(seq_len, 64, causal=causal, block_size=block)
    layout = window & patterns.documents(cu_seqlens, block_size=block) if documents else window
    assert causal or layout.to_dense()[0].triu(1).any()  # blocks past the diagonal
    document_ids = bench.Case("documents", layout, cu_seqlens, False).document_ids
    block_mask = bench.flex_block_mask(
        layout, 4, document_ids if documents else None, causal=causal
    )
    pairs = layout_mask(
        layout, 1, 1, causal=causal, document_ids=document_ids[None] if documents else None
    )[0, 0]  # [S, S]

    def blocks(counts, indices):  # [nq, nk] bool of a BlockMask's (counts, indices)
        dense = torch.zeros(layout.num_q_blocks, layout.num_kv_blocks, dtype=torch.bool)
        for row, count in enumerate(counts[0, 0].tolist()):
            dense[row, indices[0, 0, row, :count].long()] = True
        return dense

    full = blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    partial = blocks(block_mask.kv_num_blocks, block_mask.kv_indices)
    assert not (full & partial).any() and torch.equal(full | partial, layout.to_dense()[0])
    for row, col in torch.nonzero(full | partial).tolist():
        tile = pairs[row * block : (row + 1) * block, col * block : (col + 1) * block]
        assert bool(tile.all()) == bool(full[row, col]), (row, col)


def test_non_causal_flex_block_mask_keeps_the_pairs_inside_the_sequence():
    """Its mask_mod keeps every pair inside the sequence and none past it: not the trivial
    one, under which FlexAttention's FLASH backend would attend to every block."""
    seq_len = 200
    layout = patterns.longformer(seq_len, 32, 16, block_size=16)
    block_mask = bench.flex_block_mask(layout, 2, causal=False)
    q_index, kv_index = torch.arange(seq_len + 1)[:, None], torch.arange(seq_len + 1)[None]
    kept = block_mask.mask_mod(torch.tensor(0), torch.tensor(0), q_index, kv_index)
    assert kept[:seq_len, :seq_len].all()
    assert not kept[seq_len].any() and not kept[:, seq_len].any()
    document_ids = torch.zeros(seq_len, dtype=torch.int32)
    with pytest.raises(ValueError, match="document_ids and token_blocks need causal=True"):
        bench.flex_block_mask(layout, 2, document_ids, causal=False)


def test_case_flops_count_the_computed_pairs():
    heads, head_dim = 3, 16
    causal, documents, window = (
        bench.build_case(name, 1024, "cpu") for name in ("causal", "documents", "window")
    )
    assert causal.flops(heads, head_dim) == 4 * head_dim * 1024 * 1024 / 2 * heads
    lengths = bench.document_lengths(1024)
    assert lengths == [512, 256, 128, 128]
    expected = sum(4 * head_dim * length * length / 2 for length in lengths) * heads
    assert documents.flops(heads, head_dim) == expected
    assert window.flops(heads, head_dim) == window.layout.flops(head_dim) * heads


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.on_device)])
def test_timed_clears_gradients_before_every_call(device, monkeypatch):
    """Every call, the first and do_bench's warm-up ones included, starts with .grad None:
    a gradient kept from the call before would be accumulated into (two alive at once, a
    peak that training with fresh gradients never has). On the CPU a stand-in do_bench that
    calls the step 5 times without clearing anything plays the GPU's."""
    x = torch.ones(3, requires_grad=True)
    seen = []

    def step():
        seen.append(x.grad is None)
        (x * 2).sum().backward()

    if device == "cuda" and not torch.cuda.is_available():

        def do_bench(fn, **options):
            for _ in range(5):
                fn()
            return 1.0

        monkeypatch.setattr(bench.triton.testing, "do_bench", do_bench)
        for name in ("synchronize", "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, lambda: None)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 0)
    result = bench.timed(step, [x], device=device)
    assert result["ms"] > 0 and len(seen) >= 4 and all(seen), seen


@pytest.mark.parametrize(
    "diff_rc, environment, expected",
    [(0, None, "abc1234"), (1, None, "abc1234+modified"), (1, "f00d", "f00d")],
)
def test_source_commit_marks_a_tree_that_differs_from_head(
    monkeypatch, diff_rc, environment, expected
):
    """HEAD names the sources only where the package's files equal it: a copied tree whose
    .git is older than its files is recorded as HEAD+modified; FLASH_MSA_COMMIT wins."""
    root = Path(bench.__file__).resolve().parents[1]

    def fake_git(command, **kwargs):
        assert command[0] == "git" and kwargs["cwd"] == root
        if command[1] == "rev-parse":
            return bench.subprocess.CompletedProcess(command, 0, f"{root}\nabc1234\n", "")
        assert command[1:] == ["diff", "--quiet", "HEAD", "--", "flash_msa"]
        return bench.subprocess.CompletedProcess(command, diff_rc, "", "")

    monkeypatch.setattr(bench.subprocess, "run", fake_git)
    if environment is None:
        monkeypatch.delenv("FLASH_MSA_COMMIT", raising=False)
    else:
        monkeypatch.setenv("FLASH_MSA_COMMIT", environment)
    assert bench.source_commit() == expected
