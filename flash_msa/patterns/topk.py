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
    if bool(torch.isnan(block_scores).any()):
        raise ValueError(
            "block_scores contains NaN; replace it (e.g. with -inf to exclude a block)"
        )
    scores = block_scores.to(device) if device is not None else block_scores
    num_q_blocks, num_kv_blocks = scores.shape[-2:]
    row = torch.arange(num_q_blocks, device=scores.device)[:, None]
    col = torch.arange(num_kv_blocks, device=scores.device)[None, :]
    if causal:
        scores = scores.masked_fill(col > row, float("-inf"))
    if include_diagonal:
        scores = scores.masked_fill(col == row, float("inf"))
    picks = min(k, num_kv_blocks)
    threshold = scores.topk(picks, dim=-1).values[..., -1:]  # [..., nq, 1]
    above = scores > threshold
    tied = scores == threshold
    room = picks - above.sum(dim=-1, keepdim=True)  # ties still to take, lowest index first
    keep = (above | (tied & (tied.cumsum(dim=-1) <= room))) & (scores > float("-inf"))
    return BlockLayout.from_keys(keep.flatten().nonzero().squeeze(1), **meta)
