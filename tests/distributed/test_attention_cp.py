"""block_sparse_attn_cp across 2, 3 and 4 gloo processes against one process.

Spawning is slow, so each world size is one spawn that runs every case: the ranks build the
same global inputs from a seed, each computes the one-process result itself and compares
its shard. A rank records failures instead of raising, so that no rank leaves the others
waiting in a collective; the parent reports them all.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flash_msa import patterns
from flash_msa.distributed import block_sparse_attn_cp, cp_plan, msa_func_cp
from flash_msa.modules import FlashSparseAttention, MSAAttention
from flash_msa.msa import msa_func
from flash_msa.ops.interface import block_sparse_attn_func
from flash_msa.sequences import document_ids_of
from flash_msa.testing import random_qkv, relative_error

SEQ_LEN = 150  # ragged: 4 blocks of 32 and 22 tokens (head-tail on 4 ranks: empty chunks)


def window_sinks(seq_len, window, sinks, **blocks):
    return patterns.sliding_window(seq_len, window, **blocks) | patterns.global_tokens(
        seq_len, sinks, **blocks
    )


# name -> (layout, options, balance, heads (q, kv), dtype, backend)
CASES = {
    "window+sinks causal": (
        lambda: window_sinks(SEQ_LEN, 40, 16, block_size=32),
        dict(causal=True),
        "contiguous",
        (2, 2),
        torch.float64,
        "torch",
    ),
    "causal headtail": (
        lambda: patterns.causal(SEQ_LEN, block_size=32),
        dict(causal=True),
        "headtail",
        (2, 1),
        torch.float64,
        "torch",
    ),
    "causal allgather": (
        lambda: patterns.causal(SEQ_LEN, block_size=32),
        dict(causal=True, collective="allgather"),
        "headtail",
        (2, 2),
        torch.float64,
        "torch",
    ),
    "bigbird auto": (
        lambda: patterns.bigbird(SEQ_LEN, 40, 32, 1, seed=3, block_size=32),
        {},
        "auto",
        (2, 2),
        torch.float64,
        "torch",
    ),
    "random two-sided window": (
        lambda: patterns.random_blocks(SEQ_LEN, 2, seed=1, causal=False, block_size=32),
        dict(window_size=(40, 10)),
        "headtail",
        (2, 2),
        torch.float64,
        "torch",
    ),
    "per-head layouts, GQA": (
        lambda: patterns.stack(
            [window_sinks(SEQ_LEN, 40, 16, block_size=32), patterns.causal(SEQ_LEN, block_size=32)]
        ),
        dict(causal=True),
        "auto",
        (4, 2),
        torch.float64,
        "torch",
    ),
    "per-batch top-k": (
        lambda: patterns.topk(
            torch.randn(2, 1, 5, 5, generator=torch.Generator().manual_seed(4)),
            2,
            seq_len_q=SEQ_LEN,
            block_size=32,
        ),
        {},
        "headtail",
        (2, 2),
        torch.float64,
        "torch",
    ),
    "documents across shards": (
        lambda: patterns.causal(SEQ_LEN, block_size=32),
        dict(causal=True, documents=True),
        "headtail",
        (2, 2),
        torch.float64,
        "torch",
    ),
    "q16 kv32 window": (
        lambda: window_sinks(SEQ_LEN, 40, 16, q_block=16, kv_block=32),
        dict(causal=True),
        "contiguous",
        (2, 2),
        torch.float64,
        "torch",
    ),
    "triton window+sinks": (
        lambda: window_sinks(SEQ_LEN, 40, 16, block_size=32),
        dict(causal=True),
        "headtail",
        (2, 1),
        torch.float32,
        "triton",
    ),
    "triton dropout": (
        lambda: patterns.causal(SEQ_LEN, block_size=32),
        dict(causal=True, dropout_p=0.25),
        "headtail",
        (2, 2),
        torch.float32,
        "triton",
    ),
}
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


def _on_rank_zero(rank, compute):
    """compute()'s tensors, computed by rank 0 alone and sent to every rank: the one-process
    result each rank compares its shard with."""
    results = [[t.detach() for t in compute()] if rank == 0 else None]
    dist.broadcast_object_list(results, src=0)
    return results[0]


def _documents():
    cu_seqlens = torch.tensor([0, 30, 41, 90, 120, SEQ_LEN], dtype=torch.int32)
    return document_ids_of(cu_seqlens)[None]  # [1, S]


def _check_case(name, rank, world_size):
    build, options, balance, (heads_q, heads_kv), dtype, backend = CASES[name]
    options = dict(options)
    collective = options.pop("collective", "all_to_all")
    layout = build()
    batch = 2 if backend == "torch" else 1  # the interpreter is slow
    if options.pop("documents", False):
        options["document_ids"] = _documents().expand(batch, -1)
    q, k, v = random_qkv(batch, SEQ_LEN, heads_q, 16, heads_kv=heads_kv, dtype=dtype, seed=7)
    # Memory no row reads is never read: NaN there must not reach any result.
    unread = torch.ones(layout.num_kv_blocks, dtype=torch.bool)
    unread[layout.col_indices.long()] = False
    unread_tokens = unread.repeat_interleave(layout.kv_block)[:SEQ_LEN]
    k[:, unread_tokens], v[:, unread_tokens] = float("nan"), float("nan")
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(8), dtype=dtype)

    def whole_sequence():
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(11)  # the same dropout seed as the ranks'
        out, lse = block_sparse_attn_func(
            *inputs, layout, return_lse=True, backend=backend, **options
        )
        out.backward(grad_out)
        return [out, lse, *(t.grad for t in inputs)]

    out, lse, *grads = _on_rank_zero(rank, whole_sequence)

    plan = cp_plan(layout, world_size, balance=balance)
    index = plan.token_index(rank)
    shards = [t[:, index].clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(11)
    out_cp, lse_cp = block_sparse_attn_cp(
        *shards, plan, return_lse=True, backend=backend, collective=collective, **options
    )
    out_cp.backward(grad_out[:, index])
    failures = []
    pairs = [("out", out_cp, out[:, index]), ("lse", lse_cp, lse[:, :, index])]
    pairs += [(f"d{n}", s.grad, g[:, index]) for n, s, g in zip("qkv", shards, grads, strict=True)]
    for what, actual, expected in pairs:
        error = relative_error(actual, expected)
        if not error <= TOLERANCE[dtype]:
            failures.append(f"{name}: rank {rank} {what} relative error {error:.3g}")
    return failures


MSA_CASES = {"msa": dict(warmup=False), "msa warm-up": dict(warmup=True),
             "msa documents": dict(warmup=False, documents=True),
             "msa block documents": dict(warmup=False, documents=True,
                                         granularity="block"),
             "msa rows of one token": dict(warmup=False, documents=True, q_block=1),
             "msa fp8 scores": dict(warmup=False, score_dtype=torch.float8_e4m3fn),
             "msa block fp8 scores": dict(warmup=False, granularity="block",
                                          score_dtype=torch.float8_e4m3fn)}  # fmt: skip


def _check_msa_case(name, rank, world_size):
    """msa_func_cp's shards of out, the KL and every gradient against msa_func's (float32,
    Triton interpreter; selections are equal: the scores are computed alike), per token
    unless the case says granularity "block"; rows of one token (q_block 1) with the 16 query
    heads of one proxy head a tile needs; FP8 scores quantize the rank's query rows and the
    gathered keys as the whole sequence's."""
    options = dict(MSA_CASES[name])
    cu_seqlens = None
    if options.pop("documents", False):
        cu_seqlens = torch.tensor([0, 30, 41, 90, 120, SEQ_LEN], dtype=torch.int32)
    q_block = options.pop("q_block", 16)
    blocks = dict(q_block=q_block, kv_block=32, top_k=2)
    generator = torch.Generator().manual_seed(5)
    heads = dict(q_proxy=2, k_proxy=1, q=4, k=1, v=1)
    if q_block == 1:
        heads = dict(q_proxy=1, k_proxy=1, q=16, k=1, v=1)
    whole = [torch.randn(1, SEQ_LEN, h, 16, generator=generator) for h in heads.values()]
    grad_out = torch.randn(1, SEQ_LEN, heads["q"], 16, generator=generator)

    def whole_sequence():
        inputs = [t.clone().requires_grad_() for t in whole]
        if cu_seqlens is None:
            out, kl = msa_func(*inputs, **blocks, **options)
        else:  # msa_func takes documents packed [T, H, D]
            packed = [t[0] for t in inputs]
            out, kl = msa_func(*packed, **blocks, cu_seqlens=cu_seqlens, **options)
            out = out[None]
        (out * grad_out).sum().add(kl).backward()
        return [out, kl, *(t.grad for t in inputs)]

    out, kl, *grads = _on_rank_zero(rank, whole_sequence)

    layout = patterns.causal(SEQ_LEN, q_block=q_block, kv_block=32)
    plan = cp_plan(layout, world_size, balance="headtail")
    index = plan.token_index(rank)
    shards = [t[:, index].clone().requires_grad_() for t in whole]
    # q_block left out: msa_func_cp takes the plan's
    out_cp, kl_cp = msa_func_cp(*shards, plan, kv_block=32, top_k=2, cu_seqlens=cu_seqlens,
                                **options)  # fmt: skip
    (out_cp * grad_out[:, index]).sum().add(kl_cp).backward()
    failures = []
    pairs = [("out", out_cp, out[:, index]), ("kl", kl_cp, kl)]
    pairs += [(f"d{n}", s.grad, g[:, index]) for n, s, g in zip(heads, shards, grads, strict=True)]
    for what, actual, expected in pairs:
        error = relative_error(actual, expected)
        if not error <= 1e-5:
            failures.append(f"{name}: rank {rank} {what} relative error {error:.3g}")
    return failures


