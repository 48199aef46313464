"""The MSA KL kernels at 4 and 8 warps on bench_msa's inputs (128K tokens, H_q 64, H_p 4,
D 128, top_k 16): forward without a gradient, forward with the q_proxy gradient (the rows
kernel), and the k_proxy backward (dk_proxy), per selection, and for query blocks of 2 to 32
rows with dk_proxy gathering 1, 2 or 4 of them a step; medians of 3 timed calls.

    python3 benchmarks/bench_kl_warps.py [--seq-len 128k] [--proxies local,random]

flash_msa.msa.kl.num_warps and dk_proxy_entries hold the faster choices.
"""

from __future__ import annotations

import argparse
import functools
from unittest import mock

import bench_msa
import torch

from flash_msa import block_sparse_attn_func
from flash_msa.bench import parse_length
from flash_msa.msa import kl, proxy_kl_loss

CASES = {"local": [("token", 1), ("token", 16), ("block", 64)],
         "random": [("token", 1), ("block", 64)]}  # fmt: skip


def median_ms(function, repeats: int = 3) -> float:
    """Median of `repeats` timed calls after an untimed one, by CUDA events."""
    function()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[repeats // 2]


def entry_choices(q_block: int) -> list[int]:
    """Query blocks per dk_proxy step to time: 1, 2 and 4 for blocks of 2 to 32 rows, else
    kl.dk_proxy_entries' own."""
    return [1, 2, 4] if 1 < q_block < 64 else [kl.dk_proxy_entries(q_block)]


def time_kl(loss, warps: int, entries: int) -> tuple[float, float, float]:
    """(forward without a gradient, forward with the q_proxy gradient, forward + backward) ms
    of loss() with every KL program at `warps` warps and dk_proxy gathering `entries` query
    blocks a step."""
    with (
        mock.patch.object(kl, "num_warps", lambda kernel, q_block: warps),
        mock.patch.object(kl, "dk_proxy_entries", lambda q_block: entries),
    ):
        with torch.no_grad():
            forward = median_ms(loss)
        with_grad = median_ms(loss)
        total = median_ms(lambda: loss().backward())
    return forward, with_grad, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=parse_length, default=parse_length("128k"))
    parser.add_argument("--proxies", default=",".join(CASES))
    args = parser.parse_args()
    seq_len = args.seq_len
    device, scale = torch.device("cuda"), bench_msa.HEAD_DIM**-0.5
    print("| proxies | granularity | q_block | warps | dk_proxy entries | forward ms "
          "| forward + dq_proxy ms | dk_proxy ms | total ms |\n"
          "|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for proxies in args.proxies.split(","):
        cases = CASES[proxies]
        inputs = bench_msa.random_inputs(seq_len, device, proxies)
        q_proxy, k_proxy, q, k, v = (inputs[name] for name in ("q_proxy", "k_proxy", "q", "k", "v"))
        for granularity, q_block in cases:
            with torch.no_grad():
                layout, masks = bench_msa.select(
                    q_proxy, k_proxy, top_k=bench_msa.TOP_K, q_block=q_block,
                    kv_block=bench_msa.KV_BLOCK, granularity=granularity,
                    proxy_softmax_scale=scale, warmup=False, document_ids=None, cu_seqlens=None,
                )  # fmt: skip
                lse = block_sparse_attn_func(
                    q, k, v, layout, causal=True, return_lse=True, query_masks=masks
                )[1]

            loss = functools.partial(
                proxy_kl_loss, q_proxy, k_proxy, q, k, lse, layout, softmax_scale=scale,
                proxy_softmax_scale=scale, query_masks=masks,
            )  # fmt: skip
            for warps in (4, 8):
                for entries in entry_choices(q_block):
                    forward, with_grad, total = time_kl(loss, warps, entries)
                    print(f"| {proxies} | {granularity} | {q_block} | {warps} | {entries} | "
                          f"{forward:.1f} | {with_grad:.1f} | {total - with_grad:.1f} | "
                          f"{total:.1f} |", flush=True)  # fmt: skip
            q_proxy.grad = k_proxy.grad = None


if __name__ == "__main__":
    main()
