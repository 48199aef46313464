import subprocess
import sys

import pytest
import torch

from flash_msa import _env
from flash_msa.cli import SHOWABLE, build_parser, main
from flash_msa.ops import registry


def test_demo_runs_and_checks(capsys):
    assert main(["demo", "--cpu", "--seq-len", "512", "--block-size", "64"]) == 0
    printed = capsys.readouterr().out
    assert "density" in printed and "passed" in printed and "[X]" in printed


def test_show_ascii_and_png(tmp_path, capsys):
    assert main(["show", "sliding_window", "--seq-len", "1024", "--window", "256"]) == 0
    assert "[X][X][X][ ]" in capsys.readouterr().out
    path = tmp_path / "bigbird.png"
    arguments = ["show", "bigbird", "--window", "256", "--num-global", "128", "--num-random", "2"]
    assert main([*arguments, "--no-causal", "--out", str(path)]) == 0
    assert path.stat().st_size > 0


def help_of(capsys, *argv):
    with pytest.raises(SystemExit) as exit:
        main([*argv, "--help"])
    assert exit.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse's wrapping undone


def test_help_describes_every_pattern_and_option(capsys):
    listing = help_of(capsys, "show")
    for name, description in SHOWABLE.items():
        assert f"{name} {description}" in listing  # whole, not cut mid-sentence
    texts = [help_of(capsys), help_of(capsys, "demo"), help_of(capsys, "info"), listing]
    for name in SHOWABLE:
        text = help_of(capsys, "show", name)
        texts.append(text)
        assert "--cu-seqlens" not in text and "--device" not in text
    assert not any("`" in text for text in texts)  # no markdown shown literally
    for parser in _option_parsers():
        for action in parser._actions:
            if action.dest in ("help", "cpu", "out"):  # flags with nothing to default
                continue
            assert action.help and ("default:" in action.help or "(required)" in action.help)
            if action.dest in ("seq_len", "window", "num_global", "block_size", "q_block"):
                assert "tokens" in action.help


def _option_parsers():
    """The parsers of demo and of each show PATTERN."""
    commands = build_parser()._subparsers._group_actions[0].choices
    patterns = commands["show"]._subparsers._group_actions[0].choices
    return [commands["demo"], *patterns.values()]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["show", "causal", "--block-size", "100"],
            "block_size 100 is not one of (16, 32, 64, 128)",
        ),
        (["show", "causal", "--kv-block", "48"], "kv_block 48 is not one of (16, 32, 64, 128)"),
        (["show", "causal", "--block-size", "abc"], "block_size must be an int number of tokens"),
        (["show", "sliding_window", "--window", "-5"], "window must be a non-negative int"),
        (["show", "causal", "--max-blocks", "-3"], "max_blocks must be a positive int, got -3"),
        (["show", "causal", "--seq-len", "0"], "seq_len must be a positive int, got 0"),
        (["show", "causal", "--seq-len", "100000000"], "more than its int32 row_offsets count"),
        (["show", "causal", "--seq-len", "99999999999999"], "seq_len must be below 2**31"),
        (["demo", "--seq-len", "0"], "seq_len must be a positive int, got 0"),
        (["demo", "--block-size", "100"], "block_size 100 is not one of (16, 32, 64, 128)"),
        (["show", "causal", "--out", "/nonexistent/x.png"], "a .png file in an existing folder"),
        (["show", "causal", "--out", "picture"], "a .png file in an existing folder"),
        (["show", "causal", "--out", "/proc/x.png"], "cannot write /proc/x.png"),
        (["bench", "--out", __file__], "cannot write into folder"),
        (["bench", "--layouts", "causal,causal"], "layouts must be distinct, got 'causal,causal'"),
        (["niah", "--tiny", "--device", "tpu"], "device must be cpu or cuda[:N], got 'tpu'"),
        (["niah", "--tiny", "--max-minutes", "-1"], "max_minutes must be a number >= 0"),
        (["niah", "--tiny", "--checkpoint-dir", f"{__file__}/sub"], "cannot write into folder"),
    ],
)
def test_bad_values_end_in_one_error_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    printed = capsys.readouterr()
    last = printed.err.strip().splitlines()[-1]
    assert last.startswith("flash-msa ") and ": error: " in last and message in last
    assert "Traceback" not in printed.err and "q_block" not in last.replace("kv_block", "")
    assert printed.out == ""


def test_bad_value_exits_without_a_traceback_from_the_shell():
    command = [sys.executable, "-m", "flash_msa.cli", "show", "causal", "--block-size", "100"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith("block_size 100 is not one of (16, 32, 64, 128); 64 or 128 run fastest")
    )


def test_png_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exit:
        main(["show", "causal", "--out", str(tmp_path / "causal.png")])
    assert exit.value.code == 2
    assert "pip install 'flash-msa[plot]'" in capsys.readouterr().err.splitlines()[-1]


def test_out_of_gpu_memory_ends_in_one_error_line(monkeypatch, capsys):
    def exhausted(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB\nmore")

    monkeypatch.setattr("flash_msa.cli.block_sparse_attn_func", exhausted)
    with pytest.raises(SystemExit) as exit:
        main(["demo", "--seq-len", "256"])
    assert exit.value.code == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "flash-msa demo: error: the GPU ran out of memory (CUDA out of memory. Tried to "
        "allocate 64.00 GiB); pass shorter sequences"
    )


@pytest.mark.on_device
def test_info_lists_versions_device_and_backends(capsys):
    assert main(["info"]) == 0
    printed = capsys.readouterr().out
    assert f"torch {torch.__version__}" in printed and "triton " in printed
    assert "device: cpu" in printed or "device: cuda" in printed
    assert f"Triton interpreter: {'on' if _env.interpreting() else 'off'}" in printed
    for name in registry.names():
        assert f"  {name}: " in printed
    assert (
        "dtypes float16, bfloat16, float32" in printed and "block sizes 16, 32, 64, 128" in printed
    )
    expected = "triton" if _env.interpreting() else "none"
    if torch.cuda.is_available():
        expected = "gluon" if torch.cuda.get_device_capability() == (9, 0) else "triton"
    assert f"MSA per-token selection here: {expected} (" in printed