# Every world size runs every float64 case; the Triton interpreter's cases (minutes on two
# cores) run on 2 ranks, but MSA with documents and with FP8 scores, which run on 3.
FLOAT64 = [name for name, case in CASES.items() if case[-1] == "torch"]
ON_THREE_RANKS = ("msa documents", "msa fp8 scores")
CASES_OF_WORLD = {
    2: [*CASES, *(name for name in MSA_CASES if name not in ON_THREE_RANKS)],
    3: [*FLOAT64, *ON_THREE_RANKS],
    4: FLOAT64,
}


def _expect_error(name, rank, function, match, kind=ValueError):
    try:
        function()
    except kind as error:
        return [] if match in str(error) else [f"{name}: rank {rank}: wrong message {error}"]
    except Exception:  # noqa: BLE001 - reported to the parent
        return [f"{name}: rank {rank}: {traceback.format_exc()}"]
    return [f"{name}: rank {rank}: no error"]


def _bad_inputs(rank, world_size):
    layout = window_sinks(SEQ_LEN, 40, 16, block_size=32)
    plan = cp_plan(layout, world_size, balance="contiguous")
    q, k, v = random_qkv(1, SEQ_LEN, 2, 16, dtype=torch.float64, seed=3)
    index = plan.token_index(rank)
    shards = [t[:, index] for t in (q, k, v)]
    failures = []
    # One rank's shards are short: every rank raises, naming it.
    short = [t[:, :-1] if rank == 1 else t for t in shards]
    failures += _expect_error(
        "short shard", rank, lambda: block_sparse_attn_cp(*short, plan, backend="torch"),
        "rank 1's shards do not match the plan",
    )  # fmt: skip
    # One rank's plan is of another layout.
    other = cp_plan(patterns.causal(SEQ_LEN, block_size=32), world_size, balance="contiguous")
    mixed = other if rank == world_size - 1 else plan
    other_shards = [t[:, mixed.token_index(rank)] for t in (q, k, v)]
    failures += _expect_error(
        "other plan", rank, lambda: block_sparse_attn_cp(*other_shards, mixed, backend="torch"),
        f"their plan active blocks values differ ({layout.nnz} and {other.layout.nnz})",
    )  # fmt: skip
    # One rank's plan gives the same layout's blocks to other ranks: sizes agree, owners not.
    headtail = cp_plan(layout, world_size, balance="headtail")
    owned = headtail if rank == world_size - 1 else plan
    owned_shards = [t[:, owned.token_index(rank)] for t in (q, k, v)]
    failures += _expect_error(
        "other owners", rank, lambda: block_sparse_attn_cp(*owned_shards, owned, backend="torch"),
        "plans differ in their blocks or block owners (their sizes agree)",
    )  # fmt: skip
    # One rank passes something else than a plan: every rank raises its TypeError.
    not_a_plan = "plan" if rank == world_size - 1 else plan
    failures += _expect_error(
        "not a plan", rank, lambda: block_sparse_attn_cp(*shards, not_a_plan, backend="torch"),
        f"rank {world_size - 1}: plan must be a CpPlan (from cp_plan), got str", TypeError,
    )  # fmt: skip
    # A plan for another world size.
    wrong = cp_plan(layout, world_size + 1)
    failures += _expect_error(
        "world size", rank, lambda: block_sparse_attn_cp(*shards, wrong, backend="torch"),
        f"built for world_size {world_size + 1}",
    )  # fmt: skip
    failures += _expect_error(
        "group", rank, lambda: block_sparse_attn_cp(*shards, plan, group="world"),
        "group must be a torch.distributed ProcessGroup (or None: the default group), got str",
        TypeError,
    )  # fmt: skip
    failures += _one_rank_differs(rank, world_size, plan, shards)
    return failures


