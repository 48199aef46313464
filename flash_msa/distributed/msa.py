"""MiniMax Sparse Attention with the sequence sharded across ranks (context parallelism).

Scoring reads every earlier proxy key, so proxy keys are all-gathered; each rank scores its
own query blocks against them (dense causal over the proxy heads, no gradient) and selects
locally. K and V are all-gathered too (selections of different rows reach anywhere before
them), the main attention runs over the rank's selected blocks, and each rank adds its KL
terms; one all_reduce gives every rank the global mean. Gradients of the gathered proxy
keys, keys and values go back to their owners summed over ranks (the all-gather's adjoint).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from flash_msa import _env, patterns
from flash_msa.distributed import comm
from flash_msa.distributed.plan import CpPlan, check_plan
from flash_msa.layout import BlockLayout, BlockPositions
from flash_msa.msa.block_scores import block_scores
from flash_msa.msa.interface import GRANULARITIES, MsaSelection, check_msa_inputs, kept_blocks
from flash_msa.msa.kl import checked_kl_loss
from flash_msa.msa.token_selection import select_tokens, token_selection_layout
from flash_msa.ops.interface import block_sparse_attn_func, check_softmax_scale
from flash_msa.sequences import check_cu_seqlens, document_ids_of


def _check_plan(plan, q_block: int, kv_block: int) -> None:
    check_plan(plan)
    layout = plan.layout
    if (layout.q_block, layout.kv_block) != (q_block, kv_block):
        raise ValueError(
            f"the plan's layout has q_block {layout.q_block} and kv_block {layout.kv_block}, "
            f"but msa_func_cp was given {q_block} and {kv_block}: build the plan from "
            f"patterns.causal(S, q_block={q_block}, kv_block={kv_block})"
        )


def _check_warmup_plan(plan: CpPlan) -> None:
    """Warm-up attends over the plan's layout: each row must hold every causal kv block."""
    gap = plan.causal_gap
    if gap is not None:
        head, row, diagonal = gap
        raise ValueError(
            f"warmup attends over every causal block of the plan's layout, but its row {row} "
            f"(layout head {head}) lacks some of kv blocks 0..{diagonal}: build the plan from "
            f"patterns.causal(S, q_block={plan.layout.q_block}, kv_block={plan.layout.kv_block})"
        )


def _padded_blocks(whole: torch.Tensor, kv_block: int) -> torch.Tensor:
    """[B, S, H, D] zero-padded to whole kv blocks along S."""
    pad = -whole.shape[1] % kv_block
    return torch.nn.functional.pad(whole, (0, 0, 0, 0, 0, pad)) if pad else whole


def _over_buffer(layout: BlockLayout, rows: int) -> BlockLayout:
    """The same blocks over a K/V buffer of `rows` rows (whole kv blocks)."""
    sizes = {name: getattr(layout, name) for name in BlockLayout.SIZES}
    return BlockLayout(
        layout.row_offsets, layout.col_indices, **{**sizes, "seq_len_kv": rows}, validate=False
    )


def _rank_selection(
    plan, q_blocks, q_proxy, k_proxy_all, top_k, scale, document_ids, granularity, score_dtype
) -> MsaSelection:
    """The rank's rows of MSA's selection (no gradient): columns global kv blocks."""
    layout = plan.layout
    seq_len = layout.seq_len_kv
    blocks = dict(q_block=layout.q_block, kv_block=layout.kv_block)
    top_k = kept_blocks(top_k, seq_len, layout.kv_block)
    with torch.no_grad():
        if granularity == "token":
            selected = select_tokens(
                q_proxy, k_proxy_all, top_k=top_k, kv_block=layout.kv_block,
                document_ids=document_ids, q_blocks=q_blocks, q_block=layout.q_block,
                score_dtype=score_dtype,
            )  # fmt: skip
            return MsaSelection(
                *token_selection_layout(
                    selected,
                    seq_len=q_proxy.shape[1],
                    **blocks,
                    seq_len_kv=seq_len,
                    check=False,
                )
            )
        scores = block_scores(
            q_proxy, k_proxy_all, **blocks, proxy_softmax_scale=scale,
            document_ids=document_ids, q_blocks=q_blocks, score_dtype=score_dtype,
        )  # fmt: skip  # [B, H_p, n_local, nk]
        selected = patterns.topk(
            scores, top_k, seq_len_q=q_proxy.shape[1], seq_len_kv=seq_len, **blocks,
            fixed_counts=True, q_blocks=q_blocks,
        )  # fmt: skip
    return MsaSelection(selected, None)


