"""Context-parallel plans at 1M tokens on one GPU: each rank's work in turn, and the bytes
each rank moves against a ring's and an all-gather's.

    python benchmarks/bench_cp_balance.py [--seq-len 1m] [--world-size 8] [--out DIR]

bf16, B=1, H_q=32, H_kv=8, D=128, blocks of 128. For each layout (window 4096 + 128 sinks,
top-k 16, and dense causal at a quarter of the length) and each balance ("contiguous",
"headtail"; "auto" picks one of them), every rank's share of block_sparse_attn_cp runs on
this GPU, one rank after another: its attention over its own blocks and over the blocks
it receives, merged, forward + backward, as in a real run but with the exchange replaced
by a buffer of random blocks (the collectives are what a multi-GPU run measures).
Reported: each rank's time, the busiest rank over the mean (the balance), and
plan.stats' received bytes per rank with the bytes a ring (or an all-gather) of K/V
brings each rank: (w - 1) / w of the sequence. Writes DIR/cp_balance.{json,md} (DIR
defaults to benchmarks/results/<gpu>/).
"""

from __future__ import annotations

import argparse
import statistics
from unittest import mock

import torch
from common import (
    HEAD_DIM,
    causal_layout,
    markdown_table,
    parse_length,
    random_tensors,
    results_dir,
    run_metadata,
    topk_layout,
    wall_ms,
    window_layout,
    write_report,
)

from flash_msa.distributed import block_sparse_attn_cp, comm, cp_plan

# name -> (layout, tokens as a multiple of --seq-len): dense causal at a quarter of it (a
# rank's share at 1M is seconds a step).
LAYOUTS = {
    "window+sinks": (window_layout, 1.0), "topk16": (topk_layout, 1.0),
    "causal": (causal_layout, 0.25),
}  # fmt: skip
BALANCES = ("contiguous", "headtail")
HEADS_Q, HEADS_KV = 32, 8
MiB = 2**20


def rank_step(plan, rank: int, device):
    """One rank's forward + backward with the exchange replaced by random received blocks."""
    tokens = plan.token_index(rank).numel()
    tensors = random_tensors(
        tokens, dict(q=HEADS_Q, k=HEADS_KV, v=HEADS_KV, dout=HEADS_Q), device=device,
        requires_grad=("q", "k", "v"), seed=rank,
    )  # fmt: skip
    q, k, v, dout = tensors.values()

    def exchange(send, send_counts, recv_counts, group):
        shape = (sum(recv_counts), *send.shape[1:])
        return torch.randn(shape, device=device, dtype=send.dtype), None

    patches = [
        mock.patch.object(comm, "group_rank", return_value=rank),
        mock.patch.object(comm, "agree", return_value=[0] * plan.world_size),
        mock.patch.object(comm, "exchange", side_effect=exchange),
    ]

    def step():
        for patch in patches:
            patch.start()
        try:
            out = block_sparse_attn_cp(q, k, v, plan, causal=True)
            out.backward(dout)
        finally:
            for patch in reversed(patches):
                patch.stop()

    return step, (q, k, v)


def ring_bytes(seq_len: int, world_size: int) -> int:
    """K/V bytes a ring (or an all-gather) brings each rank in the forward: every other
    rank's tokens, bf16."""
    return round(seq_len * (world_size - 1) / world_size) * 2 * HEADS_KV * HEAD_DIM * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=parse_length, default=parse_length("1m"))
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    meta = run_metadata(device)
    records = []
    for name, (build, share) in LAYOUTS.items():
        seq_len = int(args.seq_len * share) // 128 * 128
        layout = build(seq_len, device)
        auto = cp_plan(layout, args.world_size).balance
        for balance in BALANCES:
            plan = cp_plan(layout, args.world_size, balance=balance)
            times = []
            for rank in range(args.world_size):
                step, tensors = rank_step(plan, rank, device)
                times.append(wall_ms(step, device, repeats=3)[0])
                del step, tensors
                torch.cuda.empty_cache()
            stats = plan.stats(HEADS_KV, HEAD_DIM)
            record = dict(
                meta, layout=name, balance=balance, auto=balance == auto,
                seq_len=seq_len, world_size=args.world_size, rank_ms=times,
                max_over_mean=max(times) / statistics.mean(times),
                recv_bytes=stats["recv_bytes"], send_bytes=stats["send_bytes"],
                ring_bytes=ring_bytes(seq_len, args.world_size),
            )  # fmt: skip
            records.append(record)
            print(f"{name:14s} {balance:10s} max/mean {record['max_over_mean']:.3f} "
                  f"ranks {[round(t, 1) for t in times]} ms")  # fmt: skip
    rows = [
        (
            r,
            [
                f"{r['layout']} {r['seq_len'] // 1024}K",
                r["balance"] + (" (auto)" if r["auto"] else ""),
                f"{max(r['rank_ms']):.1f}", f"{statistics.mean(r['rank_ms']):.1f}",
                f"{r['max_over_mean']:.3f}", f"{max(r['recv_bytes']) / MiB:.1f}",
                f"{r['ring_bytes'] / MiB:.0f}",
                f"{r['ring_bytes'] / max(max(r['recv_bytes']), 1):.0f}x",
            ],
        )
        for r in records
    ]  # fmt: skip
    columns = ["layout", "balance", "busiest rank ms", "mean ms", "max/mean",
               "max recv MiB", "ring/all-gather MiB", "fewer bytes"]  # fmt: skip
    notes = (
        f"{args.world_size} ranks, bf16, H_q {HEADS_Q}, H_kv "
        f"{HEADS_KV}, D {HEAD_DIM}, blocks of 128, causal; forward + backward of each rank's "
        "share run one rank after another on this GPU (exchange replaced by random blocks), "
        "median of 3 after one. "
        "Received bytes: K/V in the forward (dK/dV go back in fp32: twice that)."
    )
    out_dir = results_dir(args.out, device)
    write_report(out_dir, "cp_balance", records, meta=meta, title="Context-parallel balance",
                 notes=notes, body=markdown_table(columns, rows))  # fmt: skip


if __name__ == "__main__":
    main()