def _one_rank_differs(rank, world_size, plan, shards):
    """An argument that one rank alone gets wrong, or passes otherwise than the rest: every
    rank raises the same error (a rank waiting alone in a collective would hang)."""
    last = rank == world_size - 1
    options = dict(backend="torch")
    calls = {
        "window_size (-2, 0)": (dict(options, window_size=(-2, 0) if last else (-1, -1)),
                                f"rank {world_size - 1}: window_size must be"),
        "backend": (dict(backend="nope" if last else "torch"),
                    f"rank {world_size - 1}: backend must be 'auto' or one of"),
        "collective": (dict(options, collective="allgather" if last else "all_to_all"),
                       "their collective (0 all_to_all, 1 allgather) values differ (0 and 1)"),
        "dropout": (dict(options, dropout_p=0.1 if last else 0.0),
                    "their dropout_p > 0 values differ (0 and 1)"),
        "document_ids": (dict(options, document_ids=_documents() if last else None),
                         "their document_ids (a fingerprint) values differ;"),
    }  # fmt: skip
    failures = []
    for name, (call_options, message) in calls.items():
        failures += _expect_error(
            name, rank, lambda call_options=call_options: block_sparse_attn_cp(
                *shards, plan, **call_options),
            message,
        )  # fmt: skip
    # Only rank 0 builds a graph: its backward alone would send dK/dV.
    grads = [t.clone().requires_grad_(rank == 0) for t in shards]
    failures += _expect_error(
        "requires_grad", rank, lambda: block_sparse_attn_cp(*grads, plan, **options),
        "their requires_grad values differ (1 and 0)",
    )  # fmt: skip
    # msa_func_cp: the last rank's proxy keys have another head count (their all-gather
    # would mix up sizes).
    msa_plan = cp_plan(patterns.causal(SEQ_LEN, q_block=16, kv_block=32), world_size)
    msa = [
        torch.zeros(1, msa_plan.token_index(rank).numel(), heads, 16, dtype=torch.float32)
        for heads in (2, 2 if last else 1, 4, 1, 1)
    ]
    failures += _expect_error(
        "k_proxy heads", rank, lambda: msa_func_cp(*msa, msa_plan, kv_block=32),
        "their k_proxy heads values differ (1 and 2)",
    )  # fmt: skip
    tokens = msa_plan.token_index(rank).numel()
    msa = [torch.zeros(1, tokens, heads, 16) for heads in (2, 1, 4, 1, 1)]
    msa_calls = {
        "softmax_scale 'x'": (dict(softmax_scale="x" if last else None),
                              f"rank {world_size - 1}: softmax_scale must be"),
        "softmax_scale": (dict(softmax_scale=0.5 if last else None),
                          "their softmax scales (a fingerprint) values differ;"),
        "top_k": (dict(top_k=3 if last else 2),
                  "their top_k (blocks kept) values differ (2 and 3)"),
        "warmup": (dict(warmup=last), "their warmup values differ (0 and 1)"),
        "granularity": (dict(granularity="block" if last else "token", q_block=16),
                        "their granularity (0 token, 1 block) values differ (0 and 1)"),
    }  # fmt: skip
    for name, (call_options, message) in msa_calls.items():
        failures += _expect_error(
            name, rank, lambda call_options=call_options: msa_func_cp(
                *msa, msa_plan, kv_block=32, **{"top_k": 2, **call_options}),
            message,
        )  # fmt: skip
    failures += _layer_shards_differ(rank, world_size, last)
    return failures


