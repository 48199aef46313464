"""Block-sparse attention with the sequence sharded across ranks (context parallelism).

Each rank holds the query, key and value tokens of its plan shard. The forward sends every
rank exactly the K/V blocks its rows read (one all_to_all_single with the plan's static
splits), computes its rows over its own blocks while the exchange is in flight, then over
the received blocks, and merges the two by their log-sum-exp. The backward runs both parts
again with the merged output and lse (as FlashAttention's backward does for any split of
the keys), sends the dK/dV of received blocks back to their owners in fp32 (fp64 for
float64 inputs) while it computes the local part, and adds them there. The received K/V is
kept from the forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flash_msa.distributed import comm
from flash_msa.distributed.plan import CpPlan, RankExchange, check_plan
from flash_msa.layout import BlockLayout, BlockPositions
from flash_msa.ops import registry
from flash_msa.ops.custom_op import sparse_attention, sparse_attention_backward
from flash_msa.ops.interface import check_layout_heads, check_options, check_tensors
from flash_msa.sequences import check_document_ids

COLLECTIVES = ("all_to_all", "allgather")
# What every rank must pass alike besides the plan and the shards' shapes, as the agreement
# names it.
SETTINGS = ("collective (0 all_to_all, 1 allgather)", "dropout_p > 0", "requires_grad",
            "document_ids (a fingerprint)")  # fmt: skip


@dataclass(frozen=True)
class _Call:
    """What both parts of one rank's attention share."""

    plan: CpPlan
    rank: int
    group: dist.ProcessGroup | None
    backend: str
    causal: bool
    window_size: tuple[int, int]
    softmax_scale: float
    document_ids: torch.Tensor | None
    dropout_p: float
    dropout_seed: int
    collective: str  # "all_to_all" (the blocks rows read) or "allgather" (every block)

    def exchange(self) -> RankExchange:
        return self.plan.exchange(self.rank, every_block=self.collective == "allgather")

    def options(self, layout: BlockLayout, kv_blocks: torch.Tensor) -> dict:
        positions = BlockPositions(
            q_blocks=self.plan.query_blocks(self.rank), kv_blocks=kv_blocks,
            seq_len=self.plan.layout.seq_len_kv,
        )  # fmt: skip
        return dict(
            layout=layout, backend=self.backend, causal=self.causal,
            window_size=self.window_size, softmax_scale=self.softmax_scale,
            document_ids=self.document_ids, dropout_p=self.dropout_p,
            dropout_seed=self.dropout_seed, positions=positions,
        )  # fmt: skip


def _padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """[B, S, H, D] zero-padded to `rows` along S (the plan's ragged last block)."""
    pad = rows - tensor.shape[1]
    return torch.nn.functional.pad(tensor, (0, 0, 0, 0, 0, pad)) if pad else tensor


