"""The benchmark's report: niah.json (one record per variant, context length and depth),
niah.md (the tables, chance levels and targets) and niah.png (a heat-map of the grid per
variant, side by side, and the training loss curves)."""

from __future__ import annotations

import datetime
import json
import pathlib
import platform
import statistics

import torch
import triton

from flash_msa.bench import source_commit
from flash_msa.niah.evaluate import GridConfig
from flash_msa.niah.model import VARIANTS, ModelConfig
from flash_msa.niah.tasks import TASKS, NeedleConfig
from flash_msa.niah.train import TrainConfig

TARGET_GAP = 0.02  # msa within 2 accuracy points of dense at the target length
TARGET_SPEEDUP = 2.0  # msa's training step at least 2x faster than dense there
TARGET_LEN = 32768


def run_meta(device: torch.device) -> dict:
    """The device, versions, date and commit of this run."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU ({platform.processor() or platform.machine()})"
    return dict(
        device=name, torch=torch.__version__, triton=triton.__version__,
        date=datetime.date.today().isoformat(), commit=source_commit(),
    )  # fmt: skip


def grid_records(results: dict[str, dict]) -> list[dict]:
    """niah.json's records: per variant, context length and depth, the accuracy averaged
    over the tasks (and per task), with the variant's training figures."""
    records = []
    for variant, result in results.items():
        cells: dict[tuple, dict] = {}
        for record in result["records"]:
            key = (record["context_len"], record["depth"])
            cells.setdefault(key, {})[record["task"]] = record["accuracy"]
        samples = result["records"][0]["samples"]
        for (length, depth), by_task in cells.items():
            records.append(
                dict(
                    variant=variant, context_len=length, depth=depth,
                    accuracy=statistics.fmean(by_task.values()), accuracy_by_task=by_task,
                    samples_per_task=samples, train_tokens_per_s=result["train_tokens_per_s"],
                    train_step_ms=result["train_step_ms"], train_step_len=result["step_len"],
                    steps=result["steps"],
                )
            )  # fmt: skip
    return records


def _mean(records: list[dict], **where) -> float:
    values = [r["accuracy"] for r in records if all(r[k] == v for k, v in where.items())]
    return statistics.fmean(values) if values else float("nan")


def label(length: int) -> str:
    """2048 -> "2K"; lengths under 1024 as they are."""
    return f"{length // 1024}K" if length >= 1024 else str(length)


def window_sees_needle(length: int, depth: float, model: ModelConfig, needles: NeedleConfig):
    """Whether the window variant's first answer prediction (at the query's last key token)
    sees the value of a single needle at depth: within window tokens of it (the whole blocks
    reach at least that far) or inside the sinks."""
    filler = length - 1 - (1 + needles.key_len + needles.value_len) - needles.needle_len
    start = 1 + round(depth * filler)  # the needle's NEEDLE token
    value_end = start + 1 + needles.key_len + needles.value_len  # exclusive
    query = length - 1 - needles.value_len
    return query - (value_end - needles.value_len) <= model.window or value_end <= model.sinks


def _smoothed(values: list[float], width: int) -> list[float]:
    sums, out = [0.0], []
    for value in values:
        sums.append(sums[-1] + value)
    for index in range(len(values)):
        low = max(0, index - width + 1)
        out.append((sums[index + 1] - sums[low]) / (index + 1 - low))
    return out


