"""Sweep the kernels' tile shapes on a GPU and time each kernel apart (torch.profiler).

    python benchmarks/tune_kernels.py [--case window-128k] [--out FILE]

For each variant (query rows of the forward and dQ programs; kv rows x query rows of the
dK/dV program) the autotuner still picks warps, stages and the inner tile; this prints
the median device time of every kernel, so the shapes can be chosen per kernel.
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_attention import CASES, HEAD_DIM

from flash_msa.ops.interface import block_sparse_attn_func
from flash_msa.ops.triton import backward, configs, forward


def kernel_times(step, repeats: int = 5) -> dict[str, float]:
    """Mean device ms per launch of each kernel over `repeats` runs of step()."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in profile.key_averages():
        if event.key.startswith("_") and "kernel" in event.key:
            times[event.key] = event.device_time_total / 1e3 / repeats
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", default="window-128k")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    seq_len, heads_q, heads_kv, build, _ = CASES[args.case]
    device = torch.device("cuda")
    layout = build(seq_len, device)
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, seq_len, h, HEAD_DIM, device=device, dtype=torch.bfloat16,
                    generator=generator).requires_grad_()
        for h in (heads_q, heads_kv, heads_kv)
    )  # fmt: skip
    dout = torch.randn_like(q)
    original_rows, original_kv_rows = configs.max_query_rows, configs.dkdv_kv_rows
    results = []
    # Each kernel is timed apart, so four variants cover every option of each kernel.
    shapes = [(128, 128, (128, 64)), (64, 64, (64, 64)), (128, 64, (128, 32)), (64, 128, (64, 32))]
    for forward_rows, dq_rows, (kv_rows, dkdv_rows) in shapes:
        rows = {"forward": forward_rows, "dq": dq_rows, "dkdv": dkdv_rows}
        configs.max_query_rows = lambda pad, kernel, rows=rows: rows[kernel]
        configs.dkdv_kv_rows = lambda pad, block, kv_rows=kv_rows: kv_rows

        def step():
            out = block_sparse_attn_func(q, k, v, layout, causal=True)
            out.backward(dout)

        try:
            step()  # autotune
            times = kernel_times(step)
        except Exception as error:  # a shape that does not compile or fit: record why
            times = {"error": repr(error)[:200]}
        record = dict(case=args.case, forward_rows=forward_rows, dq_rows=dq_rows,
                      dkdv_kv_rows=kv_rows, dkdv_q_rows=dkdv_rows, **times)  # fmt: skip
        results.append(record)
        print(json.dumps(record), flush=True)
    configs.max_query_rows, configs.dkdv_kv_rows = original_rows, original_kv_rows
    chosen = {
        "forward": forward._tuned_forward(128, 128).cache,
        "dq": backward._tuned_dq(128, 128).cache,
        "dkdv": backward._tuned_dkdv(128).cache,
    }
    for name, cache in chosen.items():
        for key, config in cache.items():
            print(f"{name} chose {config} for {key}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
