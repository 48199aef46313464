"""examples/train_million.py in parts: a run stopped by --max-minutes and a second run with
the same --checkpoint, which resumes and finishes the schedule; a --seq-len too short for a
sample is refused by that option's name."""

import json
import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "train_million.py"
ARGS = ["--device", "cpu", "--seq-len", "512", "--layers", "2", "--dim", "64", "--steps", "3"]


def run(tmp_path, *extra) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    command = [sys.executable, str(SCRIPT), *ARGS, "--out", str(tmp_path), *extra]
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=600)
    return json.loads((tmp_path / "train_million.json").read_text())


def test_a_run_resumes_from_its_checkpoint(tmp_path):
    checkpoint = tmp_path / "million.pt"
    stopped = run(tmp_path, "--checkpoint", str(checkpoint), "--max-minutes", "0.0001")
    assert stopped["steps"] == 2 and stopped["planned_steps"] == 3  # the first, then one more
    assert checkpoint.exists()
    resumed = run(tmp_path, "--checkpoint", str(checkpoint))
    assert resumed["steps"] == 3 and [row[0] for row in resumed["history"]] == [0, 1, 2]
    assert resumed["history"][:2] == stopped["history"]
    assert resumed["first_step_seconds"] == stopped["first_step_seconds"]


def test_a_bad_seq_len_is_refused_by_its_own_option(tmp_path):
    command = [sys.executable, str(SCRIPT), *ARGS, "--out", str(tmp_path), "--seq-len", "16"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--seq-len 16 cannot hold a needle sample: pass 25 tokens or more" in done.stderr