def _layer_shards_differ(rank, world_size, last):
    """A layer's input or plan that one rank alone gets wrong: every rank raises it, before
    a rank could wait alone in the attention's collectives."""
    layer = FlashSparseAttention(32, 2, block_size=32, backend="torch",
                                 cp_group=dist.group.WORLD)  # fmt: skip
    msa_layer = MSAAttention(32, 2, num_kv_heads=1, num_proxy_heads=2, proxy_head_dim=8, top_k=2,
                             kv_block=32, cp_group=dist.group.WORLD)  # fmt: skip
    failures = []
    for name, module in (("layer", layer), ("msa layer", msa_layer)):
        plan = module.cp_plan_for(SEQ_LEN, torch.device("cpu"))
        tokens = plan.token_index(rank).numel()
        wide = torch.randn(1, tokens, 16 if last else 32)
        failures += _expect_error(
            f"{name} x width", rank, lambda module=module, plan=plan, wide=wide: module(
                wide, cp_plan=plan),
            f"rank {world_size - 1}: x must be [batch, seq_len, embed_dim] with embed_dim = 32",
        )  # fmt: skip
        x = torch.randn(1, tokens - last, 32)
        failures += _expect_error(
            f"{name} short shard", rank, lambda module=module, plan=plan, x=x: module(
                x, cp_plan=plan),
            f"rank {world_size - 1}: the shard x holds",
        )  # fmt: skip
        not_a_plan = "plan" if last else plan
        x = torch.randn(1, tokens, 32)
        failures += _expect_error(
            f"{name} not a plan", rank, lambda module=module, plan=not_a_plan, x=x: module(
                x, cp_plan=plan),
            f"rank {world_size - 1}: plan must be a CpPlan (from cp_plan), got str", TypeError,
        )  # fmt: skip
    return failures


