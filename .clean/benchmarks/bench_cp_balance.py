"""Context-parallel plans at 1M tokens on one GPU: each rank's work in turn, and the bytes
each rank moves against a ring's and an all-gather's.

    python benchmarks/bench_cp_balance.py [--seq-len 1m] [--world-size 8] [--out DIR]

bf16, B=1, H_q=32, H_kv=8, D=128, blocks of 128. For each layout (window 4096 + 128 sinks,
top-k 16, dense causal at a quarter of the length, and MSA) and each balance ("contiguous",
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

from flash_msa import patterns
from flash_msa.distributed import block_sparse_attn_cp, comm, cp_plan, msa_func_cp


# name -> (layout, tokens as a multiple of --seq-len): dense causal at a quarter of it (a
# rank's share at 1M is seconds a step).
def msa_layout(seq_len: int, device):
    """MSA's plan layout: causal over query blocks of 64 and kv blocks of 128."""
    return patterns.causal(seq_len, q_block=64, kv_block=128, device=device)


LAYOUTS = {
    "window+sinks": (window_layout, 1.0), "topk16": (topk_layout, 1.0),
    "causal": (causal_layout, 0.25),
}  # fmt: skip
BALANCES = ("contiguous", "headtail")
HEADS_Q, HEADS_KV = 32, 8
MSA_HEADS = dict(q=64, kv=4, proxy=4)  # and one proxy key head, D_p = D (bench_msa.py's)
MiB = 2**20


def _patched(patches, run):
    """run() with the patches applied (collectives replaced), undone after."""

    def step():
        for patch in patches:
            patch.start()
        try:
            run()
        finally:
            for patch in reversed(patches):
                patch.stop()

    return step


def _plan_patches(plan, rank: int) -> list:
    return [
        mock.patch.object(comm, "group_rank", return_value=rank),
        mock.patch.object(comm, "agree", return_value=[0] * plan.world_size),
    ]


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

    exchanges = mock.patch.object(comm, "exchange", side_effect=exchange)
    patches = [*_plan_patches(plan, rank), exchanges]
    return _patched(
        patches, lambda: block_sparse_attn_cp(q, k, v, plan, causal=True).backward(dout)
    ), (q, k, v)


def msa_rank_step(plan, rank: int, device):
    """One rank's MSA step (msa_func_cp forward + backward of out and the KL) with the
    all-gathers replaced by random whole-sequence tensors that take gradients."""
    tokens = plan.token_index(rank).numel()
    heads = dict(q_proxy=MSA_HEADS["proxy"], k_proxy=1, q=MSA_HEADS["q"], k=MSA_HEADS["kv"],
                 v=MSA_HEADS["kv"], dout=MSA_HEADS["q"])  # fmt: skip
    tensors = random_tensors(
        tokens, heads, device=device, requires_grad=("q_proxy", "k_proxy", "q", "k", "v"),
        seed=rank,
    )  # fmt: skip
    *inputs, dout = tensors.values()

    def gather(shard, plan, group):
        shape = (shard.shape[0], plan.layout.seq_len_kv, *shard.shape[2:])
        return torch.randn(shape, device=device, dtype=shard.dtype, requires_grad=True)

    patches = [
        *_plan_patches(plan, rank),
        mock.patch.object(comm, "gather_sequence", side_effect=gather),
        mock.patch.object(comm, "sum_across_ranks", side_effect=lambda value, group: value),
    ]

    def run():
        out, kl_loss = msa_func_cp(*inputs, plan, top_k=16, q_block=64, kv_block=128)
        torch.autograd.backward([out, kl_loss], [dout, torch.ones_like(kl_loss)])

    return _patched(patches, run), inputs


def ring_bytes(seq_len: int, world_size: int, token_bytes: int) -> int:
    """Bytes a ring (or an all-gather) brings each rank in the forward: every other rank's
    tokens, token_bytes each."""
    return round(seq_len * (world_size - 1) / world_size) * token_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=parse_length, default=parse_length("1m"))
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    meta = run_metadata(device)
    records = []
    kv_token_bytes = 2 * HEADS_KV * HEAD_DIM * 2  # K and V, bf16
    # MSA all-gathers K, V and the proxy key: every rank receives the ring's bytes.
    msa_token_bytes = (2 * MSA_HEADS["kv"] + 1) * HEAD_DIM * 2
    cases = {name: (build, share, rank_step) for name, (build, share) in LAYOUTS.items()}
    cases["msa"] = (msa_layout, 1.0, msa_rank_step)
    for name, (build, share, rank_work) in cases.items():
        seq_len = int(args.seq_len * share) // 128 * 128
        layout = build(seq_len, device)
        auto = cp_plan(layout, args.world_size).balance
        for balance in BALANCES:
            plan = cp_plan(layout, args.world_size, balance=balance)
            times = []
            for rank in range(args.world_size):
                step, tensors = rank_work(plan, rank, device)
                times.append(wall_ms(step, device, repeats=3)[0])
                del step, tensors
                torch.cuda.empty_cache()
            stats = plan.stats(HEADS_KV, HEAD_DIM)
            token_bytes = msa_token_bytes if name == "msa" else kv_token_bytes
            ring = ring_bytes(seq_len, args.world_size, token_bytes)
            recv = [ring] * args.world_size if name == "msa" else stats["recv_bytes"]
            record = dict(
                meta, layout=name, balance=balance, auto=balance == auto,
                seq_len=seq_len, world_size=args.world_size, rank_ms=times,
                max_over_mean=max(times) / statistics.mean(times), recv_bytes=recv,
                ring_bytes=ring,
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
        "median of 3 after one. Received bytes: K/V in the forward (dK/dV go back in fp32: "
        f"twice that). msa: msa_func_cp with H_q {MSA_HEADS['q']}, H_kv {MSA_HEADS['kv']}, "
        f"{MSA_HEADS['proxy']} proxy heads and one proxy key head, top_k 16, q_block 64, "
        "kv_block 128, the all-gathers of proxy keys, K and V replaced by random tensors "
        "(it receives what an all-gather brings)."
    )
    out_dir = results_dir(args.out, device)
    write_report(out_dir, "cp_balance", records, meta=meta, title="Context-parallel balance",
                 notes=notes, body=markdown_table(columns, rows))  # fmt: skip


if __name__ == "__main__":
    main()
