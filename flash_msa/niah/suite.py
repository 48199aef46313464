"""The whole benchmark: train each variant (resumable, within a wall-clock budget), time
its training step, evaluate the grid, and write the report once every variant is done.

Per variant the checkpoint directory holds VARIANT.pt (the training checkpoint) and, once
trained and evaluated, VARIANT.json (its grid, timings and loss history), which later runs
reuse while the settings match.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import time
from collections.abc import Callable

import torch

from flash_msa import _env
from flash_msa.niah.evaluate import GridConfig, evaluate_grid
from flash_msa.niah.model import VARIANTS, ModelConfig, NeedleLM, init_parameters
from flash_msa.niah.report import label, run_meta, write_report
from flash_msa.niah.tasks import NeedleConfig
from flash_msa.niah.train import (
    TrainConfig,
    checkpoint_settings,
    measure_step_ms,
    schedule_flops,
    train,
)

TRITON_VARIANTS = ("oracle_topk", "msa")  # their selection runs Triton kernels

# The tiny preset: the whole benchmark on the CPU in seconds, a check that it runs (the
# Triton interpreter runs oracle_topk and msa). Its window, blocks and top_k are sparse at
# 128 tokens: a window of 32 + 16 sinks in blocks of 16, and one key block of 64.
TINY = dict(
    model=dict(layers=2, dim=64, heads=4, kv_heads=2, window=32, sinks=16, block_size=16,
               top_k=1, q_block=64, kv_block=64),
    train=dict(steps=2, train_len=128, min_len=128, lr_warmup=1),
    grid=dict(context_lens=(64, 128), depths=(0.0, 1.0), samples=1),
    timing_repeats=1,
)  # fmt: skip


def build_configs(
    *, tiny: bool = False, **options
) -> tuple[ModelConfig, NeedleConfig, TrainConfig, GridConfig]:
    """The run's settings from option values by field name (layers, dim, heads, kv_heads,
    checkpointing; steps, train_len, batch; context_lens, depths, samples; seed for the
    training and the grid); None or absent takes the tiny preset's value with tiny, else
    the default. The shortest training length is capped at train_len.

    Returns:
        model, needle, training and grid configs.
    """
    given = {name: value for name, value in options.items() if value is not None}
    kinds = dict(model=ModelConfig, train=TrainConfig, grid=GridConfig)
    fields = {group: {f.name for f in dataclasses.fields(kind)} for group, kind in kinds.items()}
    unknown = given.keys() - set().union(*fields.values())
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}")
    configs = {}
    for group in kinds:
        configs[group] = dict(TINY[group]) if tiny else {}
        configs[group].update({k: v for k, v in given.items() if k in fields[group]})
    needles = NeedleConfig()
    train_len = configs["train"].get("train_len", TrainConfig.train_len)
    min_len = configs["train"].get("min_len", TrainConfig.min_len)
    configs["train"]["min_len"] = min(min_len, train_len)
    return (
        ModelConfig(vocab_size=needles.vocab_size, **configs["model"]), needles,
        TrainConfig(**configs["train"]), GridConfig(**configs["grid"]),
    )  # fmt: skip


def check_device(variants: list[str], device: torch.device) -> None:
    """Refuse, before any training, unknown variants, variants whose kernels cannot run on
    device, and a missing matplotlib (the report needs it)."""
    unknown = [variant for variant in variants if variant not in VARIANTS]
    if unknown:
        raise ValueError(
            f"unknown variants {unknown} (--variants): choose among {', '.join(VARIANTS)}"
        )
    if importlib.util.find_spec("matplotlib") is None:
        raise ModuleNotFoundError(
            "flash-msa niah draws niah.png with matplotlib: pip install 'flash-msa[plot]'",
            name="matplotlib",
        )
    needs_triton = [variant for variant in variants if variant in TRITON_VARIANTS]
    if needs_triton and not _env.can_run_triton(device):
        raise ValueError(
            f"{', '.join(needs_triton)} run Triton kernels, which need a CUDA device or, on the "
            "CPU, TRITON_INTERPRET=1 set before the command starts "
            "(TRITON_INTERPRET=1 flash-msa niah --tiny)"
        )


def _cached(path: pathlib.Path, settings: dict, meta: dict) -> dict | None:
    """The results saved at path if they were made with these settings, on this device at
    this commit (else the finished checkpoint is timed and evaluated again, here)."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):  # absent, or cut short: the checkpoint still holds the work
        return None
    if not isinstance(result, dict) or not isinstance(result.get("meta"), dict):
        return None
    as_saved = json.loads(json.dumps(settings))  # tuples become lists, as in the file
    same_run = all(result["meta"].get(key) == meta[key] for key in ("device", "commit"))
    return result if same_run and result.get("settings") == as_saved else None