def _layer_case(rank, world_size):
    """FlashSparseAttention with cp_group on shards equals the layer on the whole sequence:
    output rows, input gradients and (summed over ranks) weight gradients."""
    options = dict(num_kv_heads=1, block_size=32, backend="torch", dtype=torch.float64)
    torch.manual_seed(2)
    pattern = lambda seq_len, **blocks: window_sinks(seq_len, 40, 16, **blocks)  # noqa: E731
    whole = FlashSparseAttention(32, 2, pattern=pattern, **options)
    sharded = FlashSparseAttention(32, 2, pattern=pattern, cp_group=dist.group.WORLD, **options)
    sharded.load_state_dict(whole.state_dict())
    x = torch.randn(2, SEQ_LEN, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    weights = torch.randn(
        2, SEQ_LEN, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64
    )

    def whole_sequence():
        inputs = x.clone().requires_grad_()
        (whole(inputs) * weights).sum().backward()
        return [whole(inputs).detach(), inputs.grad, *(p.grad for p in whole.parameters())]

    out, grad_x, *grads = _on_rank_zero(rank, whole_sequence)
    plan = sharded.cp_plan_for(SEQ_LEN, x.device)
    index = plan.token_index(rank)
    shard = x[:, index].clone().requires_grad_()
    out_cp = sharded(shard, cp_plan=plan)
    (out_cp * weights[:, index]).sum().backward()
    pairs = [("layer out", out_cp, out[:, index]), ("layer dx", shard.grad, grad_x[:, index])]
    for parameter, expected in zip(sharded.parameters(), grads, strict=True):
        dist.all_reduce(parameter.grad)
        pairs.append(("layer weight grad", parameter.grad, expected))
    return [
        f"{what}: rank {rank} relative error {error:.3g}"
        for what, actual, expected in pairs
        if not (error := relative_error(actual, expected)) <= TOLERANCE[torch.float64]
    ]


def _worker(rank, world_size, init_file, results):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    torch.set_num_threads(1)
    failures = []
    for name in CASES_OF_WORLD[world_size]:
        check = _check_msa_case if name in MSA_CASES else _check_case
        try:
            failures += check(name, rank, world_size)
        except Exception:  # noqa: BLE001 - reported to the parent
            failures.append(f"{name}: rank {rank}: {traceback.format_exc()}")
    for check in (_layer_case, _bad_inputs):
        try:
            failures += check(rank, world_size)
        except Exception:  # noqa: BLE001 - reported to the parent
            failures.append(f"{check.__name__}: rank {rank}: {traceback.format_exc()}")
    results[rank] = failures
    _destroy_group()


def _destroy_group():
    """Every rank past its last collective, then the default group torn down."""
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the ranks are gloo processes on the CPU whose Triton kernels run in the "
    "interpreter: the CPU suite's test (on the GPU machine the interpreter fails under its "
    "NumPy, in range() over a kernel's scalar; the one-rank tests below run there on the GPU)",
)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_context_parallel_matches_one_process(world_size, tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world_size, str(tmp_path / "init"), results), nprocs=world_size)
        failures = [line for rank in range(world_size) for line in results.get(rank, ["died"])]
    assert not failures, "\n".join(failures)


