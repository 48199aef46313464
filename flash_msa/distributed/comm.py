"""Collectives of context parallelism on torch.distributed: the agreement check that comes
before any exchange, and the block exchanges of the forward and the backward.

Buffers of whole kv blocks are laid out [n, kv_block, B, 2, H, D] (K and V side by side):
dim 0 splits by rank for all_to_all_single, and K (or V) of n blocks reads as a strided
[B, n * kv_block, H, D] view with unit last stride, which the kernels take without a copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

# Loaded with flash_msa, before any process group exists: its functions take the default
# group as a default argument when the module loads, and torch loads it on the first call
# of a custom op (through torch._dynamo). Loaded after init_process_group, it would hold
# that group past destroy_process_group until the interpreter shuts down, where Gloo's
# threads then abort the process.
import torch.distributed.nn.functional  # noqa: F401

from flash_msa.distributed.plan import PLAN_SIZES, CpPlan

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# What each shard tells the other ranks (its tokens, dim 1, are checked against the plan).
_SHARD_FACTS = ("batch", "heads", "head_dim", "dtype")


def check_member(group, name: str) -> None:
    """ValueError for what new_group returns on the ranks it leaves out (an int,
    GroupMember.NON_GROUP_MEMBER), in place of a group."""
    non_member = dist.GroupMember.NON_GROUP_MEMBER
    if type(group) is type(non_member) and group == non_member:
        raise ValueError(
            f"{name} is GroupMember.NON_GROUP_MEMBER: this process is not a member of the "
            "group (new_group returns it on the ranks it leaves out); call on the group's "
            "ranks only"
        )


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in `group` (the default group when None)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "context parallelism needs torch.distributed: call "
            "torch.distributed.init_process_group (e.g. under torchrun) first"
        )
    check_member(group, "group")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed ProcessGroup (or None: the default group), got "
            f"{type(group).__name__}"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the group it passed")
    return rank


def check_group_size(plan: CpPlan, group) -> None:
    size = dist.get_world_size(group)
    if size != plan.world_size:
        raise ValueError(
            f"the group has {size} ranks but the plan was built for world_size "
            f"{plan.world_size}: build it with cp_plan(layout, {size})"
        )


def requires_grad(*tensors: torch.Tensor) -> bool:
    """Whether the call builds a graph: its backward then runs collectives, on every rank."""
    return torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)


def fingerprint(values: torch.Tensor | None) -> int:
    """An integer that tells checked int tensors of different values apart (almost surely),
    for ranks to compare what every rank must pass alike; 0 for None."""
    if values is None:
        return 0
    flat = values.reshape(-1).long()
    weights = torch.arange(1, flat.numel() + 1, device=flat.device)
    total = int((flat * weights).sum())  # int64 wraps alike on every rank
    return (total + flat.numel()) % (1 << 62)


def _shard_facts(tensor: torch.Tensor) -> list[int]:
    dtype = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else -1
    return [tensor.shape[0], tensor.shape[2], tensor.shape[3], dtype]


def _fact_value(name: str, value: int) -> str:
    """A fact as a message shows it: dtypes by name."""
    if name.endswith("dtype") and 0 <= value < len(_DTYPES):
        return str(_DTYPES[value])
    return str(value)


def agree(
    plan: CpPlan,
    rank: int,
    group,
    shards: dict[str, torch.Tensor],
    settings: tuple[str, ...],
    check: Callable[[], tuple[int, list[int]]],
) -> list[int]:
    """Check every rank's call before any exchange, so that no rank waits alone in a later
    collective: the same error on every rank, never a hang.

    Each rank runs check(): its own checks of its arguments, which return a value to share
    (e.g. a dropout seed) and the values of `settings` (integers every rank must pass alike,
    named in that order). Then one all_gather of a few integers tells every rank whether each
    rank's checks passed and, where all did, compares the plans, each shard's batch, heads,
    head dim and dtype (the shards [B, S_local, H, D]) and the settings. A failed check makes
    every rank raise that rank's error (its type and message, gathered once); a mismatch
    raises the same ValueError on every rank.

    Returns every rank's check() value (rank order).
    """
    failure, shared = None, 0
    try:
        shared, values = check()
        expected = plan.token_index(rank).numel()
        mismatch = int(
            any(t.shape[1] != expected for t in shards.values())
            or any(t.shape[0] != shards["q"].shape[0] for t in shards.values())
        )
        facts = [*plan.sizes(), plan.digest(), *values, mismatch]
        facts += [fact for tensor in shards.values() for fact in _shard_facts(tensor)]
    except (TypeError, ValueError) as error:  # plan may be anything here: only counts
        failure = error
        facts = [0] * (len(PLAN_SIZES) + 2 + len(settings) + len(_SHARD_FACTS) * len(shards))
    mine = torch.tensor([failure is not None, shared, *facts], dtype=torch.int64,
                        device=_collective_device(group))  # fmt: skip
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    table = torch.stack(gathered).tolist()  # [w, 2 + len(facts)]
    _raise_any_failure([row[0] for row in table], failure, group)
    names = [*(f"plan {size}" for size in PLAN_SIZES), "plan", *settings, "shard tokens"]
    names += [f"{shard} {fact}" for shard in shards for fact in _SHARD_FACTS]
    for other, row in enumerate(table):
        for name, value, first in zip(names, row[2:], table[0][2:], strict=True):
            if name == "shard tokens" and value:
                tokens = plan.token_index(other).numel()
                raise ValueError(
                    f"rank {other}'s shards do not match the plan: it holds {tokens} tokens and "
                    f"every shard ({', '.join(shards)}) must be [B, {tokens}, H, D] with one B; "
                    "shard with x[:, plan.token_index(rank)]"
                )
            if value != first:
                what = f"{name} values differ"
                if name == "plan":
                    what = "plans differ in their blocks or block owners (their sizes agree)"
                elif "fingerprint" not in name:
                    what += f" ({_fact_value(name, first)} and {_fact_value(name, value)})"
                raise ValueError(
                    f"ranks 0 and {other} disagree: their {what}; every rank must "
                    "pass shards of the same batch, heads, head_dim and dtype, the same options, "
                    "and the plan built from the same layout"
                )
    return [row[1] for row in table]


def check_on_every_rank(group, check: Callable[[], None]) -> None:
    """Run this rank's check() and share its outcome (one all_gather of a flag): an error on
    any rank raises on every rank, so that no rank goes on alone to a later collective."""
    failure = None
    try:
        check()
    except (TypeError, ValueError) as error:
        failure = error
    mine = torch.tensor([failure is not None], dtype=torch.int64, device=_collective_device(group))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    _raise_any_failure([int(flag) for flag in gathered], failure, group)


def _raise_any_failure(failed_flags: list[int], failure: Exception | None, group) -> None:
    """Where any rank's flag is set, raise the first such rank's error (its type and message,
    gathered once) on every rank."""
    failed = [other for other, flag in enumerate(failed_flags) if flag]
    if not failed:
        return
    errors = [None] * len(failed_flags)
    mine = None if failure is None else (type(failure) is TypeError, str(failure))
    dist.all_gather_object(errors, mine, group=group)
    type_error, message = errors[failed[0]]
    raise (TypeError if type_error else ValueError)(f"rank {failed[0]}: {message}") from failure


def _collective_device(group) -> torch.device:
    """Where the group's collectives take their tensors: CUDA for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def kv_blocks(k: torch.Tensor, v: torch.Tensor, blocks: int, kv_block: int) -> torch.Tensor:
    """K and V of a shard as [B, blocks, kv_block, 2, H, D], the ragged end zero-padded."""
    pad = blocks * kv_block - k.shape[1]
    pairs = torch.stack([k, v], dim=2)  # [B, S, 2, H, D]
    if pad:
        pairs = torch.nn.functional.pad(pairs, (0, 0, 0, 0, 0, 0, 0, pad))
    return pairs.unflatten(1, (blocks, kv_block))


