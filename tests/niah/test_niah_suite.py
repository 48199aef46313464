"""`flash-msa niah`: the tiny preset end to end, the time budget and resuming, the settings
it builds, and what it refuses."""

import json

import pytest
import torch

from flash_msa import _env
from flash_msa.cli import NIAH_INCOMPLETE, build_parser, main
from flash_msa.niah.model import VARIANTS
from flash_msa.niah.options import OPTIONS
from flash_msa.niah.suite import build_configs, check_device


@pytest.mark.skipif(not _env.interpreting(), reason="oracle_topk and msa need the interpreter")
def test_tiny_preset_runs_end_to_end(tmp_path, capsys):
    arguments = ["niah", "--tiny", "--checkpoint-dir", str(tmp_path / "checkpoints"),
                 "--out", str(tmp_path / "results")]  # fmt: skip
    assert main(arguments) == 0
    records = json.loads((tmp_path / "results" / "niah.json").read_text())
    assert {record["variant"] for record in records} == set(VARIANTS)
    assert {(r["context_len"], r["depth"]) for r in records} == {
        (n, d) for n in (64, 128) for d in (0.0, 1.0)
    }
    assert all(record["train_tokens_per_s"] > 0 for record in records)
    assert (tmp_path / "results" / "niah.png").stat().st_size > 0
    assert "Targets:" in (tmp_path / "results" / "niah.md").read_text()
    for variant in VARIANTS:
        assert (tmp_path / "checkpoints" / f"{variant}.pt").exists()
    capsys.readouterr()
    assert main(arguments) == 0  # everything reused: no training, no evaluation
    assert capsys.readouterr().out.count("trained and evaluated before") == len(VARIANTS)


def test_budget_stops_and_the_same_command_resumes(tmp_path, capsys):
    arguments = ["niah", "--tiny", "--variants", "dense", "--checkpoint-dir",
                 str(tmp_path / "checkpoints"), "--out", str(tmp_path / "results")]  # fmt: skip
    assert main([*arguments, "--max-minutes", "0"]) == NIAH_INCOMPLETE
    assert "stopped at step 1 of 2" in capsys.readouterr().out
    assert not (tmp_path / "results").exists()
    assert main(arguments) == 0
    assert "(resuming)" in capsys.readouterr().out
    records = json.loads((tmp_path / "results" / "niah.json").read_text())
    assert {record["variant"] for record in records} == {"dense"}
    assert records[0]["steps"] == 2


def test_results_of_another_commit_are_measured_again(tmp_path, capsys, monkeypatch):
    """A finished variant's results from another commit (or device) are not reused: its
    checkpoint is timed and evaluated again; a cut-short results file counts as absent and an
    unreadable checkpoint is named."""
    arguments = ["niah", "--tiny", "--variants", "dense", "--checkpoint-dir",
                 str(tmp_path / "checkpoints"), "--out", str(tmp_path / "results")]  # fmt: skip
    monkeypatch.setenv("FLASH_MSA_COMMIT", "aaaaaaa")
    assert main(arguments) == 0
    monkeypatch.setenv("FLASH_MSA_COMMIT", "bbbbbbb")
    capsys.readouterr()
    assert main(arguments) == 0
    out = capsys.readouterr().out
    assert "trained and evaluated before" not in out and "(resuming)" in out
    results = json.loads((tmp_path / "checkpoints" / "dense.json").read_text())
    assert results["meta"]["commit"] == "bbbbbbb"
    (tmp_path / "checkpoints" / "dense.json").write_text('{"settings": ')
    (tmp_path / "checkpoints" / "dense.pt").write_text("not a checkpoint")
    with pytest.raises(SystemExit):
        main(arguments)
    assert "dense.pt is unreadable" in capsys.readouterr().err


def test_settings_follow_the_options_then_the_preset():
    model, needles, train, grid = build_configs(tiny=True, dim=32, steps=None)
    assert (model.dim, model.layers, model.vocab_size) == (32, 2, needles.vocab_size)
    assert (train.steps, train.train_len, train.min_len) == (2, 128, 128)
    assert grid.context_lens == (64, 128)
    model, _, train, grid = build_configs(seed=5, train_len=256)
    assert (model.layers, model.dim, model.heads, model.kv_heads) == (4, 512, 8, 2)
    assert (train.seed, grid.seed, train.min_len, train.train_len) == (5, 5, 32, 256)
    assert (train.steps, train.lr, train.curriculum) == (2000, 1e-3, 0.6)
    _, _, train, _ = build_configs(train_len=16)  # the shortest length capped at the longest
    assert (train.min_len, train.train_len) == (16, 16)
    with pytest.raises(ValueError, match="unknown settings"):
        build_configs(width=3)


def test_refusals(capsys):
    with pytest.raises(ValueError, match="unknown variants"):
        check_device(["dense", "sparse"], torch.device("cpu"))
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        check_device(["msa"], torch.device("meta"))  # no Triton there
    with pytest.raises(SystemExit):
        main(["niah", "--context-lens", "2x"])
    assert "is not a token count" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["niah", "--tiny", "--variants", "dense,sparse"])
    assert "unknown variants ['sparse'] (--variants)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # before any variant trains
        main(["niah", "--tiny", "--variants", "dense", "--context-lens", "20"])
    assert "(--context-lens) must hold a sample of every task" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "steps (--steps) must be a positive int, got 0"),
        (["--seed", "-1"], "seed (--seed) must be an int >= 0, got -1"),
        (["--train-len", "100"], "train_len (--train-len) 100 must be min_len 32 (the shortest "
         "training length) times a power of two, e.g. 64 or 128"),
        (["--batch", "200"], "batch (--batch) 200 (the sequences of a step at train_len) is "
         "more than max_sequences 128: lower batch or raise max_sequences"),
        (["--layers", "0"], "layers (--layers) must be a positive int, got 0"),
        (["--kv-heads", "3"], "heads a multiple of kv_heads (--kv-heads) 3 (GQA)"),
        (["--dim", "36", "--heads", "4"], "head_dim 9 = dim (--dim) / heads (--heads) must be "
         "even"),
        (["--context-lens", "0"], "context_lens (--context-lens) must be positive ints, got 0"),
        (["--depths", "0,2"], "depths (--depths) must be fractions in [0, 1], got 2.0"),
        (["--depths", "0,0"], "and depths (--depths) (0.0, 0.0) must not repeat a value"),
        (["--samples", "0"], "samples (--samples) 0 and tokens_per_batch 65536 must be positive"),
        (["--tiny", "--variants", "dense", "--train-len", "16"], "min_len 16 (the shortest "
         "training length) cannot hold the training samples: they need at least 25 tokens; raise "
         "min_len and train_len (--train-len) to 25 or more"),
    ],
)  # fmt: skip
def test_bad_settings_name_their_options(argv, message, tmp_path, capsys):
    folders = ["--checkpoint-dir", str(tmp_path / "checkpoints"), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit):
        main(["niah", *argv, *folders])
    assert message in " ".join(capsys.readouterr().err.split())  # argparse's wrapping undone


def test_options_named_in_messages_are_the_commands():
    niah = build_parser()._subparsers._group_actions[0].choices["niah"]
    flags = {flag: action.dest for action in niah._actions for flag in action.option_strings}
    assert all(flags.get(flag) == field for field, flag in OPTIONS.items())


def test_help_names_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["niah", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for fragment in ("--max-minutes", "(default: 32k; 128 with --tiny)", "--checkpoint-dir",
                     f"exit status {NIAH_INCOMPLETE}"):  # fmt: skip
        assert fragment in text
