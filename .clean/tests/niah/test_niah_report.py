"""The report: niah.json records with the required keys, niah.md's tables, chance levels and
targets, and the niah.png picture."""

import json

import pytest
import torch

from flash_msa.niah.evaluate import GridConfig
from flash_msa.niah.model import VARIANTS, ModelConfig
from flash_msa.niah.report import run_meta, window_sees_needle, write_report
from flash_msa.niah.tasks import TASKS, NeedleConfig
from flash_msa.niah.train import TrainConfig

NEEDLES = NeedleConfig()
MODEL = ModelConfig(vocab_size=NEEDLES.vocab_size)
TRAIN = TrainConfig(steps=10)
GRID = GridConfig(context_lens=(4096, 32768), depths=(0.0, 0.5, 1.0), samples=2)


def results() -> dict:
    """Made-up results: window right only at depth 1, the others right everywhere."""
    out = {}
    for index, variant in enumerate(VARIANTS):
        records = [
            dict(task=task, context_len=length, depth=depth, samples=2,
                 accuracy=1.0 if variant != "window" or depth == 1.0 else 0.0)
            for length in GRID.context_lens for task in TASKS for depth in GRID.depths
        ]  # fmt: skip
        out[variant] = dict(
            records=records, history=[[step, 512, 4.0 / (step + 1), 0.1] for step in range(10)],
            train_tokens_per_s=1e6 * (index + 1), train_step_ms=100.0 / (index + 1),
            step_len=32768, steps=10,
        )  # fmt: skip
    return out


def test_report_writes_json_md_and_png(tmp_path):
    paths = write_report(
        tmp_path / "h200", results(), model=MODEL, needles=NEEDLES, train=TRAIN, grid=GRID,
        meta=run_meta(torch.device("cpu")),
    )  # fmt: skip
    assert [path.name for path in paths] == ["niah.json", "niah.md", "niah.png"]
    records = json.loads(paths[0].read_text())
    assert len(records) == len(VARIANTS) * len(GRID.context_lens) * len(GRID.depths)
    for record in records:
        assert {"variant", "context_len", "depth", "accuracy", "train_tokens_per_s"} <= set(record)
        assert record["variant"] in VARIANTS and 0.0 <= record["accuracy"] <= 1.0
        assert set(record["accuracy_by_task"]) == set(TASKS)
    window = {(r["context_len"], r["depth"]): r["accuracy"] for r in records
              if r["variant"] == "window"}  # fmt: skip
    assert window[(32768, 1.0)] == 1.0 and window[(32768, 0.5)] == 0.0
    text = paths[1].read_text()
    assert "![needle grid](niah.png)" in text and "| chance | 0.00024 | 0.00024 | 6e-08 |" in text
    assert "dense minus msa = +0.0 points (met)" in text
    assert "4.00x (met)" in text  # dense 100 ms, msa 25 ms
    assert "window near chance for needles outside its window and sinks: 0.0%" in text
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_window_visibility_follows_the_needle_distance():
    assert window_sees_needle(32768, 1.0, MODEL, NEEDLES)
    assert not window_sees_needle(32768, 0.5, MODEL, NEEDLES)
    assert window_sees_needle(32768, 0.0, MODEL, NEEDLES)  # inside the 128 sinks
    assert window_sees_needle(4096, 0.5, MODEL, NEEDLES)


def test_unknown_variants_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown variants"):
        write_report(tmp_path, {"sparse": {}}, model=MODEL, needles=NEEDLES, train=TRAIN,
                     grid=GRID, meta={})  # fmt: skip
