"""The MSA KL kernels at 4 and 8 warps and 1 to 3 pipelining stages on bench_msa's inputs
(128K tokens, H_q 64, H_p 4, D 128, top_k 16): forward without a gradient, forward with the
gradients (the rows kernel, which writes the q_proxy gradient and the tiles of d kl_loss /
d z, and dk_proxy, which multiplies them into the k_proxy gradient), and the backward (the
two scaled by d loss / d kl_loss), per selection, and for query blocks of 2 to 32 rows with
dk_proxy gathering 1, 2 or 4 of them a step (with --entries); medians of 3 timed calls.

    python3 benchmarks/bench_kl_configs.py [--seq-len 128k] [--proxies local,random]
        [--q-blocks 1,16,64] [--warps 4,8] [--stages 1,2,3] [--entries]
        [--kernels triton,gluon]

flash_msa.msa.kl.num_warps, num_stages and dk_proxy_entries hold the faster choices (of the
Triton kernels). With --kernels gluon the rows kernel is the Gluon one (sm_90, where it takes
the call; the warps and stages then reach dk_proxy only);
without --warps / --stages every program runs at the library's choice.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from unittest import mock

import bench_msa
import torch
from common import median_ms

from flash_msa import block_sparse_attn_func
from flash_msa.bench import parse_length
from flash_msa.msa import kl, kl_gluon, proxy_kl_loss

CASES = {"local": [("token", 1), ("token", 4), ("token", 8), ("token", 16), ("block", 64)],
         "random": [("token", 1), ("block", 64)]}  # fmt: skip


def entry_choices(q_block: int, every: bool) -> list[int]:
    """Query blocks per dk_proxy step to time: with `every`, 1, 2 and 4 for blocks of 2 to 32
    rows, else kl.dk_proxy_entries' own."""
    return [1, 2, 4] if every and 1 < q_block < 64 else [kl.dk_proxy_entries(q_block)]


def time_kl(loss, warps: int | None, stages: int | None, entries: int,
            kernels: str) -> tuple[float, float, float]:  # fmt: skip
    """(forward without a gradient, forward with the gradients, forward + backward) ms
    of loss() with every KL program at `warps` warps and `stages` stages (None: the
    library's), dk_proxy gathering `entries` query blocks a step and the KL's kernels
    `kernels` ("triton" or "gluon")."""
    warp_choice = kl.num_warps if warps is None else lambda kernel, q_block: warps
    stage_choice = kl.num_stages if stages is None else lambda kernel, q_block: stages
    supports = kl_gluon.supports if kernels == "gluon" else lambda *args: False
    with (
        mock.patch.object(kl, "num_warps", warp_choice),
        mock.patch.object(kl, "num_stages", stage_choice),
        mock.patch.object(kl, "dk_proxy_entries", lambda q_block: entries),
        mock.patch.object(kl_gluon, "supports", supports),
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
    parser.add_argument("--q-blocks", default="1,16,64", help="the cases' query blocks to run")
    parser.add_argument("--warps", default="", help="e.g. 4,8 (default: the library's)")
    parser.add_argument("--stages", default="", help="e.g. 1,2,3 (default: the library's)")
    parser.add_argument("--kernels", default="triton", help="triton, gluon or both")
    parser.add_argument("--entries", action="store_true",
                        help="time dk_proxy gathering 1, 2 and 4 query blocks of 2 to 32 rows")
    args = parser.parse_args()
    q_blocks = [int(value) for value in args.q_blocks.split(",")]
    warp_choices, stage_choices = (
        [int(value) for value in text.split(",")] if text else [None]
        for text in (args.warps, args.stages)
    )
    seq_len = args.seq_len
    device, scale = torch.device("cuda"), bench_msa.HEAD_DIM**-0.5
    print("| proxies | granularity | q_block | kernels | warps | stages | dk_proxy entries "
          "| forward ms | forward + gradients ms | backward ms | total ms |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for proxies in args.proxies.split(","):
        cases = [case for case in CASES[proxies] if case[1] in q_blocks]
        inputs = bench_msa.random_inputs(seq_len, device, proxies)
        q_proxy, k_proxy, q, k, v = (inputs[name] for name in ("q_proxy", "k_proxy", "q", "k", "v"))
        for granularity, q_block in cases:
            with torch.no_grad():
                (layout, masks), _ = bench_msa.select(
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
            configs = itertools.product(args.kernels.split(","), warp_choices,
                                        stage_choices, entry_choices(q_block, args.entries))
            for kernels, warps, stages, entries in configs:
                forward, with_grad, total = time_kl(loss, warps, stages, entries, kernels)
                shown = ["default" if value is None else value for value in (warps, stages)]
                print(f"| {proxies} | {granularity} | {q_block} | {kernels} | {shown[0]} "
                      f"| {shown[1]} | {entries} | {forward:.1f} | {with_grad:.1f} "
                      f"| {total - with_grad:.1f} | {total:.1f} |", flush=True)  # fmt: skip
            q_proxy.grad = k_proxy.grad = None


if __name__ == "__main__":
    main()