def as_keys_values(buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, kv_block, B, 2, H, D] -> K and V views [B, n * kv_block, H, D] (no copy)."""
    flat = buffer.flatten(0, 1).movedim(1, 0)  # [B, n * kv_block, 2, H, D]
    return flat[:, :, 0], flat[:, :, 1]


def exchange(
    send: torch.Tensor, send_counts: list[int], recv_counts: list[int], group
) -> tuple[torch.Tensor, dist.Work | None]:
    """Start the all-to-all of whole blocks ([n, ...], n split by rank): returns the receive
    buffer and the work to wait on (None when nothing moves anywhere but here)."""
    recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
    if sum(send_counts) == 0 and sum(recv_counts) == 0 and len(send_counts) == 1:
        return recv, None
    work = dist.all_to_all_single(
        recv, send.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts,
        group=group, async_op=True,
    )  # fmt: skip
    return recv, work


def all_gather_blocks(
    own: torch.Tensor, counts: list[int], group
) -> tuple[torch.Tensor, dist.Work]:
    """Start the all-gather of every rank's own blocks ([n_own, ...], counts[t] on rank t,
    padded to the longest): returns the [w, longest, ...] buffer and the work to wait on."""
    longest = max(counts)
    padded = own.new_zeros((longest, *own.shape[1:]))
    padded[: own.shape[0]] = own
    gathered = own.new_empty((len(counts) * longest, *own.shape[1:]))  # rank-major
    work = dist.all_gather_into_tensor(gathered, padded, group=group, async_op=True)
    return gathered.unflatten(0, (len(counts), longest)), work


def other_ranks_blocks(gathered: torch.Tensor, counts: list[int], rank: int) -> torch.Tensor:
    """[sum of the other ranks' counts, ...]: all_gather_blocks' buffer without padding and
    without this rank's own blocks, by source rank (RankExchange's received order with
    every_block)."""
    parts = [gathered[t, :count] for t, count in enumerate(counts) if t != rank]
    return torch.cat(parts) if parts else gathered[rank, :0]


class _GatherSequence(torch.autograd.Function):
    """Every rank's shard, padded to the longest, as one [w, B, longest, ...] (all_gather);
    the backward sends each rank the gradients of its shard from every rank (one
    all_to_all_single) and sums them in rank order, in fp32: a reduce-scatter that gloo
    runs too, deterministic."""

    @staticmethod
    def forward(ctx, padded, world_size, group):
        parts = [torch.empty_like(padded) for _ in range(world_size)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        ctx.group = group
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        received = torch.empty_like(grad)
        dist.all_to_all_single(received, grad.contiguous(), group=ctx.group)
        return received.float().sum(0).to(grad.dtype), None, None


def gather_sequence(shard: torch.Tensor, plan: CpPlan, group) -> torch.Tensor:
    """The whole [B, S, ...] in global order from every rank's shard [B, S_local, ...]
    (one all_gather of shards padded to the longest). Differentiable: a shard's gradient is
    the sum over ranks of the gradients of its tokens."""
    tokens = [plan.token_index(rank).numel() for rank in range(plan.world_size)]
    pad = max(tokens) - shard.shape[1]
    padded = torch.cat([shard, shard.new_zeros((shard.shape[0], pad, *shard.shape[2:]))], 1)
    parts = _GatherSequence.apply(padded, plan.world_size, group)  # [w, B, longest, ...]
    whole = torch.cat([part[:, :count] for part, count in zip(parts, tokens, strict=True)], 1)
    return whole[:, plan.gather_index()]


class _SumAcrossRanks(torch.autograd.Function):
    """all_reduce(SUM) forward; the backward passes each rank's gradient through unchanged:
    every rank holds the same total and backpropagates its own copy, which reaches that
    rank's terms once."""

    @staticmethod
    def forward(ctx, value, group):
        total = value.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def sum_across_ranks(value: torch.Tensor, group) -> torch.Tensor:
    """The sum over the group's ranks of a tensor, the same on every rank (differentiable:
    see _SumAcrossRanks)."""
    return _SumAcrossRanks.apply(value, group)
