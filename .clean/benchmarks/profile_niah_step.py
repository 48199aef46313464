"""Where a needle-benchmark training step spends its time, per variant: the wall time of a
step at 32K tokens (flash_msa.niah.train.measure_step_ms, freshly initialised models) and
torch.profiler's table of three steps (CPU and CUDA time per op and kernel).

    python3 benchmarks/profile_niah_step.py [--seq-len 32k] [--rows 18]
    python3 benchmarks/profile_niah_step.py --seq-len 1m --variants msa:block --layers 2 \
        --dim 1024 --checkpointing      # train_million's model, two of its layers

A step whose wall time exceeds its CUDA time waits on the host (launches, Python).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from torch.profiler import ProfilerActivity, profile

from flash_msa.bench import parse_length
from flash_msa.niah import NeedleLM, init_parameters
from flash_msa.niah.suite import build_configs
from flash_msa.niah.train import _losses, measure_step_ms, training_batch

VARIANTS = "dense,window,oracle_topk,msa:token,msa:block"  # msa:GRANULARITY


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """"dense,msa:block" -> [("dense", {}), ("msa", {"granularity": "block"})]."""
    variants = []
    for item in text.split(","):
        variant, _, granularity = item.partition(":")
        variants.append((variant, {"granularity": granularity} if granularity else {}))
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=parse_length, default=parse_length("32k"))
    parser.add_argument("--rows", type=int, default=18, help="ops listed per variant")
    parser.add_argument("--variants", type=parse_variants, default=parse_variants(VARIANTS))
    for name in ("layers", "dim", "heads", "kv_heads"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help="the model's (default: the needle benchmark's)")  # fmt: skip
    parser.add_argument("--checkpointing", action="store_true",
                        help="recompute each layer in the backward (train_million's)")  # fmt: skip
    args = parser.parse_args()
    device = torch.device("cuda")
    model_options = dict(
        layers=args.layers, dim=args.dim, heads=args.heads, kv_heads=args.kv_heads,
        checkpointing=args.checkpointing or None,
    )  # fmt: skip
    for variant, options in args.variants:
        model_config, needles, train_config, _ = build_configs(**model_options)
        model = NeedleLM(variant, dataclasses.replace(model_config, **options))
        init_parameters(model, train_config.seed)
        model.to(device)
        step_ms = measure_step_ms(model, needles, train_config, args.seq_len, device=device)
        batch = training_batch(-1, args.seq_len, 1, needles, train_config.seed).to(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            for _ in range(3):
                _losses(model, batch, False, train_config, device)[0].backward()
                model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        print(f"===== {variant} {options}: step {step_ms:.1f} ms (wall), 3 steps profiled")
        print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows,
                                            max_name_column_width=60), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
