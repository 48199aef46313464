"""Context parallelism across the GPUs of one host: correctness against one process, strong
and weak scaling, the communication left exposed, and an all-gather peer.

    torchrun --nproc-per-node N benchmarks/bench_context_parallel.py [--seq-len 1m] [--out DIR]
    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py --device cpu \\
        --seq-len 2k --out /tmp/cpbench        # gloo; TRITON_INTERPRET=1 adds the MSA cases

One run measures one world size N (NCCL on GPUs, gloo on the CPU) and writes
DIR/context_parallel.{json,md} (DIR defaults to benchmarks/results/<gpu>xN/); the tables
merge the records of other world sizes found in DIR and its siblings <gpu>x1, <gpu>x2, ...
so that runs at N = 1, 2, 4, 8 fill one table. bf16 on GPUs, fp32 on the CPU, B = 1.

- Correctness (at --check-len, 128K by default): block_sparse_attn_cp on window 4096 + 128
  sinks and on top-k 16, and msa_func_cp, forward and backward, each rank's shard of out
  and of the gradients against one process (block_sparse_attn_func / msa_func over the
  whole sequence on rank 0) by FlashAttention's rule: the error against float64 at most
  twice that of PyTorch computing the same in the same dtype, plus one unit of rounding.
- Strong scaling at --seq-len (1M) for window 4096 + 128 sinks, top-k 16 and dense causal
  (at --causal-len, a quarter of it by default: a step at 1M is a minute on one GPU),
  H_q 32, H_kv 8, D 128: forward + backward time, efficiency T1 / (N x TN), K/V bytes each
  rank moves (plan.stats), and the exposed communication: the step's time minus that of
  the same plan with every collective replaced by a local tensor of its shape. The peer:
  the same sequence with every rank's K/V all-gathered to every rank before its rows run
  over them (collective="allgather"; what PyTorch's context parallelism and
  TransformerEngine do for masks a ring cannot skip): its time and bytes.
- Weak scaling at --seq-len tokens per rank (N x 1M in all): window 4096 + 128 sinks, and
  MSA (H_q 64, H_kv 4, 4 proxy heads, one proxy key head, top-k 16).

Times: every rank starts after a barrier; a repeat's time is its slowest rank's; the median
of --repeats after one warm-up call. The CPU runs the same cases with fewer heads and a
smaller head dim, MSA at a quarter of the lengths (a check that everything runs, not a
result).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import pathlib
import re
import statistics
import time
from functools import partial
from unittest import mock

import torch
import torch.distributed as dist
from common import (
    causal_layout,
    failure,
    kept_records,
    markdown_table,
    parse_length,
    relative_difference,
    results_dir,
    run_metadata,
    topk_layout,
    window_layout,
    write_report,
)

from flash_msa import patterns
from flash_msa.distributed import block_sparse_attn_cp, comm, cp_plan, msa_func_cp
from flash_msa.layout import BlockLayout
from flash_msa.msa import msa_func
from flash_msa.ops.interface import block_sparse_attn_func
from flash_msa.reference import attention_reference

NAME = "context_parallel"
MiB = 2**20
INT32_MAX = 2**31 - 1


# Sizes per device type: the GPU's are the benchmark, the CPU's a check that it runs.
ATTENTION = dict(
    cuda=dict(heads_q=32, heads_kv=8, head_dim=128),
    cpu=dict(heads_q=4, heads_kv=2, head_dim=32),
)
MSA = dict(
    cuda=dict(heads_q=64, heads_kv=4, proxy=4, proxy_keys=1, head_dim=128, top_k=16),
    cpu=dict(heads_q=4, heads_kv=1, proxy=1, proxy_keys=1, head_dim=16, top_k=4),
)
MSA_BLOCKS = dict(q_block=64, kv_block=128)
# name -> layout builder (seq_len, device); every case is causal.
LAYOUTS = {"window+sinks": window_layout, "topk16": topk_layout, "causal": causal_layout}
STRONG = ("window+sinks", "topk16", "causal")
WEAK = ("window+sinks", "msa")
CORRECTNESS = ("window+sinks", "topk16", "msa")


def msa_layout(seq_len: int, device) -> BlockLayout:
    """The plan layout msa_func_cp takes: causal over query blocks of 64, kv blocks of 128."""
    return patterns.causal(seq_len, **MSA_BLOCKS, device=device)


def msa_layout_entries(seq_len: int) -> int:
    """Entries of msa_layout(seq_len): the causal pairs of (64, 128) blocks."""
    q_blocks = math.ceil(seq_len / MSA_BLOCKS["q_block"])
    ratio = MSA_BLOCKS["kv_block"] // MSA_BLOCKS["q_block"]
    return sum(row // ratio + 1 for row in range(q_blocks))


# ---- ranks ------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def every_rank(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's list of floats (rank order) from this rank's (one all_gather)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return [part.tolist() for part in parts]


def synchronized_ms(step, device: torch.device, repeats: int) -> dict:
    """step()'s time with every rank starting together after a barrier: per call the slowest
    rank's ms, the median over `repeats` calls after one warm-up; each rank's own median, and
    the largest peak memory of any rank (GiB; None on the CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    samples = []
    for call in range(1 + repeats):
        synchronize(device)
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        if call:
            samples.append(1e3 * (time.perf_counter() - start))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else -1.0
    table = every_rank([*samples, peak], device)  # [w, repeats + 1]
    slowest = [max(row[call] for row in table) for call in range(repeats)]
    return dict(
        ms=statistics.median(slowest),
        rank_ms=[statistics.median(row[:repeats]) for row in table],
        peak_gib=max(row[-1] for row in table) if device.type == "cuda" else None,
    )


@contextlib.contextmanager
def compute_only(world_size: int, device: torch.device):
    """block_sparse_attn_cp and msa_func_cp with every collective replaced by a local tensor
    of the shape it returns (random, drawn once per shape): a step computes what it would and
    moves nothing. The agreement check is skipped; the sums across ranks return this rank's."""
    buffers: dict[tuple, torch.Tensor] = {}

    def buffer(shape, dtype):
        key = (tuple(shape), dtype)
        if key not in buffers:
            buffers[key] = torch.randn(key[0], dtype=dtype, device=device)
        return buffers[key]

    def exchange(send, send_counts, recv_counts, group):
        return buffer((sum(recv_counts), *send.shape[1:]), send.dtype), None

    def all_gather_blocks(own, counts, group):
        return buffer((len(counts), max(counts), *own.shape[1:]), own.dtype), None

    def gather_sequence(shard, plan, group):
        whole = buffer((shard.shape[0], plan.layout.seq_len_kv, *shard.shape[2:]), shard.dtype)
        return whole.detach().requires_grad_()  # a fresh leaf: the gradient stops here

    replacements = dict(
        agree=lambda plan, rank, group, shards, extra=0: [0] * world_size,
        exchange=exchange, all_gather_blocks=all_gather_blocks,
        gather_sequence=gather_sequence, sum_across_ranks=lambda value, group: value,
    )  # fmt: skip
    with contextlib.ExitStack() as stack:
        for name, function in replacements.items():
            stack.enter_context(mock.patch.object(comm, name, function))
        yield


# ---- inputs and steps -------------------------------------------------------------------


def normal(shapes: dict[str, tuple], *, dtype, device, seed: int) -> dict[str, torch.Tensor]:
    """Fresh normal tensors of the named shapes, drawn in that order from one seed."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator, device=device, dtype=dtype)
        for name, shape in shapes.items()
    }


def attention_shapes(tokens: int, sizes: dict) -> dict[str, tuple]:
    q = (1, tokens, sizes["heads_q"], sizes["head_dim"])
    kv = (1, tokens, sizes["heads_kv"], sizes["head_dim"])
    return dict(q=q, k=kv, v=kv, grad_out=q)


def msa_shapes(tokens: int, sizes: dict) -> dict[str, tuple]:
    def shape(heads):
        return (1, tokens, heads, sizes["head_dim"])

    return dict(
        q_proxy=shape(sizes["proxy"]), k_proxy=shape(sizes["proxy_keys"]),
        q=shape(sizes["heads_q"]), k=shape(sizes["heads_kv"]), v=shape(sizes["heads_kv"]),
        grad_out=shape(sizes["heads_q"]),
    )  # fmt: skip


def leaves(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The inputs (every tensor but grad_out), as leaves requiring grad."""
    return [t.requires_grad_() for name, t in tensors.items() if name != "grad_out"]


def attention_step(inputs, grad_out, plan, backend: str, collective: str = "all_to_all"):
    """block_sparse_attn_cp forward + backward of this rank's shards (gradients reset)."""

    def step():
        for tensor in inputs:
            tensor.grad = None
        out = block_sparse_attn_cp(
            *inputs, plan, causal=True, backend=backend, collective=collective
        )
        out.backward(grad_out)
        return out

    return step


def msa_step(inputs, grad_out, plan, top_k: int):
    """msa_func_cp forward + backward of out and the KL loss (gradients reset)."""

    def step():
        for tensor in inputs:
            tensor.grad = None
        out, kl_loss = msa_func_cp(*inputs, plan, top_k=top_k, **MSA_BLOCKS)
        torch.autograd.backward([out, kl_loss], [grad_out, torch.ones_like(kl_loss)])
        return out, kl_loss

    return step


# ---- bytes ------------------------------------------------------------------------------


def plan_bytes(plan, sizes: dict, dtype) -> tuple[list[int], list[int]]:
    """Per rank: K/V bytes received in the forward, dK/dV bytes sent back in the backward."""
    stats = plan.stats(sizes["heads_kv"], sizes["head_dim"], dtype)
    return stats["recv_bytes"], stats["send_bytes"]


def allgather_bytes(plan, sizes: dict, dtype) -> tuple[list[int], list[int]]:
    """The same for collective="allgather": every other rank's blocks, padded to the
    busiest rank's count, in; dK/dV of all of them (unpadded) back, in fp32."""
    layout = plan.layout
    block_bytes = 2 * sizes["heads_kv"] * sizes["head_dim"] * layout.kv_block
    element = torch.empty((), dtype=dtype).element_size()
    wide = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    counts = torch.bincount(plan.block_owners, minlength=plan.world_size).tolist()
    longest = max(counts)
    recv = [(plan.world_size - 1) * longest * block_bytes * element] * plan.world_size
    send = [(layout.num_kv_blocks - count) * block_bytes * wide for count in counts]
    return recv, send


def msa_bytes(plan, sizes: dict, dtype) -> tuple[list[int], list[int]]:
    """msa_func_cp all-gathers K, V and the proxy keys (padded to the longest shard) and
    returns their gradients by one all_to_all of the same size, in dtype."""
    tokens = [plan.token_index(rank).numel() for rank in range(plan.world_size)]
    heads = 2 * sizes["heads_kv"] + sizes["proxy_keys"]
    element = torch.empty((), dtype=dtype).element_size()
    moved = (plan.world_size - 1) * max(tokens) * heads * sizes["head_dim"] * element
    return [moved] * plan.world_size, [moved] * plan.world_size


# ---- correctness ------------------------------------------------------------------------


def flash_bound(baseline_error: float, dtype: torch.dtype) -> float:
    """FlashAttention's rule: twice the error of PyTorch computing the same in dtype, plus one
    unit of rounding; in fp32 at least 1e-4 relative (the interpreter runs' bar)."""
    if dtype == torch.float32:
        return max(1e-4, 2 * baseline_error)
    return 2 * baseline_error + torch.finfo(dtype).eps


def same_in_dtype(q, k, v, layout, grad_out, query_masks=None, score_budget: int = 1 << 28):
    """PyTorch computing the attention in the inputs' dtype (reference.attention_reference:
    einsum and softmax, no kernel) over the layout's blocks, causal, a chunk of query blocks
    at a time: out, dq, dk, dv. The dK/dV of the chunks add up in fp32 (fp64 for float64
    inputs). The layout has layout_batch 1; query head h reads layout head
    h // (H_q / layout_heads).

    query_masks: int64 [layout.nnz] or None, as block_sparse_attn_func's (bit t of an
        entry's word: query t of its row reads the block; MSA's per-token selection).
    score_budget: score elements of one chunk (H_q x its queries x the keys its rows read).
    """
    heads_q, seq_len = q.shape[2], q.shape[1]
    blocks = layout.to_dense()  # [L, nq, nk]
    words = None
    if query_masks is not None:  # [L, nq, nk]: each entry's word, 0 where inactive
        words = torch.zeros(blocks.numel(), dtype=torch.int64, device=q.device)
        entries = layout.entry_rows().long() * layout.num_kv_blocks + layout.col_indices.long()
        words[entries] = query_masks
        words = words.view(blocks.shape)
    per_row = int(blocks.any(0).sum(-1).max())  # kv blocks any head of a row reads, at most
    rows_per_chunk = max(1, math.isqrt(
        score_budget // (heads_q * layout.q_block * layout.kv_block * max(per_row, 1))
    ))  # fmt: skip
    # NaN until a chunk writes it: a row no chunk covers fails the comparison.
    out, grad_q = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    wide = torch.promote_types(k.dtype, torch.float32)
    grad_k = torch.zeros(k.shape, dtype=wide, device=k.device)
    grad_v = torch.zeros(v.shape, dtype=wide, device=v.device)
    within_q = torch.arange(layout.q_block, device=q.device)
    within_kv = torch.arange(layout.kv_block, device=q.device)
    for first in range(0, layout.num_q_blocks, rows_per_chunk):
        chunk = blocks[:, first : first + rows_per_chunk]  # [L, r, nk]
        columns = chunk.any(1).any(0).nonzero().flatten()  # [n], ascending
        keys = (columns[:, None] * layout.kv_block + within_kv).flatten()  # [n * kv_block]
        keys = keys[keys < seq_len]  # only the last block is ragged, and it comes last
        rows = torch.arange(first, first + chunk.shape[1], device=q.device)
        queries = (rows[:, None] * layout.q_block + within_q).flatten()
        queries = queries[queries < seq_len]
        if words is None:
            mask = chunk[:, :, columns].repeat_interleave(layout.q_block, 1)  # [L, r * q, n]
        else:
            chunk_words = words[:, first : first + rows_per_chunk][:, :, columns]  # [L, r, n]
            bits = (chunk_words[..., None] >> within_q) & 1  # [L, r, n, q_block]
            mask = bits.bool().transpose(2, 3).flatten(1, 2)  # [L, r * q_block, n]
        mask = mask.repeat_interleave(layout.kv_block, 2)[:, : queries.numel(), : keys.numel()]
        mask = mask.repeat_interleave(heads_q // layout.layout_heads, 0)  # [H_q, M, N]
        mask = (mask & (keys[None, :] <= queries[:, None]))[None]  # [1, H_q, M, N]
        q_chunk, k_chunk, v_chunk = (
            tensor[:, index].detach().requires_grad_()
            for tensor, index in ((q, queries), (k, keys), (v, keys))
        )
        out_chunk, _ = attention_reference(q_chunk, k_chunk, v_chunk, mask)
        out_chunk.backward(grad_out[:, queries])
        out[:, queries], grad_q[:, queries] = out_chunk.detach(), q_chunk.grad
        grad_k.index_add_(1, keys, k_chunk.grad.to(wide))
        grad_v.index_add_(1, keys, v_chunk.grad.to(wide))
    return out, grad_q, grad_k.to(k.dtype), grad_v.to(v.dtype)


def shard_errors(plan, names, cp_results, one_process, exact, baseline) -> list[dict]:
    """Per rank and quantity: the errors of its shard of the context-parallel result and of
    one process against float64, PyTorch's in the dtype, the bound, and CP - one process."""
    dtype = one_process[0].dtype
    shards = []
    for rank in range(plan.world_size):
        index = plan.token_index(rank)
        checks = {}
        for name, cp, single, truth, pytorch in zip(
            names, cp_results, one_process, exact, baseline, strict=True
        ):
            cp, single, truth, pytorch = (t[:, index] for t in (cp, single, truth, pytorch))
            error, baseline_error = (
                relative_difference(cp, truth),
                relative_difference(pytorch, truth),
            )
            checks[name] = dict(
                error=error, one_process=relative_difference(single, truth),
                pytorch=baseline_error, bound=flash_bound(baseline_error, dtype),
                vs_one_process=relative_difference(cp, single),
            )  # fmt: skip
        shards.append(checks)
    return shards


def one_process_bound(dtype: torch.dtype) -> float:
    """For what has no float64 path at these lengths (MSA's KL and proxy gradients, Triton
    only): the context-parallel result within a unit of rounding of one process's (fp32:
    1e-5)."""
    return 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps


def gathered(tensors, plan) -> list[torch.Tensor]:
    """The whole sequence of each of this rank's shards, in global order, on every rank."""
    with torch.no_grad():
        return [comm.gather_sequence(t.detach(), plan, None) for t in tensors]


def check_attention(name: str, seq_len: int, setting: dict) -> dict:
    """block_sparse_attn_cp on this world against block_sparse_attn_func on rank 0."""
    device, dtype, backend = setting["device"], setting["dtype"], setting["backend"]
    rank = dist.get_rank()
    layout = LAYOUTS[name](seq_len, device)
    plan = cp_plan(layout, dist.get_world_size())
    shapes = attention_shapes(seq_len, setting["attention"])
    whole = normal(shapes, dtype=dtype, device=device, seed=11)
    index = plan.token_index(rank)
    shards = [whole[n][:, index].clone().requires_grad_() for n in ("q", "k", "v")]
    out = attention_step(shards, whole["grad_out"][:, index], plan, backend)()
    cp = gathered([out, *(t.grad for t in shards)], plan)
    del shards, out
    record = dict(balance=plan.balance)
    if rank == 0:
        inputs = [whole[n].clone().requires_grad_() for n in ("q", "k", "v")]
        out = block_sparse_attn_func(*inputs, layout, causal=True, backend=backend)
        out.backward(whole["grad_out"])
        single = [out.detach(), *(t.grad for t in inputs)]
        del inputs, out
        wide = [whole[n].double().requires_grad_() for n in ("q", "k", "v")]
        out = block_sparse_attn_func(*wide, layout, causal=True, backend="torch",
                                     deterministic=False)  # fmt: skip  # a reference
        out.backward(whole["grad_out"].double())
        exact = [out.detach(), *(t.grad for t in wide)]
        del wide, out
        baseline = same_in_dtype(whole["q"], whole["k"], whole["v"], layout, whole["grad_out"])
        names = ("out", "dq", "dk", "dv")
        record["shards"] = shard_errors(plan, names, cp, single, exact, baseline)
    return record


def check_msa(seq_len: int, setting: dict) -> dict:
    """msa_func_cp on this world against msa_func on rank 0 (granularity "token", the
    default): out, dq, dk and dv by FlashAttention's rule over the selection msa_func made
    (its layout and query masks); the KL loss and the proxy gradients against one
    process's."""
    device, dtype, sizes = setting["device"], setting["dtype"], setting["msa"]
    rank = dist.get_rank()
    plan = cp_plan(msa_layout(seq_len, device), dist.get_world_size(), balance="headtail")
    whole = normal(msa_shapes(seq_len, sizes), dtype=dtype, device=device, seed=12)
    names = [name for name in whole if name != "grad_out"]
    index = plan.token_index(rank)
    shards = [whole[n][:, index].clone().requires_grad_() for n in names]
    out, kl_loss = msa_step(shards, whole["grad_out"][:, index], plan, sizes["top_k"])()
    cp = gathered([out, *(t.grad for t in shards)], plan)  # out, dq_proxy, dk_proxy, dq, ...
    kl_cp = kl_loss.item()
    del shards, out
    record = dict(balance=plan.balance)
    if rank == 0:
        inputs = [whole[n].clone().requires_grad_() for n in names]
        out, kl_loss, (layout, query_masks) = msa_func(
            *inputs, top_k=sizes["top_k"], **MSA_BLOCKS, return_selection=True
        )
        torch.autograd.backward([out, kl_loss], [whole["grad_out"], torch.ones_like(kl_loss)])
        single = [out.detach(), *(t.grad for t in inputs)]
        kl_single = kl_loss.item()
        del inputs, out
        # float64 through the same chunks: the torch backend gathers every block a row's
        # union holds at once, which a per-token union makes nearly dense (16K: 128 GiB).
        exact = same_in_dtype(
            *(whole[n].double() for n in ("q", "k", "v")), layout,
            whole["grad_out"].double(), query_masks,
        )  # fmt: skip
        baseline = same_in_dtype(
            whole["q"], whole["k"], whole["v"], layout, whole["grad_out"], query_masks
        )
        main = [0, 3, 4, 5]  # out, dq, dk, dv
        record["shards"] = shard_errors(
            plan, ("out", "dq", "dk", "dv"), [cp[i] for i in main], [single[i] for i in main],
            exact, baseline,
        )  # fmt: skip
        bound = one_process_bound(dtype)
        for rank_checks, shard in zip(record["shards"], range(plan.world_size), strict=True):
            shard_index = plan.token_index(shard)
            for name, position in (("dq_proxy", 1), ("dk_proxy", 2)):
                difference = relative_difference(
                    cp[position][:, shard_index], single[position][:, shard_index]
                )
                rank_checks[name] = dict(vs_one_process=difference, bound=bound)
        record["kl"] = dict(
            cp=kl_cp, one_process=kl_single, bound=bound,
            vs_one_process=abs(kl_cp - kl_single) / max(abs(kl_single), 1e-30),
        )  # fmt: skip
    return record


def passed(record: dict) -> bool:
    """Every check of a correctness record within its bound."""
    checks = [check for shard in record["shards"] for check in shard.values()]
    checks += [record["kl"]] if "kl" in record else []
    return all(check.get("error", check["vs_one_process"]) <= check["bound"] for check in checks)


# ---- scaling ----------------------------------------------------------------------------


def mib(values: list[int]) -> list[float]:
    return [value / MiB for value in values]


def timings(step, setting: dict) -> dict:
    """The step's synchronised time, and that of the same step computing only."""
    device, repeats = setting["device"], setting["repeats"]
    measured = synchronized_ms(step, device, repeats)
    with compute_only(dist.get_world_size(), device):
        compute = synchronized_ms(step, device, repeats)
    return dict(
        step_ms=measured["ms"], rank_ms=measured["rank_ms"], peak_gib=measured["peak_gib"],
        compute_ms=compute["ms"], compute_rank_ms=compute["rank_ms"],
        exposed_ms=measured["ms"] - compute["ms"],
    )  # fmt: skip


def scale_attention(name: str, seq_len: int, setting: dict, *, peer: bool) -> dict:
    """block_sparse_attn_cp forward + backward over the whole sequence of seq_len tokens
    (and, with peer, the same through collective="allgather")."""
    device, dtype, sizes = setting["device"], setting["dtype"], setting["attention"]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    plan = cp_plan(LAYOUTS[name](seq_len, device), world_size)
    tokens = plan.token_index(rank).numel()
    tensors = normal(attention_shapes(tokens, sizes), dtype=dtype, device=device, seed=rank)
    inputs, grad_out = leaves(tensors), tensors["grad_out"]
    recv, send = plan_bytes(plan, sizes, dtype)
    record = dict(
        balance=plan.balance, recv_mib=mib(recv), send_mib=mib(send),
        **timings(attention_step(inputs, grad_out, plan, setting["backend"]), setting),
    )  # fmt: skip
    if peer:
        step = attention_step(inputs, grad_out, plan, setting["backend"], "allgather")
        measured = synchronized_ms(step, device, setting["repeats"])
        recv, send = allgather_bytes(plan, sizes, dtype)
        record.update(
            peer_ms=measured["ms"], peer_peak_gib=measured["peak_gib"],
            peer_recv_mib=mib(recv), peer_send_mib=mib(send),
        )  # fmt: skip
    return record


def scale_msa(seq_len: int, setting: dict) -> dict:
    """msa_func_cp forward + backward (out and the KL loss) over seq_len tokens."""
    device, dtype, sizes = setting["device"], setting["dtype"], setting["msa"]
    entries = msa_layout_entries(seq_len)
    if entries > INT32_MAX:
        return dict(error=(
            f"skipped: msa_func_cp's plan layout (causal, blocks of 64 x 128) would hold "
            f"{entries:,} entries at {seq_len:,} tokens, past int32 row offsets"
        ))  # fmt: skip
    rank, world_size = dist.get_rank(), dist.get_world_size()
    plan = cp_plan(msa_layout(seq_len, device), world_size, balance="headtail")
    tokens = plan.token_index(rank).numel()
    tensors = normal(msa_shapes(tokens, sizes), dtype=dtype, device=device, seed=rank)
    inputs, grad_out = leaves(tensors), tensors["grad_out"]
    recv, send = msa_bytes(plan, sizes, dtype)
    return dict(
        balance=plan.balance, recv_mib=mib(recv), send_mib=mib(send),
        **timings(msa_step(inputs, grad_out, plan, sizes["top_k"]), setting),
    )  # fmt: skip


# ---- report -----------------------------------------------------------------------------


def record_key(record: dict) -> tuple:
    return record["kind"], record["case"], record["world_size"]


def merged_records(out_dir: pathlib.Path, records: list[dict]) -> list[dict]:
    """This run's records, then those of other (kind, case, world size) in out_dir's
    context_parallel.json and in its sibling folders of the same stem (h200x1, h200x2, ...
    beside h200x8): one table over the world sizes run one at a time."""
    folders = [out_dir]
    match = re.fullmatch(r"(.+)x\d+", out_dir.name)
    if match:
        pattern = re.compile(re.escape(match.group(1)) + r"x\d+")
        folders += sorted(
            path for path in out_dir.parent.iterdir()
            if path.is_dir() and pattern.fullmatch(path.name) and path != out_dir
        )  # fmt: skip
    merged, seen = list(records), {record_key(record) for record in records}
    for folder in folders:
        path = folder / f"{NAME}.json"
        for record in json.loads(path.read_text()) if path.exists() else []:
            if record_key(record) not in seen:
                seen.add(record_key(record))
                merged.append(record)
    return sorted(merged, key=lambda r: (r["kind"], r["case"], r["world_size"]))


def tokens_label(tokens: int) -> str:
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if tokens % size == 0:
            return f"{tokens // size}{unit}"
    return str(tokens)


def worst(record: dict, quantity: str) -> str:
    """The cell of a quantity: the shard nearest its bound, 'error <= bound' (or '>')."""
    checks = [shard[quantity] for shard in record["shards"]]
    check = max(checks, key=lambda c: c.get("error", c["vs_one_process"]) / c["bound"])
    error = check.get("error", check["vs_one_process"])
    return f"{error:.2e} {'<=' if error <= check['bound'] else '>'} {check['bound']:.2e}"


def correctness_rows(records: list[dict]) -> list[tuple[dict, list]]:
    rows = []
    for r in records:
        head = [r["case"], r["world_size"], tokens_label(r["seq_len"]), r["dtype"]]
        if "error" in r:
            rows.append((r, [*head, r["error"][:80], "", "", "", "", "", "no"]))
            continue
        one_process = max(c["vs_one_process"] for s in r["shards"] for c in s.values())
        proxy = "-"
        if "kl" in r:
            proxy = ", ".join([worst(r, "dq_proxy"), worst(r, "dk_proxy"),
                               f"kl {r['kl']['vs_one_process']:.1e}"])  # fmt: skip
        cells = [worst(r, q) for q in ("out", "dq", "dk", "dv")]
        rows.append((r, [*head, *cells, f"{one_process:.1e}", proxy,
                         "yes" if passed(r) else "no"]))  # fmt: skip
    return rows


def baseline_of(records: list[dict], record: dict, **match) -> dict | None:
    """The world-size-1 record of the same kind and case (and match's fields), if measured."""
    for other in records:
        same = all(other.get(name) == value for name, value in match.items())
        if (other["kind"], other["case"], other["world_size"]) == (
            record["kind"], record["case"], 1
        ) and same and "error" not in other:  # fmt: skip
            return other
    return None


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def traffic(record: dict, prefix: str = "") -> str:
    return (f"{max(record[prefix + 'recv_mib']):.1f} / "
            f"{max(record[prefix + 'send_mib']):.1f}")  # fmt: skip


def strong_rows(records: list[dict]) -> list[tuple[dict, list]]:
    rows = []
    for r in records:
        head = [r["case"], tokens_label(r["seq_len"]), r["world_size"]]
        if "error" in r:
            rows.append((r, [*head, r["error"][:80], *[""] * 9]))
            continue
        one = baseline_of(records, r, seq_len=r["seq_len"])
        efficiency = one["step_ms"] / (r["world_size"] * r["step_ms"]) if one else None
        cells = [
            r["balance"], f"{r['step_ms']:.1f}", f"{r['compute_ms']:.1f}",
            f"{r['exposed_ms']:.1f}", "-" if efficiency is None else f"{efficiency:.2f}",
            traffic(r), f"{r['peer_ms']:.1f}", traffic(r, "peer_"),
            f"{r['peer_ms'] / r['step_ms']:.2f}x", gib(r["peak_gib"]),
        ]  # fmt: skip
        rows.append((r, [*head, *cells]))
    return rows


def weak_rows(records: list[dict]) -> list[tuple[dict, list]]:
    rows = []
    for r in records:
        per_rank = r["seq_len"] // r["world_size"]
        head = [r["case"], tokens_label(per_rank), tokens_label(r["seq_len"]), r["world_size"]]
        if "error" in r:
            rows.append((r, [*head, r["error"][:80], *[""] * 5]))
            continue
        one = baseline_of(records, r, seq_len=per_rank)
        efficiency = one["step_ms"] / r["step_ms"] if one else None
        cells = [
            f"{r['step_ms']:.1f}", f"{r['compute_ms']:.1f}", f"{r['exposed_ms']:.1f}",
            "-" if efficiency is None else f"{efficiency:.2f}", traffic(r),
            gib(r["peak_gib"]),
        ]  # fmt: skip
        rows.append((r, [*head, *cells]))
    return rows


def report_body(records: list[dict]) -> list[str]:
    of_kind = {kind: [r for r in records if r["kind"] == kind]
               for kind in ("correctness", "strong", "weak")}  # fmt: skip
    correctness = markdown_table(
        ["case", "N", "tokens", "dtype", "out", "dq", "dk", "dv", "CP vs one process",
         "MSA proxy (dq_proxy, dk_proxy, kl) vs one process", "passed"],
        correctness_rows(of_kind["correctness"]),
    )  # fmt: skip
    strong = markdown_table(
        ["layout", "tokens", "N", "balance", "step ms", "compute ms", "exposed ms",
         "efficiency T1/(N TN)", "MiB in / out per rank", "all-gather ms",
         "all-gather MiB in / out", "all-gather / ours", "peak GiB"],
        strong_rows(of_kind["strong"]),
    )  # fmt: skip
    weak = markdown_table(
        ["case", "tokens per rank", "tokens", "N", "step ms", "compute ms", "exposed ms",
         "efficiency T1/TN", "MiB in / out per rank", "peak GiB"],
        weak_rows(of_kind["weak"]),
    )  # fmt: skip
    return [
        "## Correctness against one process", "",
        "Each cell: the shard (rank) nearest its bound, its relative error against float64 "
        "and FlashAttention's bound (twice PyTorch's error in the same dtype plus one unit "
        "of rounding; fp32: at least 1e-4). MSA's proxy gradients and KL loss have no "
        "float64 path at these lengths: they are compared with one process's (bound: one "
        "unit of rounding, 1e-5 in fp32).", "", *correctness, "",
        "## Strong scaling", "",
        "One sequence over N ranks. compute: the same plan with every collective replaced "
        "by a local tensor of its shape; exposed = step - compute. MiB in / out: the busiest "
        "rank's K/V received in the forward and dK/dV sent in the backward (plan.stats). "
        "all-gather: every rank's K/V brought to every rank (collective='allgather'), the "
        "peer's way for masks a ring cannot skip.", "", *strong, "",
        "## Weak scaling", "",
        "The same tokens per rank at every N; efficiency T1 / TN. msa: msa_func_cp, which "
        "all-gathers K, V and the proxy keys (MiB: what each rank receives and returns).",
        "", *weak,
    ]  # fmt: skip


# ---- main -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-len", type=parse_length, default=parse_length("1m"),
                        help="strong scaling's tokens, and weak scaling's per rank")  # fmt: skip
    parser.add_argument("--causal-len", type=parse_length, default=None,
                        help="dense causal's tokens (default: a quarter of --seq-len)")  # fmt: skip
    parser.add_argument("--check-len", type=parse_length, default=None,
                        help="correctness's tokens (default: 128K, at most --seq-len)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls after a warm-up (default: 3, 1 on the CPU)")  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink SHARP (multicast) off, before init
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    # Rank 0 computes the one-process references while the others wait: a long timeout.
    timeout = datetime.timedelta(minutes=30)
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    setting = dict(
        device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        backend="auto" if device.type == "cuda" else "torch",
        repeats=args.repeats or (3 if device.type == "cuda" else 1),
        attention=ATTENTION[device.type], msa=MSA[device.type],
    )  # fmt: skip
    # msa_func runs Triton kernels: on the CPU only under the interpreter, at a quarter of
    # the lengths (its per-token selection is slow interpreted).
    with_msa = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    msa_share = 1.0 if device.type == "cuda" else 0.25
    check_len = args.check_len or min(128 * 1024, args.seq_len)
    causal_len = args.causal_len or max(args.seq_len // 4 // 128 * 128, 128)
    meta = run_metadata(device)
    dtype_name = str(setting["dtype"]).removeprefix("torch.")
    records = []

    def run(kind: str, case: str, seq_len: int, measure) -> None:
        """measure(seq_len, setting)'s record, or the error it raised (alike on every rank:
        shapes and plans are)."""
        if rank == 0:
            print(f"{kind} {case} on {world_size} ranks ...", flush=True)
        try:
            result = measure(seq_len, setting)
        except (RuntimeError, ValueError, TypeError) as error:  # the same on every rank
            result = dict(error=failure(error))
        record = dict(meta, kind=kind, case=case, world_size=world_size, seq_len=seq_len,
                      dtype=dtype_name, **result)  # fmt: skip
        if kind == "correctness" and "shards" in record:
            record["passed"] = passed(record)
        records.append(record)
        if rank == 0:
            summary = {k: v for k, v in record.items() if k in (
                "step_ms", "compute_ms", "exposed_ms", "peer_ms", "passed", "error")}  # fmt: skip
            print(f"  {summary}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        dist.barrier()

    for case in CORRECTNESS:
        if case != "msa":
            run("correctness", case, check_len, partial(check_attention, case))
        elif with_msa:
            run("correctness", case, round(check_len * msa_share), check_msa)
    for case in STRONG:
        run("strong", case, causal_len if case == "causal" else args.seq_len,
            partial(scale_attention, case, peer=True))  # fmt: skip
    for case in WEAK:
        if case != "msa":
            run("weak", case, world_size * args.seq_len, partial(scale_attention, case, peer=False))
        elif with_msa:
            run("weak", case, round(world_size * args.seq_len * msa_share), scale_msa)

    if rank == 0:
        out_dir = results_dir(args.out, device, suffix=f"x{world_size}")
        measured = {record_key(record) for record in records}
        kept = kept_records(out_dir / f"{NAME}.json", record_key, measured)
        mine = [*records, *kept]
        attention, msa = setting["attention"], setting["msa"]
        notes = (
            f"One run per world size N (this one: {world_size}); rows of other N come from "
            f"earlier runs' records. {dtype_name}, B 1, causal, blocks of 128; attention "
            f"H_q {attention['heads_q']}, H_kv {attention['heads_kv']}, D "
            f"{attention['head_dim']}; msa H_q {msa['heads_q']}, H_kv {msa['heads_kv']}, "
            f"{msa['proxy']} proxy heads, {msa['proxy_keys']} proxy key head, top_k "
            f"{msa['top_k']}, q_block 64, kv_block 128, per-token selection. Times: forward + "
            "backward, every rank starting after a barrier, the slowest rank's, median of "
            f"{setting['repeats']} after one."
            + ("" if with_msa else " This run skipped MSA: on the CPU it needs TRITON_INTERPRET=1.")
        )
        write_report(out_dir, NAME, mine, meta=meta, title="Context parallelism",
                     notes=notes, body=report_body(merged_records(out_dir, mine)))  # fmt: skip
        print(f"wrote {out_dir / NAME}.json and .md", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
