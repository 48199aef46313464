"""Top-k layout from block scores (learned or heuristic selection)."""

from __future__ import annotations

import torch

from flash_msa.layout import BlockLayout
from flash_msa.patterns.from_dense_mask import block_grid_meta


def topk(
    block_scores: torch.Tensor,
    k: int,
    *,
    seq_len_q: int,
    seq_len_kv: int | None = None,
    include_diagonal: bool = True,
    causal: bool = True,
    block_size: int = 128,
    device=None,
) -> BlockLayout:
    """The k highest-scoring blocks of each row of block_scores [..., nq, nk] (ties to
    the lower block index). Blocks scored -inf, and with causal those right of the
    diagonal, are never chosen; include_diagonal keeps block (r, r) as one of the k."""
    meta = block_grid_meta(block_scores, "block_scores", seq_len_q, seq_len_kv, block_size)
    if not block_scores.is_floating_point():
        raise TypeError(f"block_scores must be floating point, got {block_scores.dtype}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    scores = block_scores.to(device) if device is not None else block_scores
    num_q_blocks, num_kv_blocks = scores.shape[-2:]
    row = torch.arange(num_q_blocks, device=scores.device)[:, None]
    col = torch.arange(num_kv_blocks, device=scores.device)[None, :]
    scores = scores.masked_fill(col > row, float("-inf")) if causal else scores.clone()
    if include_diagonal:
        scores.diagonal(dim1=-2, dim2=-1).fill_(float("inf"))
    picks = min(k, num_kv_blocks)
    # One more than asked: a tie between the last kept and the first dropped means topk's
    # arbitrary tie order decided, and that row takes its lowest-index ties instead.
    values, chosen = scores.topk(min(picks + 1, num_kv_blocks), dim=-1)  # [..., nq, picks(+1)]
    if bool(torch.isnan(values).any()):  # topk ranks NaN first: any NaN that counts is here
        raise ValueError(
            "block_scores contains NaN; replace it (e.g. with -inf to exclude a block)"
        )
    uneven = values[..., -1] == values[..., picks - 1] if picks < num_kv_blocks else None
    values, chosen = values[..., :picks], chosen[..., :picks]
    threshold = values[..., -1:]
    if uneven is not None and bool(uneven.any()):
        rows = scores[uneven]  # [U, nk]
        above, ties = rows > threshold[uneven], rows == threshold[uneven]
        room = picks - above.sum(-1, keepdim=True)
        keep = above | (ties & (ties.cumsum(-1) <= room))
        chosen[uneven] = keep.int().topk(picks, dim=-1, sorted=True).indices.sort(-1).values
        values[uneven] = rows.gather(-1, chosen[uneven])
    chosen = torch.where(values > float("-inf"), chosen, num_kv_blocks).sort(-1).values
    flat_rows = torch.arange(chosen[..., 0].numel(), device=scores.device).view(chosen.shape[:-1])
    keys = flat_rows[..., None] * num_kv_blocks + chosen  # [..., nq, picks]
    return BlockLayout.from_keys(keys[chosen < num_kv_blocks], **meta)