def _wide(dtype: torch.dtype) -> torch.dtype:
    """Where partial results add up: fp32, fp64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _merge(out_a, lse_a, out_b, lse_b):
    """Softmax over the union of two disjoint key sets from each set's (out, lse):
    out [B, S, H, D], lse [B, H, S] (-inf where a set is empty)."""
    lse = torch.logaddexp(lse_a, lse_b)  # [B, H, S]
    finite = torch.isfinite(lse)

    def weight(part):  # [B, S, H, 1]
        return torch.where(finite, torch.exp(part - lse), 0.0).transpose(1, 2)[..., None]

    wide = _wide(out_a.dtype)
    out = out_a.to(wide) * weight(lse_a) + out_b.to(wide) * weight(lse_b)
    return out.to(out_a.dtype), lse


def _blocks_buffer(k_own, v_own, kv_block: int, slots: torch.Tensor | None = None):
    """K/V of the own slots `slots` (all of them when None) as [n, kv_block, B, 2, H, D],
    the exchanges' layout."""
    pairs = [t.unflatten(1, (-1, kv_block)) for t in (k_own, v_own)]  # [B, n_own, kv_block, ...]
    if slots is not None:
        pairs = [t[:, slots] for t in pairs]
    return torch.stack(pairs, dim=3).permute(1, 2, 0, 3, 4, 5)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call: _Call):
        exchange = call.exchange()
        kv_block = call.plan.layout.kv_block
        rows = exchange.own_blocks.numel() * kv_block
        k_own, v_own = _padded(k, rows), _padded(v, rows)  # [B, n_own * kv_block, H_kv, D]
        if call.collective == "allgather":
            counts = torch.bincount(call.plan.block_owners, minlength=call.plan.world_size)
            counts = counts.tolist()
            own = _blocks_buffer(k_own, v_own, kv_block)
            gathered, work = comm.all_gather_blocks(own, counts, call.group)
        else:
            send = _blocks_buffer(k_own, v_own, kv_block, exchange.send_slots)
            recv, work = comm.exchange(send, exchange.send_counts, exchange.recv_counts,
                                       call.group)  # fmt: skip
        local = call.options(exchange.local, exchange.own_blocks)
        out, lse = sparse_attention(q, k_own, v_own, **local)
        if work is not None:
            work.wait()
        if call.collective == "allgather":
            recv = comm.other_ranks_blocks(gathered, counts, call.rank)
        if exchange.remote is not None:
            k_recv, v_recv = comm.as_keys_values(recv)  # [B, n_recv * kv_block, H_kv, D]
            remote = call.options(exchange.remote, exchange.recv_blocks)
            out, lse = _merge(out, lse, *sparse_attention(q, k_recv, v_recv, **remote))
        ctx.save_for_backward(q, k_own, v_own, recv, out, lse)
        ctx.call, ctx.seq_len = call, k.shape[1]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_lse):
        q, k_own, v_own, recv, out, lse = ctx.saved_tensors
        call: _Call = ctx.call
        exchange = call.exchange()
        wide = _wide(q.dtype)  # dQ and the dK/dV partials add up in it
        grad_q = torch.zeros(q.shape, dtype=wide, device=q.device)
        # Remote part first, so that its dK/dV travel while the local part computes.
        back = recv.new_zeros(recv.shape, dtype=wide)  # [n_recv, kv_block, B, 2, H, D]
        if exchange.remote is not None:
            k_recv, v_recv = comm.as_keys_values(recv)
            remote = call.options(exchange.remote, exchange.recv_blocks)
            dq, dk, dv = sparse_attention_backward(grad_out, q, k_recv, v_recv, out, lse, **remote)
            grad_q += dq
            back = torch.stack([dk, dv], dim=2).unflatten(1, (-1, recv.shape[1]))
            back = back.permute(1, 2, 0, 3, 4, 5).to(wide)  # [n_recv, kv_block, B, 2, H, D]
        partials, work = comm.exchange(back, exchange.recv_counts, exchange.send_counts,
                                       call.group)  # fmt: skip
        local = call.options(exchange.local, exchange.own_blocks)
        dq, dk, dv = sparse_attention_backward(grad_out, q, k_own, v_own, out, lse, **local)
        grad_q += dq
        kv_block = call.plan.layout.kv_block
        grads = torch.stack([dk, dv], dim=2).to(wide).unflatten(1, (-1, kv_block))
        if work is not None:
            work.wait()
        # [B, n_own, kv_block, 2, H, D] += each destination's partials in turn: a block
        # several ranks read gets their sums in rank order (deterministic, no atomics).
        partials = partials.permute(2, 0, 1, 3, 4, 5)  # [B, n_send, kv_block, 2, H, D]
        first = 0
        for count in exchange.send_counts:
            slots = exchange.send_slots[first : first + count]
            grads[:, slots] += partials[:, first : first + count]
            first += count
        grads = grads.flatten(1, 2)[:, : ctx.seq_len]  # [B, S_local, 2, H, D]
        grad_k, grad_v = grads[:, :, 0].to(k_own.dtype), grads[:, :, 1].to(v_own.dtype)
        return grad_q.to(q.dtype), grad_k, grad_v, None


def _attention_call(q, k, plan, rank, dropout_p, document_ids, causal, window_size,
                    collective) -> registry.AttentionCall:  # fmt: skip
    """What the backend registry chooses by: the rank's local part of the attention."""
    exchange = plan.exchange(rank, every_block=collective == "allgather")
    return registry.AttentionCall(
        device=q.device, dtype=q.dtype, head_dim=q.shape[-1], q_block=plan.layout.q_block,
        kv_block=plan.layout.kv_block, dropout=dropout_p > 0,
        documents=document_ids is not None, deterministic=False,
        element_masks=causal or max(window_size) >= 0, seq_len_q=q.shape[1],
        seq_len_kv=exchange.own_blocks.numel() * plan.layout.kv_block, batch=q.shape[0],
        heads_q=q.shape[2], heads_kv=k.shape[2], layout_heads=plan.layout.layout_heads,
        positions=True,
    )  # fmt: skip