def msa_func_cp(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: CpPlan,
    *,
    group: dist.ProcessGroup | None = None,
    top_k: int = 16,
    q_block: int | None = None,
    kv_block: int = 128,
    softmax_scale: float | None = None,
    proxy_softmax_scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    warmup: bool = False,
    granularity: str = "token",
    score_dtype: torch.dtype | None = None,
):
    """msa_func over a sequence sharded across the ranks of `group`.

    Args:
        q_proxy: [B, S_local, H_p, D_p]; k_proxy: [B, S_local, H_pk, D_p]; q: [B, S_local,
            H_q, D]; k, v: [B, S_local, H_kv, D]: this rank's tokens in
            plan.token_index(rank) order.
        group: as block_sparse_attn_cp's (the same on every rank).
        plan: cp_plan of patterns.causal(S, q_block=q_block, kv_block=kv_block) for the
            group's size ("headtail" balances MSA's scoring, which grows with position);
            for rows of one token (q_block 1) a plan of patterns.causal(S, q_block=1, ...).
        top_k, q_block, kv_block, softmax_scale, proxy_softmax_scale, warmup, granularity,
        score_dtype: as msa_func (q_block None: the plan's).
        cu_seqlens: int32 [N + 1], the documents packed in every row of the whole
            sequence (the same on every rank; ends at S): nothing crosses a document.

    Returns:
        out [B, S_local, H_q, D], this rank's rows of msa_func's output over the whole
        sequence, and kl_loss, the whole sequence's KL mean (the same on every rank).
        Backpropagate kl_loss on every rank: each rank's terms get their gradient there.

    Before anything moves, each rank checks its own arguments and the ranks compare their
    plans, the shapes and dtypes of all five shards, cu_seqlens, the options and whether a
    graph is built (one all_gather of a few integers): an argument that one rank gets wrong,
    or passes otherwise than the rest, raises the same error on every rank, never a hang.

    Examples:
        >>> plan = cp_plan(patterns.causal(S, q_block=16, kv_block=128), world, balance="headtail")
        >>> index = plan.token_index(rank)
        >>> out, kl = msa_func_cp(*(t[:, index] for t in (qp, kp, q, k, v)), plan)
    """
    if q_block is None and isinstance(plan, CpPlan):  # the plan's tiles
        q_block = plan.layout.q_block
    rank = comm.group_rank(group)

    def check() -> tuple[int, list[int]]:
        nonlocal q_block
        q_block = check_msa_inputs(
            q_proxy, k_proxy, q, k, v, top_k, q_block, kv_block, proxy_softmax_scale, None,
            granularity, score_dtype, warmup,
        )  # fmt: skip
        check_softmax_scale("softmax_scale", softmax_scale)
        _check_plan(plan, q_block, kv_block)
        comm.check_group_size(plan, group)
        if warmup:
            _check_warmup_plan(plan)
        refusal = _env.triton_refusal(q.device, q.dtype)
        if refusal is not None:
            reason, error = refusal
            raise error(f"msa_func_cp: {reason}")
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, total_tokens=plan.layout.seq_len_kv, device=q.device)
        scales = torch.tensor([-1.0 if scale is None else scale
                               for scale in (softmax_scale, proxy_softmax_scale)],
                              dtype=torch.float64)  # fmt: skip
        kept = kept_blocks(top_k, plan.layout.seq_len_kv, kv_block)
        return 0, [comm.requires_grad(*shards.values()), comm.fingerprint(cu_seqlens), kept,
                   warmup, GRANULARITIES.index(granularity), score_dtype is not None,
                   comm.fingerprint(scales.view(torch.int64))]  # fmt: skip

    shards = dict(q=q, k=k, v=v, q_proxy=q_proxy, k_proxy=k_proxy)
    settings = ("requires_grad", "cu_seqlens (a fingerprint)", "top_k (blocks kept)", "warmup",
                "granularity (0 token, 1 block)", "score_dtype (0 None, 1 FP8)",
                "softmax scales (a fingerprint)")  # fmt: skip
    comm.agree(plan, rank, group, shards, settings, check)
    seq_len = plan.layout.seq_len_kv
    document_ids = None
    if cu_seqlens is not None:
        ids = document_ids_of(cu_seqlens, check=False)  # checked above, on every rank
        document_ids = ids[None].expand(q.shape[0], -1).contiguous()
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    proxy_scale = (
        1.0 / math.sqrt(q_proxy.shape[-1]) if proxy_softmax_scale is None else proxy_softmax_scale
    )
    q_blocks = plan.query_blocks(rank)
    k_proxy_all, k_all, v_all = (comm.gather_sequence(t, plan, group) for t in (k_proxy, k, v))
    if warmup:
        layout, query_masks = plan.local_layout(rank), None
    else:
        layout, query_masks = _rank_selection(
            plan, q_blocks, q_proxy, k_proxy_all, top_k, proxy_scale, document_ids, granularity,
            score_dtype,
        )  # fmt: skip
    if cu_seqlens is not None and query_masks is None:  # cut blocks that cross a document
        documents = patterns.causal(
            seq_len, q_block=q_block, kv_block=kv_block, device=q.device, cu_seqlens=cu_seqlens
        )
        layout = layout & CpPlan(documents, plan.world_size, plan.block_owners).local_layout(rank)
    positions = BlockPositions(
        q_blocks=q_blocks, kv_blocks=torch.arange(plan.layout.num_kv_blocks, device=q.device),
        seq_len=seq_len,
    )  # fmt: skip
    keys, values = (_padded_blocks(t, kv_block) for t in (k_all, v_all))
    out, lse = block_sparse_attn_func(
        q, keys, values, _over_buffer(layout, keys.shape[1]), causal=True,
        softmax_scale=scale, return_lse=True, document_ids=document_ids, positions=positions,
        query_masks=query_masks,
    )  # fmt: skip
    kl_sum = checked_kl_loss(
        q_proxy, k_proxy_all, q, k_all, lse, layout, softmax_scale=scale,
        proxy_softmax_scale=proxy_scale, document_ids=document_ids, q_blocks=q_blocks,
        query_masks=query_masks, reduction="sum",
    )  # fmt: skip
    terms = q.shape[0] * seq_len * q_proxy.shape[2]  # (batch, token, proxy head)
    return out, comm.sum_across_ranks(kl_sum, group) / terms