def run_suite(
    variants: list[str],
    *,
    model_config: ModelConfig,
    needles: NeedleConfig,
    train_config: TrainConfig,
    grid: GridConfig,
    device: torch.device,
    checkpoint_dir: pathlib.Path,
    out_dir: pathlib.Path,
    max_minutes: float | None = None,
    timing_repeats: int = 5,
    data_workers: int = 0,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> bool:
    """Train, time and evaluate each variant, then write niah.{json,md,png} to out_dir.

    Args:
        variants: names from VARIANTS, run in this order.
        model_config, needles, train_config, grid: the model, the tasks, the schedule and
            the evaluation grid (the same for every variant).
        device: where to train.
        checkpoint_dir: checkpoints and per-variant results; the same directory resumes.
        out_dir: where the report goes.
        max_minutes: wall-clock budget of this call: training saves and stops when it is
            spent (a later call with the same arguments resumes), checked after each step,
            so a call trains at least one step; None: no limit.
        timing_repeats: timed training steps per variant at train_len.
        data_workers: processes building training batches ahead of the steps.
        progress: tqdm bars.
        log: where the messages go.

    Returns:
        True when every variant is done and the report is written; False when the budget
        ran out first.
    """
    check_device(variants, device)
    if min(grid.context_lens) < needles.min_length():
        raise ValueError(
            f"the grid's context lengths (--context-lens) must hold a sample of every task, "
            f"at least {needles.min_length()} tokens; got {min(grid.context_lens)}"
        )
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    grid_settings = dataclasses.asdict(grid)
    meta = run_meta(device)
    results, worked = {}, False
    for variant in variants:
        model = NeedleLM(variant, model_config)
        settings = {
            **checkpoint_settings(model, needles, train_config, device), "grid": grid_settings
        }
        results_path = checkpoint_dir / f"{variant}.json"
        cached = _cached(results_path, settings, meta)
        if cached is not None:
            log(f"{variant}: trained and evaluated before ({results_path})")
            results[variant] = cached
            continue
        if deadline is not None and time.monotonic() >= deadline and worked:
            log(f"{variant}: not started, the {max_minutes:g}-minute budget is spent")
            return False
        worked = True  # every call trains at least one step, however small its budget
        init_parameters(model, train_config.seed)
        model.to(device)
        checkpoint_path = checkpoint_dir / f"{variant}.pt"
        tokens = train_config.batch * train_config.train_len
        log(
            f"{variant}: {train_config.steps} steps of {tokens:,} tokens (at most "
            f"{train_config.max_sequences} sequences), lengths "
            f"{label(train_config.min_len)}-{label(train_config.train_len)}, "
            f"{schedule_flops(model_config, variant, train_config, 0) / 1e15:.2f} PFLOP in all"
            f"; checkpoint {checkpoint_path}" + (" (resuming)" if checkpoint_path.exists() else "")
        )
        state = train(
            model, needles, train_config, device=device, checkpoint_path=checkpoint_path,
            deadline=deadline, progress=progress, data_workers=data_workers,
        )  # fmt: skip
        if state.step < train_config.steps:
            log(
                f"{variant}: stopped at step {state.step} of {train_config.steps} by the "
                f"{max_minutes:g}-minute budget; run the same command again to resume"
            )
            return False
        step_ms = measure_step_ms(
            model, needles, train_config, train_config.train_len, device=device,
            repeats=timing_repeats,
        )  # fmt: skip
        log(
            f"{variant}: trained {state.tokens:,} tokens at {state.tokens_per_second:,.0f} "
            f"tokens/s; a step at {label(train_config.train_len)} takes {step_ms:.1f} ms"
        )
        records = evaluate_grid(model, needles, grid, device=device, progress=progress)
        results[variant] = dict(
            settings=settings, records=records, history=state.history,
            train_tokens_per_s=state.tokens_per_second, train_seconds=state.train_seconds,
            tokens=state.tokens, train_step_ms=step_ms, step_len=train_config.train_len,
            steps=state.step, meta=meta,
        )  # fmt: skip
        partial = results_path.with_name(results_path.name + ".partial")
        partial.write_text(json.dumps(results[variant]) + "\n")
        partial.replace(results_path)  # whole or not at all
        mean = sum(r["accuracy"] for r in records) / len(records)
        log(f"{variant}: grid mean accuracy {mean:.1%} ({results_path})")
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    paths = write_report(
        out_dir, results, model=model_config, needles=needles, train=train_config, grid=grid,
        meta=meta,
    )  # fmt: skip
    log("wrote " + ", ".join(map(str, paths)))
    return True