def block_sparse_attn_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: CpPlan,
    *,
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
    document_ids: torch.Tensor | None = None,
    collective: str = "all_to_all",
):
    """Block-sparse attention of one sequence sharded across the ranks of `group`.

    Every rank calls it with its shards; the result on each rank is its rows of
    block_sparse_attn_func over the whole sequence and plan.layout.

    Args:
        q: [B, S_local, H_q, D]; k, v: [B, S_local, H_kv, D]: this rank's tokens, in
            plan.token_index(rank) order (x[:, plan.token_index(rank)] of the whole).
        plan: a CpPlan of the global layout for the group's size (cp_plan).
        group: the process group of the sequence's ranks (default: the world), the same on
            every rank (all None, or all the result of one new_group call): the ranks'
            checks run on it, so ranks passing different groups wait on each other.
        causal, window_size, softmax_scale, dropout_p, backend: as block_sparse_attn_func
            (positions are global; dropout draws the bits one process would).
        return_lse: also return lse fp32 [B, H_q, S_local].
        document_ids: int [B, S] over the whole sequence (the same on every rank), e.g.
            flash_msa.sequences.document_ids_of(cu_seqlens)[None].
        collective: "all_to_all" sends each rank exactly the K/V blocks its rows read;
            "allgather" brings every rank all of the others' blocks (one all_gather: for
            dense layouts, whose rows read nearly everything). dK/dV of received blocks go
            back by one all_to_all either way.

    Returns:
        out [B, S_local, H_q, D] (and lse): this rank's rows. Gradients reach q, k, v of
        this rank's shards.

    Before anything moves, each rank checks its own arguments and the ranks compare their
    plans, shards, collective, whether dropout is on and whether a graph is built (one
    all_gather of a few integers): an argument that one rank gets wrong, or passes otherwise
    than the rest, raises the same error on every rank, never a hang; document_ids are
    compared too. causal, window_size and softmax_scale are each rank's own.

    Examples:
        >>> plan = cp_plan(layout, dist.get_world_size())
        >>> index = plan.token_index(dist.get_rank())
        >>> out = block_sparse_attn_cp(q[:, index], k[:, index], v[:, index], plan, causal=True)
    """
    rank = comm.group_rank(group)
    chosen_backend = None

    def check() -> tuple[int, list[int]]:
        """This rank's checks and its backend; returns its dropout seed (rank 0's is every
        rank's: the bits match one process's) and its SETTINGS."""
        nonlocal chosen_backend
        check_plan(plan)
        comm.check_group_size(plan, group)
        if collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
        check_tensors(q, k, v)
        check_options(causal, window_size, softmax_scale, dropout_p, False, return_lse)
        check_layout_heads(plan.layout, q.shape[0], q.shape[2], k.shape[2])
        if plan.layout.device != q.device:
            raise ValueError(
                f"the plan's layout is on {plan.layout.device} but q on {q.device}: build the "
                "plan from a layout on the shards' device"
            )
        if document_ids is not None:
            check_document_ids(document_ids, q.shape[0], plan.layout.seq_len_kv, q.device)
        local = _attention_call(q, k, plan, rank, dropout_p, document_ids, causal, window_size,
                                collective)  # fmt: skip
        chosen_backend = registry.select(local, backend).name
        seed = int(torch.randint(2**31 - 1, ())) if dropout_p > 0 else 0
        settings = [COLLECTIVES.index(collective), dropout_p > 0, comm.requires_grad(q, k, v),
                    comm.fingerprint(document_ids)]  # fmt: skip
        return seed, settings

    seeds = comm.agree(plan, rank, group, dict(q=q, k=k, v=v), SETTINGS, check)
    if document_ids is not None:
        document_ids = document_ids.to(torch.int32).contiguous()
    longest = plan.layout.seq_len_kv
    call = _Call(
        plan=plan, rank=rank, group=group, backend=chosen_backend,
        causal=causal, window_size=tuple(min(side, longest) for side in window_size),
        softmax_scale=1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None
        else float(softmax_scale),
        document_ids=document_ids, dropout_p=float(dropout_p), dropout_seed=seeds[0],
        collective=collective,
    )  # fmt: skip
    out, lse = _ContextParallelAttention.apply(q, k, v, call)
    return (out, lse) if return_lse else out
