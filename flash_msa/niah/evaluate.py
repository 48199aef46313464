"""The needle grid: accuracy per (task, context length, needle depth), by exact match of
the answer tokens (every one the argmax of its teacher-forced logits)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from flash_msa.niah.model import NeedleLM
from flash_msa.niah.options import named
from flash_msa.niah.tasks import TASKS, Batch, NeedleConfig, collate, make_sample, seed_of


@dataclass(frozen=True)
class GridConfig:
    """The grid evaluated.

    Attributes:
        context_lens: lengths of the samples in tokens, the query and answer included.
        depths: fractions of the haystack where the queried needle starts (0 first, 1 last).
        samples: samples per task and cell.
        tokens_per_batch: tokens per forward (samples of one length are batched).
        seed: seed of the evaluation samples (drawn apart from the training data).
    """

    context_lens: tuple[int, ...] = (2048, 4096, 8192, 16384, 32768)
    depths: tuple[float, ...] = tuple(index / 10 for index in range(11))
    samples: int = 16
    tokens_per_batch: int = 65536
    seed: int = 0

    def __post_init__(self):
        if not self.context_lens or not self.depths:
            raise ValueError(
                f"{named('context_lens')} and {named('depths')} must each hold at least one value"
            )
        for length in self.context_lens:
            if not isinstance(length, int) or isinstance(length, bool) or length < 1:
                raise ValueError(f"{named('context_lens')} must be positive ints, got {length!r}")
        for depth in self.depths:
            if not 0.0 <= depth <= 1.0:
                raise ValueError(f"{named('depths')} must be fractions in [0, 1], got {depth!r}")
        repeated = len(set(self.context_lens)) < len(self.context_lens)
        if repeated or len(set(self.depths)) < len(self.depths):
            raise ValueError(
                f"{named('context_lens')} {self.context_lens} and {named('depths')} "
                f"{self.depths} must not repeat a value"
            )
        if self.samples < 1 or self.tokens_per_batch < 1:
            raise ValueError(
                f"{named('samples')} {self.samples} and tokens_per_batch "
                f"{self.tokens_per_batch} must be positive"
            )


def exact_matches(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """bool [B]: whether every answer token of each sample is its logits' argmax.

    Args:
        logits: [N, vocab] at batch.positions.
        batch: the samples and their answers.
    """
    wrong = (logits.argmax(dim=-1) != batch.targets).long()
    wrong_per_sample = torch.zeros(batch.tokens.shape[0], dtype=torch.long, device=wrong.device)
    wrong_per_sample.index_add_(0, batch.sample, wrong)
    return wrong_per_sample == 0


def grid_samples(needles: NeedleConfig, grid: GridConfig, length: int):
    """The evaluation samples of one context length: (cell, sample) pairs, cell = (task,
    depth), from generators seeded by (grid.seed, task, length, depth) alone."""
    pairs = []
    for task, depth in itertools.product(TASKS, grid.depths):
        seed = seed_of(grid.seed, "eval", task, length, round(depth * 1e6))
        rng = np.random.Generator(np.random.PCG64(seed))
        for _ in range(grid.samples):
            pairs.append(((task, depth), make_sample(task, length, needles, rng, depth=depth)))
    return pairs


@torch.no_grad()
def evaluate_grid(
    model: NeedleLM,
    needles: NeedleConfig,
    grid: GridConfig,
    *,
    device: torch.device,
    progress: bool = True,
) -> list[dict]:
    """Accuracy of model on every (task, context length, depth) of the grid; msa runs
    sparse (past its warm-up). The samples depend on grid.seed alone: every variant sees
    the same ones.

    Args:
        model: the trained NeedleLM on device.
        needles: the tasks' token ranges and shapes.
        grid: lengths, depths and samples per cell.
        device: where model is.
        progress: show a tqdm bar over the samples.

    Returns:
        One record per cell: task, context_len, depth, accuracy (0-1), samples.
    """
    model.eval()
    correct: dict[tuple, int] = {}
    total = len(TASKS) * len(grid.depths) * grid.samples * len(grid.context_lens)
    bar = tqdm(total=total, desc=f"{model.variant} grid", unit="sample", disable=not progress)
    for length in grid.context_lens:
        pairs = grid_samples(needles, grid, length)
        per_batch = max(1, grid.tokens_per_batch // length)
        for first in range(0, len(pairs), per_batch):
            chunk = pairs[first : first + per_batch]
            batch = collate([sample for _, sample in chunk]).to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits, _ = model(batch.tokens, batch.positions)
            for (cell, _), right in zip(chunk, exact_matches(logits, batch).tolist(), strict=True):
                correct[(length, *cell)] = correct.get((length, *cell), 0) + right
            bar.update(len(chunk))
    bar.close()
    return [
        dict(task=task, context_len=length, depth=depth,
             accuracy=correct[(length, task, depth)] / grid.samples, samples=grid.samples)
        for length in grid.context_lens
        for task in TASKS
        for depth in grid.depths
    ]  # fmt: skip
