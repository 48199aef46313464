"""The block-sparse op in plain PyTorch: gather each row's active K/V blocks, mask, softmax.

Differentiable by autograd, any device, memory bounded by a chunk of query blocks
(never S x S). The CPU backend, and the reference where the dense one cannot run.
"""

from __future__ import annotations

import torch

from flash_msa.layout import BlockLayout
from flash_msa.reference import visible

SCORE_BUDGET = 1 << 24  # score elements per chunk of query blocks (64 MiB in fp32)


def layout_slices(layout: BlockLayout, heads_q: int):
    """For each layout index l, the (batch slice, query-head slice) it serves."""
    group_size = heads_q // layout.layout_heads
    for index in range(layout.num_layouts):
        layout_b, layout_h = divmod(index, layout.layout_heads)
        batches = slice(None) if layout.layout_batch == 1 else slice(layout_b, layout_b + 1)
        heads = slice(layout_h * group_size, (layout_h + 1) * group_size)
        yield index, batches, heads


def _row_attention(
    q, k, v, layout, index, rows, *, causal, window_size, scale, documents=None, dropout_p=0.0
):
    """Attention of query blocks `rows` (int64 [R]) of layout `index`.

    q [b, S_q, h, D]; k, v [b, S_kv, h, D] (already one kv head per query head);
    documents: int [b, S] document ids (keys of another document are not seen) or None;
    dropout_p: probabilities dropped with PyTorch's generator (a different stream from the
    Triton kernels' Philox bits), the kept ones scaled by 1 / (1 - dropout_p).
    Returns out [b, R * q_block, h, D] and lse [b, h, R * q_block] (padded tail included).
    """
    offsets = layout.row_offsets[index].long()
    starts, counts = offsets[rows], offsets[rows + 1] - offsets[rows]  # [R]
    width = max(int(counts.max()), 1)
    slot = torch.arange(width, device=q.device)
    active = slot[None, :] < counts[:, None]  # [R, m]
    entry = (starts[:, None] + slot[None, :]).clamp(max=max(layout.nnz - 1, 0))
    cols = torch.where(active, layout.col_indices[entry].long(), 0)  # [R, m]

    within_kv = torch.arange(layout.kv_block, device=q.device)
    k_pos = (cols[:, :, None] * layout.kv_block + within_kv).flatten(1)  # [R, m * kv_block]
    k_ok = active.repeat_interleave(layout.kv_block, 1) & (k_pos < layout.seq_len_kv)
    k_pos = k_pos.clamp(max=layout.seq_len_kv - 1)
    q_pos = rows[:, None] * layout.q_block + torch.arange(layout.q_block, device=q.device)
    q_pos = q_pos.clamp(max=layout.seq_len_q - 1)  # [R, q_block]; padded rows are cut later

    q_rows = q[:, q_pos]  # [b, R, q_block, h, D]
    k_rows, v_rows = k[:, k_pos], v[:, k_pos]  # [b, R, m * kv_block, h, D]
    accumulate = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for ground truth
    scores = torch.einsum("brihd,brjhd->bhrij", q_rows, k_rows).to(accumulate) * scale
    keep = k_ok[:, None, :] & visible(q_pos[:, :, None], k_pos[:, None, :], causal, window_size)
    keep = keep[None]  # [1 or b, R, q_block, m * kv_block]
    if documents is not None:
        keep = keep & (documents[:, q_pos][..., None] == documents[:, k_pos][:, :, None, :])
    scores = scores.masked_fill(~keep[:, None], float("-inf"))  # [b, h, R, q_block, m * kv_block]
    lse = torch.logsumexp(scores, dim=-1)  # [b, h, R, q_block]
    finite_lse = torch.where(torch.isinf(lse), 0.0, lse)
    probs = torch.exp(scores - finite_lse[..., None])
    if dropout_p > 0:
        probs = probs * (torch.rand_like(probs) >= dropout_p) / (1.0 - dropout_p)
    out = torch.einsum("bhrij,brjhd->brihd", probs.to(v.dtype), v_rows)
    return out.flatten(1, 2), lse.flatten(2).float()


def block_sparse_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    *,
    causal: bool,
    window_size: tuple[int, int],
    softmax_scale: float,
    document_ids: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, S_q, H_q, D] and lse fp32 [B, H_q, S_q] for validated inputs; document_ids
    int [B, S] keeps attention within documents; dropout_p drops probabilities."""
    batch, seq_len_q, heads_q, _ = q.shape
    heads_kv = k.shape[2]
    kv_head_of = torch.arange(heads_q, device=q.device) // (heads_q // heads_kv)
    out = q.new_zeros(q.shape)
    lse = torch.full((batch, heads_q, seq_len_q), float("-inf"), device=q.device)
    for index, batches, heads in layout_slices(layout, heads_q):
        q_part = q[batches, :, heads]
        kv_heads = kv_head_of[heads]
        k_part, v_part = k[batches][:, :, kv_heads], v[batches][:, :, kv_heads]
        counts = layout.row_counts()[
            index * layout.num_q_blocks : (index + 1) * layout.num_q_blocks
        ]
        width = max(int(counts.max()), 1) if counts.numel() else 1
        per_row = q_part.shape[0] * q_part.shape[2] * layout.q_block * width * layout.kv_block
        chunk = max(1, SCORE_BUDGET // per_row)
        rows = torch.arange(layout.num_q_blocks, device=q.device)
        pieces = [
            _row_attention(
                q_part,
                k_part,
                v_part,
                layout,
                index,
                part,
                causal=causal,
                window_size=window_size,
                scale=softmax_scale,
                documents=None if document_ids is None else document_ids[batches],
                dropout_p=dropout_p,
            )
            for part in rows.split(chunk)
        ]
        out[batches, :, heads] = torch.cat([p[0] for p in pieces], 1)[:, :seq_len_q]
        lse[batches, heads] = torch.cat([p[1] for p in pieces], 2)[..., :seq_len_q]
    return out, lse
