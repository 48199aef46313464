"""Training of one variant on the needle tasks: the schedule, the loop and its checkpoint.

Every step holds batch * train_len tokens (at most max_sequences samples, which caps the
shortest lengths): samples of one length, drawn from the powers of two between min_len and
train_len, the longest allowed growing over the first `curriculum` fraction of the steps.
The first steps hold only min_len = 32 tokens per sample, mostly needles, queries and
answers: where a fresh model's uniform attention gives a needle the most weight, and so
where the lookup starts to be learned. Long contexts then teach the attention to stay sharp
over 32K keys. Lengths, tasks and tokens are functions of (seed, step), so every variant
trains on the same data. The loss is the mean cross-entropy over the answer tokens and the
haystack's repeated phrase tokens, each of these weighing lm_weight (a language-model loss
where the haystack can be predicted: it teaches copying from context, which the answers
need, long before the few answer tokens alone would), plus kl_weight * the KL loss for msa,
which attends densely for the first msa_warmup fraction.
AdamW, linear warm-up then cosine decay to a tenth, bf16 autocast on a GPU.

A checkpoint (model, optimizer, step, RNG states, loss history, time and tokens trained)
is written every checkpoint_every steps, at the end, when the deadline passes and when
Ctrl-C (KeyboardInterrupt) stops training, unless it lands mid-update; a run given the same
checkpoint path resumes from it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from flash_msa.niah.model import ModelConfig, NeedleLM
from flash_msa.niah.options import named
from flash_msa.niah.tasks import NeedleConfig, seed_of, training_batch


def _is_real(value) -> bool:
    """An int or float, not a bool (NaN passes here and fails the range checks)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class TrainConfig:
    """The schedule and the optimiser.

    Attributes:
        steps: optimiser steps.
        train_len, min_len: the longest and the shortest training length, in tokens; powers
            of two apart.
        batch: sequences per step at train_len; shorter steps hold proportionally more, so
            every step trains batch * train_len tokens, up to max_sequences sequences.
        max_sequences: the most sequences of a step: steps of the shortest lengths train
            fewer tokens, and their batches (built sample by sample) stay quick to build.
        lr, lr_warmup, weight_decay, grad_clip: AdamW's peak learning rate, its linear
            warm-up in steps, decoupled weight decay (matrices only), global norm clip.
        lm_weight: weight of a repeated haystack token against an answer token's 1.
        kl_weight: weight of msa's KL loss in the loss.
        msa_warmup: fraction of the steps msa attends densely.
        curriculum: fraction of the steps over which the longest length grows to train_len.
        checkpoint_every: steps between checkpoints.
        seed: seed of the data and of the initial parameters.
    """

    steps: int = 2000
    train_len: int = 32768
    min_len: int = 32
    batch: int = 1
    max_sequences: int = 128
    lr: float = 1e-3
    lr_warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    lm_weight: float = 0.25
    kl_weight: float = 0.1
    msa_warmup: float = 0.5
    curriculum: float = 0.6
    checkpoint_every: int = 500
    seed: int = 0

    def __post_init__(self):
        positive = ("steps", "train_len", "min_len", "batch", "max_sequences", "checkpoint_every")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{named(name)} must be a positive int, got {value!r}")
        if self.max_sequences < self.batch:
            raise ValueError(
                f"{named('batch')} {self.batch} (the sequences of a step at train_len) is more "
                f"than max_sequences {self.max_sequences}: lower batch or raise max_sequences"
            )
        ratio = self.train_len // self.min_len
        if self.train_len % self.min_len or ratio & (ratio - 1):
            below = self.min_len << max(ratio.bit_length() - 1, 0)
            raise ValueError(
                f"{named('train_len')} {self.train_len} must be min_len {self.min_len} (the "
                f"shortest training length) times a power of two, e.g. {below} or {2 * below}"
            )
        for name in ("msa_warmup", "curriculum"):
            value = getattr(self, name)
            if not _is_real(value) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a fraction in [0, 1], got {value!r}")
        for name in ("lr", "grad_clip"):  # positive
            value = getattr(self, name)
            if not _is_real(value) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        for name in ("weight_decay", "lm_weight", "kl_weight"):  # zero allowed
            value = getattr(self, name)
            if not _is_real(value) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("lr_warmup", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{named(name)} must be an int >= 0, got {value!r}")

    def lengths(self) -> list[int]:
        """The training lengths, shortest first."""
        count = (self.train_len // self.min_len).bit_length()
        return [self.min_len << index for index in range(count)]

    def length_at(self, step: int) -> int:
        """The length of a step's samples: uniform over the lengths the curriculum allows."""
        lengths = self.lengths()
        ramp = self.curriculum * self.steps
        allowed = len(lengths) if step >= ramp else 1 + int(step / ramp * len(lengths))
        rng = np.random.Generator(np.random.PCG64(seed_of(self.seed, "length", step)))
        return lengths[int(rng.integers(0, min(allowed, len(lengths))))]

    def batch_size_at(self, length: int) -> int:
        """Sequences of a step at length: batch * train_len tokens, at most max_sequences."""
        return min(self.batch * self.train_len // length, self.max_sequences)

    def lr_at(self, step: int) -> float:
        """Linear warm-up over lr_warmup steps, then cosine decay to lr / 10."""
        if step < self.lr_warmup:
            return self.lr * (step + 1) / self.lr_warmup
        progress = (step - self.lr_warmup) / max(1, self.steps - self.lr_warmup)
        return self.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))

    def dense_warmup_at(self, step: int, variant: str) -> bool:
        """Whether msa attends densely at a step (False for the other variants)."""
        return variant == "msa" and step < self.msa_warmup * self.steps


@dataclass
class TrainState:
    """Progress: steps done, [step, length, answer loss, KL loss or NaN, haystack loss] per
    step, and the seconds and tokens spent training."""

    step: int = 0
    history: list[list[float]] = field(default_factory=list)
    train_seconds: float = 0.0
    tokens: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.train_seconds if self.train_seconds else 0.0


class StepBatches(torch.utils.data.Dataset):
    """The training batch of each step, indexed by the step (for a DataLoader's workers)."""

    def __init__(self, needles: NeedleConfig, config: TrainConfig):
        self.needles, self.config = needles, config

    def __len__(self) -> int:
        return self.config.steps

    def __getitem__(self, step: int):
        length = self.config.length_at(step)
        batch_size = self.config.batch_size_at(length)
        return training_batch(step, length, batch_size, self.needles, self.config.seed)


def step_flops(config: ModelConfig, variant: str, length: int, tokens: int) -> float:
    """Model FLOPs of one forward + backward over tokens tokens of samples of length:
    6 per parameter and token for the projections, and 3.5x the attention's forward
    (4 * keys * head_dim per query head and query) over the keys each variant attends."""
    kv_dim = config.kv_heads * config.head_dim
    per_layer = config.dim * (2 * config.dim + 2 * kv_dim) + 3 * config.dim * config.mlp_dim
    positions = np.arange(1, length + 1)
    kept = {
        "dense": length,
        "window": config.window + config.sinks,
        "oracle_topk": config.top_k * config.kv_block,
        "msa": config.top_k * config.kv_block,
    }[variant]
    keys = float(np.minimum(positions, kept).mean())
    attention = 3.5 * 4 * keys * config.heads * config.head_dim
    return config.layers * tokens * (6 * per_layer + attention)


def schedule_flops(model: ModelConfig, variant: str, config: TrainConfig, start: int) -> float:
    """Model FLOPs of steps start .. steps - 1 (for the progress bar and its ETA)."""
    costs = {
        length: step_flops(model, variant, length, config.batch_size_at(length) * length)
        for length in config.lengths()
    }
    return sum(costs[config.length_at(step)] for step in range(start, config.steps))


def _optimizer(model: NeedleLM, config: TrainConfig, device: torch.device):
    matrices = [parameter for parameter in model.parameters() if parameter.dim() >= 2]
    vectors = [parameter for parameter in model.parameters() if parameter.dim() < 2]
    groups = [
        {"params": matrices, "weight_decay": config.weight_decay},
        {"params": vectors, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def checkpoint_settings(
    model: NeedleLM, needles: NeedleConfig, config: TrainConfig, device: torch.device
) -> dict:
    """What a checkpoint must match to be resumed, flat ("model.dim": 512, ...), with the
    device type (CUDA trains in bf16 autocast, the CPU in fp32); activation checkpointing and
    the checkpoint interval may change between runs."""
    groups = dict(model=model.config, train=config, needles=needles)
    settings = {
        f"{group}.{name}": value
        for group, values in groups.items()
        for name, value in dataclasses.asdict(values).items()
    }
    del settings["model.checkpointing"], settings["train.checkpoint_every"]
    return {"variant": model.variant, "device": device.type, **settings}


def _named_setting(name: str) -> str:
    """A checkpoint setting's name ("model.dim"), with its `flash-msa niah` option where the
    field has one: "model.dim (--dim)"."""
    group, _, field_name = name.rpartition(".")
    return f"{group}.{named(field_name)}" if group else name


def save_checkpoint(path: pathlib.Path, model, optimizer, state: TrainState, settings) -> None:
    """Write the checkpoint atomically (a crash mid-write leaves the previous one)."""
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    payload = dict(
        model=model.state_dict(), optimizer=optimizer.state_dict(),
        state=dataclasses.asdict(state), rng=rng, settings=settings,
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(payload, partial)
    os.replace(partial, path)


def _unreadable_reason(error: Exception) -> str:
    """Why torch.load refused a checkpoint, in a line: under weights_only torch wraps the
    reason in a page of advice (the whole error stays chained to ours)."""
    text = str(error)
    if not text.startswith("Weights only load failed"):
        return f"{type(error).__name__}: {text}" if text else type(error).__name__
    found = re.search(r"WeightsUnpickler error:\s*([^.\n]*)", text)
    detail = found.group(1).strip() if found else ""
    return f"weights_only refused it: {detail}" if detail else "not a file torch.save wrote"


def load_checkpoint(path: pathlib.Path, model, optimizer, settings) -> TrainState:
    """Restore model, optimiser and RNG states from path; the state to continue from.

    The file is read with weights_only: save_checkpoint writes tensors, dicts, lists, tuples,
    numbers, strings and None only, and a file holding anything else (code that would run as
    it loads) is refused as unreadable.
    """
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        saved = payload["settings"]
    except Exception as error:  # noqa: BLE001 - any unreadable file gets the same advice
        raise ValueError(
            f"checkpoint {path} is unreadable ({_unreadable_reason(error)}): delete it, or pass "
            "another checkpoint directory"
        ) from error
    differences = [
        f"{_named_setting(name)}={saved.get(name)!r} (now {settings.get(name)!r})"
        for name in sorted(saved.keys() | settings.keys())
        if saved.get(name) != settings.get(name)
    ]
    if differences:
        raise ValueError(
            f"checkpoint {path} was trained with {', '.join(differences)}: pass the same "
            "options to resume it, or another checkpoint directory to start afresh"
        )
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    torch.set_rng_state(payload["rng"]["torch"])
    if "cuda" in payload["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(payload["rng"]["cuda"])
    return TrainState(**payload["state"])


def _losses(model: NeedleLM, batch, warmup: bool, config: TrainConfig, device: torch.device):
    """(loss to minimise, answer loss, haystack loss, KL loss or None) of a batch on device."""
    positions = torch.cat([batch.positions, batch.repeat_positions])
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits, kl_loss = model(batch.tokens, positions, warmup=warmup)
    answers, repeats = len(batch.positions), len(batch.repeat_positions)
    answer_sum = F.cross_entropy(logits[:answers], batch.targets, reduction="sum")
    repeat_sum = F.cross_entropy(logits[answers:], batch.repeat_targets, reduction="sum")
    loss = (answer_sum + config.lm_weight * repeat_sum) / (answers + config.lm_weight * repeats)
    task_loss, repeat_loss = answer_sum / answers, repeat_sum / max(repeats, 1)
    if kl_loss is not None:
        loss = loss + config.kl_weight * kl_loss
    return loss, task_loss, repeat_loss, kl_loss


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(
    model: NeedleLM,
    needles: NeedleConfig,
    config: TrainConfig,
    *,
    device: torch.device,
    checkpoint_path: pathlib.Path,
    deadline: float | None = None,
    progress: bool = True,
    data_workers: int = 0,
) -> TrainState:
    """Train model (already on device), resuming from checkpoint_path if it exists.

    Args:
        model: the variant's NeedleLM, initialised (init_parameters) when starting afresh.
        needles: the tasks' token ranges and shapes.
        config: the schedule and optimiser.
        device: where model is.
        checkpoint_path: the checkpoint file, read to resume and written as training goes.
        deadline: time.monotonic() after which training saves and stops (checked after
            each step, so a call makes at least one step); None: train to the end.
        progress: show a tqdm bar over the schedule's model FLOPs, so that its rate is
            FLOP/s and its ETA allows for the longer steps ahead.
        data_workers: processes building the batches ahead of the steps (0: built in this
            process, between steps).

    Returns:
        The TrainState reached; state.step < config.steps when the deadline stopped it.

    Raises:
        KeyboardInterrupt: again, after writing the checkpoint of the steps completed (none
            written when it lands between an optimizer step and its count: the previous
            checkpoint then holds the latest state that matches its step).
    """
    if config.min_len < needles.min_length():
        raise ValueError(
            f"min_len {config.min_len} (the shortest training length) cannot hold the training "
            f"samples: they need at least {needles.min_length()} tokens; raise min_len and "
            f"{named('train_len')} to {needles.min_length()} or more, or shrink the tasks"
        )
    optimizer = _optimizer(model, config, device)
    settings = checkpoint_settings(model, needles, config, device)
    state = TrainState()
    if checkpoint_path.exists():
        state = load_checkpoint(checkpoint_path, model, optimizer, settings)
    if state.step >= config.steps:
        return state
    model.train()
    bar = tqdm(
        total=schedule_flops(model.config, model.variant, config, state.step),
        unit="FLOP", unit_scale=True, desc=model.variant, disable=not progress,
        bar_format="{desc}: {percentage:3.0f}%|{bar:20}| {elapsed}<{remaining}, "
        "{rate_fmt}{postfix}",
    )  # fmt: skip

    loader = torch.utils.data.DataLoader(
        StepBatches(needles, config), batch_size=None, sampler=range(state.step, config.steps),
        num_workers=data_workers, prefetch_factor=4 if data_workers else None,
    )  # fmt: skip
    _synchronize(device)
    started = time.perf_counter()
    # True from an optimizer step until state counts it: model and state then disagree
    updating = False
    try:
        for batch in loader:
            batch = batch.to(device)
            step, length = state.step, batch.tokens.shape[1]
            for group in optimizer.param_groups:
                group["lr"] = config.lr_at(step)
            warmup = config.dense_warmup_at(step, model.variant)
            loss, task_loss, repeat_loss, kl_loss = _losses(model, batch, warmup, config, device)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            tokens = batch.tokens.numel()
            kl_value = float("nan") if kl_loss is None else kl_loss.item()
            # .item() waits for the backward, before the update: an interrupt that waits
            # there finds model and state at the previous step
            history = [step, length, task_loss.item(), kl_value, repeat_loss.item()]
            updating = True
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state.step, state.tokens = step + 1, state.tokens + tokens
            state.history.append(history)
            updating = False
            now = time.perf_counter()
            state.train_seconds += now - started
            started = now
            bar.update(step_flops(model.config, model.variant, length, tokens))
            bar.set_postfix_str(
                f"step {state.step}/{config.steps}, len {length}, answer loss {history[2]:.3f}, "
                f"haystack loss {history[4]:.3f}"
                + ("" if kl_loss is None else f", kl {kl_value:.3f}")
                + (" (dense warm-up)" if warmup else "")
                + f", {state.tokens_per_second / 1e6:.2f}M tok/s"
            )
            out_of_time = deadline is not None and time.monotonic() >= deadline
            save = state.step % config.checkpoint_every == 0 or state.step == config.steps
            if save or out_of_time:
                save_checkpoint(checkpoint_path, model, optimizer, state, settings)
                started = time.perf_counter()  # the save is not training time
            if out_of_time:
                break
    except KeyboardInterrupt:
        if not updating:  # mid-update, the last checkpoint is the latest consistent state
            save_checkpoint(checkpoint_path, model, optimizer, state, settings)
        raise
    finally:
        bar.close()
    return state


def measure_step_ms(
    model: NeedleLM,
    needles: NeedleConfig,
    config: TrainConfig,
    length: int,
    *,
    device: torch.device,
    repeats: int = 5,
) -> float:
    """Median ms of one training forward + backward of a single sample of length tokens
    (msa past its warm-up), after one untimed call; gradients are cleared afterwards and
    no parameter changes.

    Args:
        model: the trained NeedleLM on device.
        needles, config: the tasks and the schedule (the data seed and the loss weights).
        length: tokens of the sample.
        device: where model is.
        repeats: timed calls.

    Returns:
        The median wall time in milliseconds.
    """
    batch = training_batch(-1, length, 1, needles, config.seed).to(device)
    times = []
    for call in range(repeats + 1):
        _synchronize(device)
        start = time.perf_counter()
        loss = _losses(model, batch, False, config, device)[0]
        loss.backward()
        _synchronize(device)
        if call:
            times.append(1e3 * (time.perf_counter() - start))
        model.zero_grad(set_to_none=True)
    return statistics.median(times)
