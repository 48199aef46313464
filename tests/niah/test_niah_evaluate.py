"""The needle grid: exact match of the answer tokens, one record per cell, the same samples
for every model."""

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from flash_msa.niah.evaluate import GridConfig, evaluate_grid, exact_matches, grid_samples
from flash_msa.niah.tasks import TASKS, Batch, NeedleConfig

NEEDLES = NeedleConfig()
GRID = GridConfig(context_lens=(64, 128), depths=(0.0, 0.5, 1.0), samples=3, tokens_per_batch=256)


class Copier(nn.Module):
    """Predicts the token that follows each position (it reads ahead: every answer right),
    or a constant token when wrong=True."""

    def __init__(self, wrong: bool = False):
        super().__init__()
        self.variant, self.wrong = "copier", wrong

    def forward(self, tokens, positions, *, warmup=False):
        following = torch.zeros_like(positions) if self.wrong else tokens.flatten()[positions + 1]
        return nn.functional.one_hot(following, NEEDLES.vocab_size).float(), None


def test_exact_match_needs_every_answer_token():
    targets = torch.tensor([5, 6, 7, 8, 9])
    none = torch.zeros(0, dtype=torch.long)
    batch = Batch(torch.zeros(3, 4, dtype=torch.long), torch.arange(5), targets,
                  torch.tensor([0, 0, 1, 1, 2]), none, none)  # fmt: skip
    logits = nn.functional.one_hot(torch.tensor([5, 6, 7, 0, 9]), 10).float()
    assert exact_matches(logits, batch).tolist() == [True, False, True]


@pytest.mark.parametrize("wrong", [False, True])
def test_grid_records_every_cell(wrong):
    records = evaluate_grid(Copier(wrong), NEEDLES, GRID, device=torch.device("cpu"),
                            progress=False)  # fmt: skip
    cells = [(r["context_len"], r["task"], r["depth"]) for r in records]
    assert cells == [(n, t, d) for n in GRID.context_lens for t in TASKS for d in GRID.depths]
    assert all(r["accuracy"] == (0.0 if wrong else 1.0) and r["samples"] == 3 for r in records)


def test_every_model_sees_the_same_samples():
    first, again = grid_samples(NEEDLES, GRID, 128), grid_samples(NEEDLES, GRID, 128)
    assert len(first) == len(TASKS) * len(GRID.depths) * GRID.samples
    for (cell, sample), (cell_again, sample_again) in zip(first, again, strict=True):
        assert cell == cell_again
        assert all(map(np.array_equal, sample, sample_again))
    other = grid_samples(NEEDLES, dataclasses.replace(GRID, seed=1), 128)
    assert not np.array_equal(first[0][1].tokens, other[0][1].tokens)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(context_lens=()), "at least one value"),
        (dict(depths=(0.5, 1.5)), r"depths \(--depths\) must be fractions"),
        (dict(context_lens=(64, 64)), "must not repeat"),
        (dict(samples=0), "must be positive"),
    ],
)
def test_grid_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        GridConfig(**fields)
