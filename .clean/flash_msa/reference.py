"""Dense attention with an explicit element mask: the ground truth at small sizes."""

from __future__ import annotations

import math

import torch

from flash_msa.layout import BlockLayout


def visible(
    q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window_size: tuple[int, int]
) -> torch.Tensor:
    """Element mask from positions: query i sees key j when j <= i (causal) and
    i - left <= j <= i + right (window_size = (left, right), -1 unbounded).
    Broadcasts q_pos [..., M, 1] against k_pos [..., 1, N]."""
    left, right = window_size
    keep = torch.ones_like(q_pos >= k_pos)
    if causal:
        keep &= k_pos <= q_pos
    if left >= 0:
        keep &= k_pos >= q_pos - left
    if right >= 0:
        keep &= k_pos <= q_pos + right
    return keep


def layout_mask(
    layout: BlockLayout,
    batch: int,
    heads_q: int,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """bool [batch, heads_q, S_q, S_kv]: the layout's active blocks AND the element masks
    (and, with document_ids int [batch, S], only pairs of one document)."""
    blocks = layout.expand(
        batch if layout.layout_batch > 1 else 1, layout.layout_heads
    ).to_dense()  # [L, nq, nk]
    blocks = blocks.view(-1, layout.layout_heads, layout.num_q_blocks, layout.num_kv_blocks)
    blocks = blocks.repeat_interleave(heads_q // layout.layout_heads, dim=1)
    mask = blocks.repeat_interleave(layout.q_block, 2).repeat_interleave(layout.kv_block, 3)
    mask = mask[:, :, : layout.seq_len_q, : layout.seq_len_kv]
    q_pos = torch.arange(layout.seq_len_q, device=layout.device)[:, None]
    k_pos = torch.arange(layout.seq_len_kv, device=layout.device)[None, :]
    mask = (mask & visible(q_pos, k_pos, causal, window_size)).expand(batch, -1, -1, -1)
    if document_ids is not None:
        mask = mask & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
    return mask


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    softmax_scale: float | None = None,
    dropout_keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive masked attention in the inputs' dtype (pass float64 for ground truth).

    q [B, S_q, H_q, D], k/v [B, S_kv, H_kv, D], mask bool broadcastable to
    [B, H_q, S_q, S_kv]; dropout_keep (bool, same shape) drops the probabilities it marks
    False and scales the rest by 1 / (1 - dropout_p). Returns out [B, S_q, H_q, D] (zeros
    where a query sees nothing) and lse [B, H_q, S_q] (fp32; fp64 for float64 inputs; natural
    log; -inf where it sees nothing)."""
    group = q.shape[2] // k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, S_q]
    probs = torch.exp(scores - lse[..., None].masked_fill(lse[..., None] == float("-inf"), 0))
    if dropout_keep is not None:
        probs = probs * dropout_keep / (1.0 - dropout_p)
    out = torch.einsum("bhij,bjhd->bihd", probs, v)
    return out, lse.to(torch.promote_types(lse.dtype, torch.float32))
