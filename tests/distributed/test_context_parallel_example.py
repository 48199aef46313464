"""examples/context_parallel.py refuses each bad argument by name, with the fix, before any
process group is made (its parse_args, in this process: no ranks are started)."""

import importlib.util
import pathlib

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "context_parallel.py"
SPEC = importlib.util.spec_from_file_location("context_parallel", SCRIPT)
EXAMPLE = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(EXAMPLE)


@pytest.fixture
def two_ranks(monkeypatch):
    """The environment torchrun --nproc-per-node 2 gives rank 0, on the CPU."""
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", TRITON_INTERPRET="1").items():
        monkeypatch.setenv(name, value)


def refusal(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit:
        EXAMPLE.parse_args(argv)
    assert exit.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seq-len", "0"], "--seq-len must be a positive number of tokens, got 0"),
        (["--seq-len", "64"], "--seq-len 64 makes 1 block(s) of 64 tokens for 2 ranks, each of "
         "which holds at least one: pass --seq-len 65 or more, or start fewer ranks"),
        (["--steps", "0"], "--steps must be a positive int, got 0"),
        (["--warmup-steps", "-1"], "--warmup-steps must be in [0, --steps 4], got -1"),
        (["--steps", "2", "--warmup-steps", "3"], "--warmup-steps must be in [0, --steps 2]"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--seq-len", "many"], "argument --seq-len: invalid int value: 'many'"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused(argv, message, two_ranks, capsys):
    assert message in refusal(capsys, ["--device", "cpu", *argv])


def test_the_environment_is_checked(two_ranks, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "set TRITON_INTERPRET=1 for the command" in refusal(capsys, ["--device", "cpu"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA device here; pass --device cpu" in refusal(capsys, ["--device", "cuda"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert "local rank 1 has no GPU of its own (1 here): start at most 1 ranks per node" in (
        refusal(capsys, ["--device", "cuda"])
    )
    monkeypatch.delenv("RANK")
    assert "RANK not set: start the ranks with torchrun" in refusal(capsys, ["--device", "cpu"])


def test_the_readme_command_passes(two_ranks):
    args = EXAMPLE.parse_args(["--device", "cpu", "--seq-len", "256", "--steps", "2"])
    assert (args.device, args.seq_len, args.steps, args.warmup_steps) == ("cpu", 256, 2, 1)
