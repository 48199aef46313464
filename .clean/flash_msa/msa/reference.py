"""Eager MiniMax Sparse Attention: the ground truth at small sizes.

Everything is dense in S x S; pass float64 tensors for ground truth. Block geometry: query
block b holds positions [b * q_block, min((b + 1) * q_block, S)); its diagonal kv block is
the one holding its last position, (min((b + 1) * q_block, S) - 1) // kv_block, which is also
the last kv block with a causal pair. "Earlier" blocks are those left of the diagonal.
"""

from __future__ import annotations

import math

import torch

from flash_msa.reference import attention_reference, visible


def _proxy_logits(
    q_proxy: torch.Tensor, k_proxy: torch.Tensor, proxy_softmax_scale: float | None
) -> torch.Tensor:
    """Scaled proxy logits [B, H_p, S, S]; proxy head p reads key head p // (H_p / H_pk)."""
    scale = (
        1.0 / math.sqrt(q_proxy.shape[-1]) if proxy_softmax_scale is None else proxy_softmax_scale
    )
    group = q_proxy.shape[2] // k_proxy.shape[2]
    k_proxy = k_proxy.repeat_interleave(group, dim=2)
    return torch.einsum("bihd,bjhd->bhij", q_proxy, k_proxy) * scale


def _causal(seq_len: int, device: torch.device, document_ids=None) -> torch.Tensor:
    """bool [S, S], or [B, 1, S, S] with document_ids [B, S]: causal pairs of one document."""
    positions = torch.arange(seq_len, device=device)
    mask = visible(positions[:, None], positions[None, :], True, (-1, -1))
    if document_ids is None:
        return mask
    return mask & (document_ids[:, None, :, None] == document_ids[:, None, None, :])


def _blocks_to_elements(blocks: torch.Tensor, seq_len: int, q_block: int, kv_block: int):
    """bool [..., nq, nk] -> [..., S, S]."""
    mask = blocks.repeat_interleave(q_block, -2).repeat_interleave(kv_block, -1)
    return mask[..., :seq_len, :seq_len]