def write_png(path: pathlib.Path, records: list[dict], results: dict[str, dict]) -> None:
    """Heat-maps (context length x depth -> accuracy) per variant and the loss curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(results)
    lengths = sorted({r["context_len"] for r in records})
    depths = sorted({r["depth"] for r in records})
    figure, axes = plt.subplots(
        1, len(variants) + 1, figsize=(3.6 * len(variants) + 4.6, 3.8), squeeze=False
    )
    for axis, variant in zip(axes[0], variants, strict=False):
        grid = [
            [_mean(records, variant=variant, context_len=length, depth=depth) for depth in depths]
            for length in lengths
        ]
        image = axis.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        for row, values in enumerate(grid):
            for column, value in enumerate(values):
                color = "black" if value > 0.6 else "white"
                axis.text(column, row, f"{100 * value:.0f}", ha="center", va="center",
                          fontsize=7, color=color)  # fmt: skip
        axis.set_xticks(range(len(depths)), [f"{depth:g}" for depth in depths], fontsize=7)
        axis.set_yticks(range(len(lengths)), [label(length) for length in lengths])
        axis.set_xlabel("needle depth")
        tokens_per_s = results[variant]["train_tokens_per_s"]
        axis.set_title(f"{variant}\n{_mean(records, variant=variant):.1%} mean, "
                       f"{tokens_per_s / 1e3:,.0f}K tok/s", fontsize=9)  # fmt: skip
    axes[0][0].set_ylabel("context length")
    figure.colorbar(image, ax=axes[0][len(variants) - 1], fraction=0.05, label="accuracy")
    curves = axes[0][-1]
    for variant in variants:
        history = results[variant]["history"]
        width = max(1, len(history) // 50)
        curves.plot([h[0] for h in history], _smoothed([h[2] for h in history], width),
                    label=variant, linewidth=1)  # fmt: skip
    curves.set_yscale("log")
    curves.set_xlabel("step")
    curves.set_ylabel("answer loss (moving mean)")
    curves.legend(fontsize=8)
    curves.set_title("training", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _markdown(
    records: list[dict],
    results: dict[str, dict],
    *,
    model: ModelConfig,
    needles: NeedleConfig,
    train: TrainConfig,
    grid: GridConfig,
    meta: dict,
) -> list[str]:
    variants = list(results)
    lengths = sorted({r["context_len"] for r in records})
    target_len = TARGET_LEN if TARGET_LEN in lengths else lengths[-1]
    lines = [
        "# Needle in a haystack: dense, sliding window, oracle top-k and MSA",
        "",
        f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}; {meta['date']} at "
        f"commit {meta['commit']}. Written by `flash-msa niah` (flash_msa/niah/).",
        "",
        f"Llama-architecture models trained from random init, one per variant, on the same "
        f"data: {model.layers} layers, d {model.dim}, {model.heads} query / {model.kv_heads} "
        f"kv heads (head dim {model.head_dim}), SwiGLU {model.mlp_dim}, rotary base "
        f"{model.rope_base:g}, vocabulary {needles.vocab_size}. {train.steps} steps of "
        f"{train.batch * train.train_len:,} tokens (at most {train.max_sequences} sequences), "
        f"lengths {train.min_len}-{train.train_len} "
        f"(powers of two, the longest allowed growing over the first {train.curriculum:.0%} "
        f"of the steps), AdamW lr {train.lr:g}, loss on the answer tokens and (weight "
        f"{train.lm_weight:g}) the repeated haystack tokens. Variants: dense = "
        f"SDPA; window = {model.window} + {model.sinks} sinks (blocks of {model.block_size}); "
        f"oracle_topk = per head the top {model.top_k} key blocks of {model.kv_block} by the "
        f"true logits' block maxima; msa = MSAAttention, top {model.top_k} blocks of "
        f"{model.kv_block} after {train.msa_warmup:.0%} of the steps dense, KL weight "
        f"{train.kl_weight:g}. Grid: {grid.samples} samples per task and cell, accuracy = "
        "exact match of every answer token, averaged over the tasks.",
        "",
        "![needle grid](niah.png)",
        "",
        "| variant | " + " | ".join(map(label, lengths)) + " | mean |",
        "|---|" + "---|" * (len(lengths) + 1),
    ]
    for variant in variants:
        cells = [f"{_mean(records, variant=variant, context_len=n):.1%}" for n in lengths]
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | "
                     f"{_mean(records, variant=variant):.1%} |")  # fmt: skip
    lines += [
        "",
        f"Per task at {label(target_len)} (chance: guessing every value token uniformly):",
        "",
        "| variant | " + " | ".join(TASKS) + " |",
        "|---|" + "---|" * len(TASKS),
    ]
    for variant in variants:
        by_task = [
            statistics.fmean(
                r["accuracy_by_task"][task] for r in records
                if r["variant"] == variant and r["context_len"] == target_len
            )
            for task in TASKS
        ]  # fmt: skip
        lines.append(f"| {variant} | " + " | ".join(f"{value:.1%}" for value in by_task) + " |")
    lines.append("| chance | " + " | ".join(f"{needles.chance(t):.2g}" for t in TASKS) + " |")
    lines += [
        "",
        f"Tasks: single = one needle; multikey = {needles.multikey_needles} needles of distinct "
        f"keys, one queried (guessing one of the needles: {1 / needles.multikey_needles:.0%}); "
        f"multivalue = {needles.multivalue_values} needles of one key, every value asked in "
        f"order of appearance. Keys are {needles.key_len} token(s) of {needles.num_keys}, "
        f"values {needles.value_len} of {needles.num_values}, filler from {needles.num_filler} "
        "other tokens.",
        "",
        f"| variant | train tokens/s | step ms at {label(results[variants[0]]['step_len'])} "
        "(forward + backward, B=1) | vs dense | final answer loss |",
        "|---|---|---|---|---|",
    ]
    dense_ms = results["dense"]["train_step_ms"] if "dense" in results else None
    for variant in variants:
        result = results[variant]
        tail = [h[2] for h in result["history"][-max(1, len(result["history"]) // 20) :]]
        speedup = f"{dense_ms / result['train_step_ms']:.2f}x" if dense_ms else "-"
        lines.append(
            f"| {variant} | {result['train_tokens_per_s']:,.0f} | {result['train_step_ms']:.1f} "
            f"| {speedup} | {statistics.fmean(tail):.3f} |"
        )
    lines += ["", "Targets:", ""] + _targets(records, results, model, needles, target_len)
    return lines


def _targets(records, results, model, needles, target_len) -> list[str]:
    lines = []
    if {"dense", "msa"} <= results.keys():
        gap = _mean(records, variant="dense", context_len=target_len) - _mean(
            records, variant="msa", context_len=target_len
        )
        met = "met" if gap <= TARGET_GAP else "not met"
        lines.append(
            f"- msa within {100 * TARGET_GAP:.0f} points of dense at {target_len}: dense minus "
            f"msa = {100 * gap:+.1f} points ({met})"
        )
        speedup = results["dense"]["train_step_ms"] / results["msa"]["train_step_ms"]
        met = "met" if speedup >= TARGET_SPEEDUP else "not met"
        lines.append(
            f"- msa's training step at least {TARGET_SPEEDUP:g}x faster than dense at "
            f"{results['msa']['step_len']}: {speedup:.2f}x ({met})"
        )
    if "window" in results:
        seen = {True: [], False: []}
        for record in records:
            if record["variant"] == "window":
                visible = window_sees_needle(record["context_len"], record["depth"], model, needles)
                seen[visible].append(record["accuracy"])
        outside = statistics.fmean(seen[False]) if seen[False] else float("nan")
        inside = statistics.fmean(seen[True]) if seen[True] else float("nan")
        chance = statistics.fmean(needles.chance(task) for task in TASKS)
        lines.append(
            f"- window near chance for needles outside its window and sinks: {outside:.1%} over "
            f"{len(seen[False])} cells (chance {chance:.2g}), against {inside:.1%} over "
            f"{len(seen[True])} cells it can see"
        )
    return lines


def write_report(
    out_dir: pathlib.Path,
    results: dict[str, dict],
    *,
    model: ModelConfig,
    needles: NeedleConfig,
    train: TrainConfig,
    grid: GridConfig,
    meta: dict,
) -> list[pathlib.Path]:
    """Write niah.json, niah.md and niah.png into out_dir.

    Args:
        out_dir: the results directory (created if missing).
        results: variant -> its result: records (evaluate_grid's), history (TrainState's),
            train_tokens_per_s, train_step_ms, step_len (the length timed), steps.
        model, needles, train, grid: the settings of the run, described in niah.md.
        meta: run_meta(device).

    Returns:
        The paths written.
    """
    unknown = set(results) - set(VARIANTS)
    if unknown:
        raise ValueError(f"results name unknown variants {sorted(unknown)}; known: {VARIANTS}")
    out_dir.mkdir(parents=True, exist_ok=True)
    records = grid_records(results)
    paths = [out_dir / f"niah.{suffix}" for suffix in ("json", "md", "png")]
    paths[0].write_text(json.dumps(records, indent=1) + "\n")
    lines = _markdown(
        records, results, model=model, needles=needles, train=train, grid=grid, meta=meta
    )
    paths[1].write_text("\n".join(lines) + "\n")
    write_png(paths[2], records, results)
    return paths
