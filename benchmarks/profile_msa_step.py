"""Where one MSA training step (bench_msa's: msa_func forward + backward) spends its GPU time:
torch.profiler's table of two steps, ops and kernels by CUDA time.

    python3 benchmarks/profile_msa_step.py [--seq-len 1m] [--granularity token] [--q-block 8]
        [--fp8-scores] [--rows 30]
"""

from __future__ import annotations

import argparse

import torch
from bench_msa import KV_BLOCK, TOP_K, random_inputs
from torch.profiler import ProfilerActivity, profile

from flash_msa.bench import parse_length
from flash_msa.msa import msa_func
from flash_msa.msa.fp8 import FP8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=parse_length, default=parse_length("1m"))
    parser.add_argument("--granularity", default="token")
    parser.add_argument("--q-block", type=int, default=8)
    parser.add_argument("--fp8-scores", action="store_true")
    parser.add_argument("--rows", type=int, default=30, help="ops listed")
    args = parser.parse_args()
    inputs = random_inputs(args.seq_len, torch.device("cuda"), "local")
    leaves = [inputs[name] for name in ("q_proxy", "k_proxy", "q", "k", "v")]
    score_dtype = FP8 if args.fp8_scores else None
    options = dict(top_k=TOP_K, q_block=args.q_block, kv_block=KV_BLOCK,
                   granularity=args.granularity, score_dtype=score_dtype)  # fmt: skip

    def step():
        for leaf in leaves:
            leaf.grad = None
        out, kl_loss = msa_func(*leaves, **options)
        torch.autograd.backward([out, kl_loss], [inputs["dout"], None])

    step()  # compiles
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    print(f"===== S {args.seq_len:,}, {options}, local proxies: 2 steps profiled")
    print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows,
                                        max_name_column_width=70))  # fmt: skip


if __name__ == "__main__":
    main()