def block_scores_reference(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    q_block: int,
    kv_block: int,
    proxy_softmax_scale: float | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """score(b, c) = max over i in block b, j in block c, j <= i (and, with document_ids
    [B, S], of i's document) of the scaled proxy logit; -inf where no such pair.
    q_proxy [B, S, H_p, D_p], k_proxy [B, S, H_pk, D_p] -> [B, H_p, nq, nk] in their dtype."""
    batch, seq_len, heads = q_proxy.shape[:3]
    logits = _proxy_logits(q_proxy, k_proxy, proxy_softmax_scale)
    causal = _causal(seq_len, logits.device, document_ids)
    logits = logits.masked_fill(~causal, float("-inf"))
    num_q_blocks, num_kv_blocks = math.ceil(seq_len / q_block), math.ceil(seq_len / kv_block)
    padded = logits.new_full(
        (batch, heads, num_q_blocks * q_block, num_kv_blocks * kv_block), float("-inf")
    )
    padded[..., :seq_len, :seq_len] = logits
    padded = padded.view(batch, heads, num_q_blocks, q_block, num_kv_blocks, kv_block)
    return padded.amax(dim=(3, 5))


def select_blocks_reference(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """bool [B, H_p, nq, nk]: per row, the diagonal (the last block not scored -inf, as
    block_scores_reference marks them) plus the top_k - 1 highest-scoring earlier blocks,
    all of them when fewer exist; ties to the lower block index. Brute force, row by row."""
    selected = torch.zeros(scores.shape, dtype=torch.bool)
    for index in torch.cartesian_prod(*(torch.arange(n) for n in scores.shape[:-1])).tolist():
        row = scores[tuple(index)].tolist()
        diagonal = max(c for c, value in enumerate(row) if value > float("-inf"))
        earlier = sorted(range(diagonal), key=lambda c: (-row[c], c))[: top_k - 1]
        for c in [diagonal, *earlier]:
            selected[tuple(index) + (c,)] = True
    return selected.to(scores.device)


def select_tokens_reference(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    *,
    top_k: int,
    kv_block: int,
    proxy_softmax_scale: float | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token selection, int32 [B, H_p, S, top_k]: token i keeps its own block i // kv_block
    plus the top_k - 1 other blocks with the highest score, ties to the lower block index,
    where score(i, c) = max over keys j of block c with j <= i (and, with document_ids [B, S],
    of i's document) of the scaled proxy logit; blocks with no such key are never kept. Rows
    ascending, padded at the end with -1. q_proxy [B, S, H_p, D_p], k_proxy [B, S, H_pk, D_p];
    computed in float64."""
    seq_len = q_proxy.shape[1]
    num_kv_blocks = math.ceil(seq_len / kv_block)
    logits = _proxy_logits(q_proxy.double(), k_proxy.double(), proxy_softmax_scale)
    logits = logits.masked_fill(~_causal(seq_len, logits.device, document_ids), float("-inf"))
    padded = logits.new_full((*logits.shape[:-1], num_kv_blocks * kv_block), float("-inf"))
    padded[..., :seq_len] = logits
    scores = padded.unflatten(-1, (num_kv_blocks, kv_block)).amax(-1)  # [B, H_p, S, nk]
    own = torch.arange(seq_len, device=scores.device) // kv_block  # [S]
    blocks = torch.arange(num_kv_blocks, device=scores.device)
    scores = scores.masked_fill(blocks == own[:, None], float("-inf"))  # others only
    # A stable descending sort keeps equal scores in ascending block order.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : top_k - 1]
    others = torch.where(scores.gather(-1, order) > float("-inf"), order, num_kv_blocks)
    own = own.expand(*scores.shape[:-2], seq_len)[..., None]
    kept = torch.cat([others, own], dim=-1).sort(dim=-1).values  # invisible ones (nk) last
    selected = torch.full((*scores.shape[:-1], top_k), -1, dtype=torch.int32, device=kept.device)
    selected[..., : kept.shape[-1]] = kept.masked_fill(kept == num_kv_blocks, -1).int()
    return selected


def msa_reference(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    top_k: int,
    q_block: int,
    kv_block: int,
    softmax_scale: float | None = None,
    proxy_softmax_scale: float | None = None,
    warmup: bool = False,
    document_ids: torch.Tensor | None = None,
    granularity: str = "token",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager MSA, always causal. q [B, S, H_q, D], k/v [B, S, H_kv, D], q_proxy [B, S, H_p, D_p],
    k_proxy [B, S, H_pk, D_p]. Returns out [B, S, H_q, D], kl_loss (scalar) and the main
    attention's element mask bool [B, H_p, S, S] (with warmup: every causal pair).

    Granularity "token": each token's blocks are select_tokens_reference's; "block": each
    query block's are select_blocks_reference's over block_scores_reference. The main
    attention sees the selected blocks (causal inside them); query head h belongs to
    proxy head h // (H_q / H_p). With document_ids [B, S] (non-decreasing) nothing crosses a
    document: blocks with no pair of one document are never selected. kl_loss = mean over
    (batch, i, p) of KL(teacher || student) over the keys i sees: teacher = the main
    probabilities averaged over p's query heads (detached), student = softmax of the proxy
    logits over the same keys. Gradients of kl_loss
    reach q_proxy and k_proxy only; selection is discrete and carries none.
    """
    heads_kv, heads_proxy_keys = k.shape[2], k_proxy.shape[2]
    heads_proxy = q_proxy.shape[2]
    if q.shape[2] % heads_proxy or heads_proxy % heads_kv or heads_proxy % heads_proxy_keys:
        raise ValueError(
            f"need H_q ({q.shape[2]}) a multiple of H_p ({heads_proxy}), and H_p a multiple of "
            f"H_kv ({heads_kv}) and of H_pk ({heads_proxy_keys})"
        )
    if q_block > kv_block:
        raise ValueError(
            f"q_block ({q_block}) must be <= kv_block ({kv_block}): a query block must lie in "
            "its diagonal kv block so every query sees its own key; use q_block <= kv_block"
        )
    batch, seq_len, heads_q = q.shape[:3]
    causal = _causal(seq_len, q.device, document_ids)
    with torch.no_grad():
        if granularity == "token" and not warmup:
            selected = select_tokens_reference(
                q_proxy, k_proxy, top_k=top_k, kv_block=kv_block,
                proxy_softmax_scale=proxy_softmax_scale, document_ids=document_ids,
            ).long()  # fmt: skip  # [B, H_p, S, top_k]
            key_blocks = torch.arange(seq_len, device=q.device) // kv_block  # [S]
            mask = (selected[..., None] == key_blocks).any(-2) & causal  # [B, H_p, S, S]
        else:
            scores = block_scores_reference(
                q_proxy, k_proxy, q_block, kv_block, proxy_softmax_scale, document_ids
            )
            selected = scores > float("-inf")
            if not warmup:
                selected &= select_blocks_reference(scores, top_k)
            mask = _blocks_to_elements(selected, seq_len, q_block, kv_block) & causal
    group = heads_q // heads_proxy
    out, _ = attention_reference(q, k, v, mask.repeat_interleave(group, dim=1), softmax_scale)

    with torch.no_grad():
        scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
        logits = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(heads_q // heads_kv, dim=2))
        logits = logits * scale  # [B, H_q, S, S]
        probs = torch.softmax(logits.masked_fill(~mask.repeat_interleave(group, 1), -math.inf), -1)
        teacher = probs.view(batch, heads_proxy, group, seq_len, seq_len).mean(2)  # [B, H_p, S, S]
    student_logits = _proxy_logits(q_proxy, k_proxy, proxy_softmax_scale)
    log_student = torch.log_softmax(student_logits.masked_fill(~mask, float("-inf")), dim=-1)
    # Where the teacher is 0 (masked keys) the term is 0; where() keeps -inf out of the grads.
    terms = torch.where(
        teacher > 0, teacher * (torch.log(teacher) - log_student), torch.zeros_like(teacher)
    )
    kl_loss = terms.sum(-1).mean()
    return out, kl_loss, mask
