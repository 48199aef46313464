"""Train a Llama-architecture MSA language model at a million tokens per step on one GPU.

    python examples/train_million.py                       # H200: 8 layers, d 1024, 1M tokens
    python examples/train_million.py --max-minutes 9 --checkpoint /root/million.pt
                                    # the same in parts: run again to resume from the file
    TRITON_INTERPRET=1 python examples/train_million.py --device cpu --seq-len 512 \\
        --layers 2 --dim 64 --steps 2                      # the CPU, seconds: a check it runs

The model is the needle benchmark's (flash_msa.niah: pre-norm decoder layers, rotary GQA,
SwiGLU) with MSAAttention in every layer: a proxy attention selects top_k 16 key blocks of
128 per query block of 64 and learns from the KL loss, the main attention runs over them
(msa_func: selection, attention and KL in Triton kernels). Every layer's activations are
recomputed in the backward (torch.utils.checkpoint), the matrices run in bf16 (autocast) and
there is no dense warm-up: at 1M tokens a dense step would take minutes. The data are the
needle suite's training samples at one length (one sequence of --seq-len tokens a step):
haystacks of repeated phrases with key -> value needles queried later, the loss over the
answers and the repeated phrase tokens (flash_msa.niah.train).

Reports tokens per second (all steps, and past the first, which compiles and tunes the
kernels; a resumed run's first step tunes them again), peak memory and the loss curve;
writes them to --out (default benchmarks/results/<gpu>/, benchmarks/results/cpu/ on the
CPU) as train_million.json and train_million.md, and prints them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import resource
import tempfile
import time

import torch

from flash_msa.bench import parse_length
from flash_msa.layout import checked_device
from flash_msa.niah import ModelConfig, NeedleConfig, NeedleLM, TrainConfig, init_parameters, train
from flash_msa.niah.report import run_meta

NAME = "train_million"


def default_out(device: torch.device) -> pathlib.Path:
    """benchmarks/results/<gpu>/ of this repository (e.g. h200), or .../cpu/."""
    folder = "cpu"
    if device.type == "cuda":
        folder = torch.cuda.get_device_name(device).split()[-1].lower()
    return pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results" / folder


def peak_memory_gib(device: torch.device) -> float:
    """The GPU's peak allocated memory, or this process's peak resident memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def curve_rows(history: list[list[float]], points: int = 20) -> list[list[float]]:
    """About `points` rows of the history, evenly spaced, the last one included."""
    stride = max(1, len(history) // points)
    rows = history[::stride]
    return rows if rows[-1] is history[-1] else [*rows, history[-1]]


def markdown(result: dict) -> str:
    model, steady = result["model"], result["tokens_per_second_after_first"]
    summary = [
        ("device", result["device"]),
        ("model", f"{model['layers']} layers, d {model['dim']}, {model['heads']} query / "
                  f"{model['kv_heads']} kv heads, {result['parameters'] / 1e6:.1f}M parameters"),
        ("attention", f"MSAAttention: granularity {model['granularity']}, top_k "
                      f"{model['top_k']}, q_block {model['q_block']}, kv_block "
                      f"{model['kv_block']}, proxy heads {result['proxy_heads']}"),
        ("tokens per step", f"{result['seq_len']:,}"),
        ("steps", f"{result['steps']} of {result['planned_steps']}" + (
            f" (stopped by --max-minutes {result['max_minutes']:g})"
            if result["steps"] < result["planned_steps"] else "")),
        ("tokens / s (all steps)", f"{result['tokens_per_second']:,.0f}"),
        ("tokens / s (after the first step)", "-" if steady is None else f"{steady:,.0f}"),
        ("first step s", f"{result['first_step_seconds']:.1f}"),
        (result["memory_kind"], f"{result['peak_memory_gib']:.2f} GiB"),
    ]  # fmt: skip
    lines = [
        "# Training at a million tokens per step", "",
        f"{result['device']}; torch {result['torch']}, triton {result['triton']}; "
        f"{result['date']} at commit {result['commit']}. {result['precision']}, activation "
        "checkpointing per layer, AdamW, the needle suite's training samples (one sequence a "
        "step, no dense warm-up). Loss: answer tokens and repeated haystack tokens (weight "
        f"{result['lm_weight']}) plus {result['kl_weight']} x the KL loss.", "",
        "| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in summary), "",
        "## Loss curve", "",
        "| step | answer loss | haystack loss | KL loss |", "|---|---|---|---|",
    ]  # fmt: skip
    for step, _length, answer, kl_loss, haystack in curve_rows(result["history"]):
        lines.append(f"| {int(step) + 1} | {answer:.4f} | {haystack:.4f} | {kl_loss:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=parse_length, default=parse_length("1m"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=None, help="default: dim / 64")
    parser.add_argument("--kv-heads", type=int, default=None, help="default: heads / 4")
    parser.add_argument(
        "--granularity", default="block",
        help="MSA selection: block (default; one choice per query block of 64) or token "
        "(per query token; from random init its choices are uncorrelated, and tiles of 64 "
        "tokens then hold the union of their choices: nearly dense at 1M)",
    )  # fmt: skip
    parser.add_argument(
        "--max-minutes", type=float, default=None,
        help="stop (and report the steps made) once this much training time has passed",
    )  # fmt: skip
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--checkpoint", default=None,
        help="checkpoint file kept after the run: a later run with the same arguments "
        "resumes from it (default: a temporary file, removed at the end)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.max_minutes is not None and not 0 <= args.max_minutes < math.inf:
        parser.error(f"--max-minutes must be a number >= 0, got {args.max_minutes}")
    needles = NeedleConfig()
    if args.seq_len < needles.min_length():  # before TrainConfig, which calls it train_len
        parser.error(
            f"--seq-len {args.seq_len} cannot hold a needle sample: pass "
            f"{needles.min_length()} tokens or more"
        )
    heads = args.heads or max(1, args.dim // 64)
    kv_heads = args.kv_heads or max(1, heads // 4)
    try:  # the settings are checked before anything runs: one error line, no traceback
        device = checked_device(args.device)
        model_config = ModelConfig(
            vocab_size=needles.vocab_size, layers=args.layers, dim=args.dim, heads=heads,
            kv_heads=kv_heads, granularity=args.granularity, checkpointing=True,
        )  # fmt: skip
        config = TrainConfig(
            steps=args.steps, train_len=args.seq_len, min_len=args.seq_len, batch=1,
            lr=args.lr, lr_warmup=max(1, min(100, args.steps // 10)), msa_warmup=0.0,
            curriculum=0.0, checkpoint_every=args.steps, seed=args.seed,
        )  # fmt: skip
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    out = pathlib.Path(args.out) if args.out else default_out(device)
    try:  # before training: a folder it cannot write would lose the run
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"--out {out}: {error.strerror}")
    model = NeedleLM("msa", model_config)
    init_parameters(model, args.seed)
    model.to(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    workers = 2 if device.type == "cuda" else 0  # 1M-token batches are built ahead
    started = time.monotonic()
    deadline = None if args.max_minutes is None else started + 60 * args.max_minutes
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = pathlib.Path(args.checkpoint or pathlib.Path(folder) / "checkpoint.pt")
        first_step = checkpoint.with_suffix(".first_step.json")  # its seconds and tokens
        if not checkpoint.exists():
            # The first step compiles and tunes the kernels: one call for it (a deadline
            # already passed stops after one step), then the rest resumes from its checkpoint.
            first = train(model, needles, config, device=device, checkpoint_path=checkpoint,
                          deadline=0.0, progress=False, data_workers=workers)  # fmt: skip
            first_step.write_text(json.dumps([first.train_seconds, first.tokens]))
        first_seconds, first_tokens = json.loads(first_step.read_text())
        state = train(model, needles, config, device=device, checkpoint_path=checkpoint,
                      deadline=deadline, data_workers=workers)  # fmt: skip
    later_seconds = state.train_seconds - first_seconds
    result = dict(
        run_meta(device), model=dataclasses.asdict(model_config), seq_len=args.seq_len,
        steps=state.step, planned_steps=args.steps, max_minutes=args.max_minutes,
        parameters=sum(p.numel() for p in model.parameters()),
        proxy_heads=model_config.proxy_heads or model_config.kv_heads,
        lm_weight=config.lm_weight, kl_weight=config.kl_weight,
        tokens_per_second=state.tokens_per_second, first_step_seconds=first_seconds,
        tokens_per_second_after_first=(state.tokens - first_tokens) / later_seconds
        if state.step > 1 and later_seconds > 0 else None,
        peak_memory_gib=peak_memory_gib(device),
        memory_kind="peak GPU memory" if device.type == "cuda" else "peak resident memory",
        precision="bf16 autocast" if device.type == "cuda" else "fp32 (the CPU)",
        history=state.history,
    )  # fmt: skip
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=1) + "\n")
    report = markdown(result)
    (out / f"{NAME}.md").write_text(report)
    print(report)
    print(f"wrote {out / NAME}.json and .md")


if __name__ == "__main__":
    main()