# ---- msa_func_cp in a group of this process alone -----------------------------------------
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


@pytest.fixture
def one_rank_group(tmp_path):
    """The default process group of this process alone (gloo)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)  # fmt: skip
    yield
    _destroy_group()


def _msa_tensors():
    """q_proxy, k_proxy, q, k, v of SEQ_LEN tokens: 2 proxy heads over 4 query heads."""
    generator = torch.Generator().manual_seed(6)
    return [
        torch.randn(1, SEQ_LEN, heads, 16, generator=generator).to(DEVICE)
        for heads in (2, 1, 4, 1, 1)
    ]


def test_msa_warmup_refuses_a_plan_without_every_causal_block(one_rank_group):
    """Warm-up attends over the plan's layout: one of a window (a plan msa_func_cp is not
    built for) would silently drop the causal blocks outside it."""
    tensors = _msa_tensors()
    window = cp_plan(window_sinks(SEQ_LEN, 40, 16, block_size=32, device=DEVICE), 1)
    with pytest.raises(ValueError, match=r"warmup attends over every causal block of the plan's "
                                         r"layout, but its row 4 \(layout head 0\) lacks some of "
                                         r"kv blocks 0\.\.4"):  # fmt: skip
        msa_func_cp(*tensors, window, kv_block=32, warmup=True)
    causal = cp_plan(patterns.causal(SEQ_LEN, block_size=32, device=DEVICE), 1)
    out, kl = msa_func_cp(*tensors, causal, kv_block=32, warmup=True)
    expected_out, expected_kl = msa_func(*tensors, q_block=32, kv_block=32, warmup=True)
    assert relative_error(out, expected_out) < 1e-5 and relative_error(kl, expected_kl) < 1e-5


def test_msa_top_k_past_the_kv_blocks_keeps_them_all(one_rank_group):
    """A top_k beyond the whole sequence's kv blocks (here beyond int64) selects what top_k
    equal to their count selects."""
    tensors = _msa_tensors()
    plan = cp_plan(patterns.causal(SEQ_LEN, block_size=32, device=DEVICE), 1)
    out, kl = msa_func_cp(*tensors, plan, top_k=2**70, kv_block=32)
    expected_out, expected_kl = msa_func_cp(*tensors, plan, top_k=5, kv_block=32)  # 5 blocks
    assert torch.equal(out, expected_out) and torch.equal(kl, expected_kl)


GROUP_LIFETIME = """
import sys, tempfile, weakref
import torch
import torch.distributed as dist
from flash_msa import patterns
from flash_msa.distributed import block_sparse_attn_cp, cp_plan

dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/init", rank=0,
                        world_size=1)
group = weakref.ref(dist.group.WORLD)
q = torch.randn(1, 64, 2, 16, dtype=torch.float64)
block_sparse_attn_cp(q, q, q, cp_plan(patterns.causal(64, block_size=32), 1), backend="torch")
dist.destroy_process_group()
sys.exit(group() is not None)
"""


def test_the_default_group_dies_with_destroy_process_group():
    """In a fresh process, a context-parallel call (the first custom op call, which makes
    torch load torch.distributed.nn.functional) leaves no reference to the default group
    behind: destroy_process_group frees it, rather than the interpreter's shutdown, where
    Gloo's threads abort the process."""
    subprocess.run([sys.executable, "-c", GROUP_LIFETIME], check=True, timeout=300)
