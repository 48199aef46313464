"""Shared construction steps of the pattern builders (no Python loop over rows or blocks)."""

from __future__ import annotations

import math

import torch

from flash_msa.layout import BlockLayout
from flash_msa.sequences import check_cu_seqlens


def square_meta(seq_len: int, block_size: int) -> dict:
    """Metadata of a single-head self-attention layout."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    return dict(seq_len_q=seq_len, seq_len_kv=seq_len, q_block=block_size, kv_block=block_size)


def tokens_to_blocks(name: str, tokens: int, block_size: int) -> int:
    """Blocks spanned by a non-negative token count (rounded up)."""
    if not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"{name} must be a non-negative int number of tokens, got {tokens!r}")
    return math.ceil(tokens / block_size)


def progression_rows(
    start: torch.Tensor, count: torch.Tensor, step: int, meta: dict
) -> BlockLayout:
    """Row r holds blocks start[r], start[r] + step, ... (count[r] of them), ascending.

    start, count: int64 [num_q_blocks]; memory O(nnz).
    """
    count = count.clamp(min=0)
    offsets = torch.zeros(count.numel() + 1, dtype=torch.int64, device=count.device)
    torch.cumsum(count, 0, out=offsets[1:])
    nnz = int(offsets[-1])
    # col = start[r] + step * (entry - offsets[r]): one repeat of a per-row base, in int32.
    base = (start - step * offsets[:-1]).int()
    cols = torch.repeat_interleave(base, count, output_size=nnz)
    cols += step * torch.arange(nnz, dtype=torch.int32, device=count.device)
    return BlockLayout(offsets.int()[None], cols, **meta, validate=False)


def band_rows(lower: torch.Tensor, upper: torch.Tensor, meta: dict) -> BlockLayout:
    """Row r holds the contiguous blocks lower[r]..upper[r] (clipped to the kv range)."""
    num_kv_blocks = math.ceil(meta["seq_len_kv"] / meta["kv_block"])
    lower = lower.clamp(min=0)
    upper = upper.clamp(max=num_kv_blocks - 1)
    return progression_rows(lower, upper - lower + 1, 1, meta)


def query_blocks(meta: dict, device) -> torch.Tensor:
    """int64 [num_q_blocks]: 0, 1, ..."""
    return torch.arange(math.ceil(meta["seq_len_q"] / meta["q_block"]), device=device)


def row_documents(seq_len: int, block_size: int, cu_seqlens, device):
    """Per query block r (int64 [nq] each): its first and last token, the start of the
    document of its first token and the end (exclusive) of the document of its last token.
    Without cu_seqlens the whole sequence is one document."""
    rows = torch.arange(math.ceil(seq_len / block_size), device=device)
    first = rows * block_size
    last = (first + block_size - 1).clamp(max=seq_len - 1)
    if cu_seqlens is None:
        return first, last, torch.zeros_like(first), torch.full_like(first, seq_len)
    check_cu_seqlens(cu_seqlens, total_tokens=seq_len)
    bounds = cu_seqlens.to(device=first.device, dtype=torch.int64)
    first_document = torch.searchsorted(bounds, first, right=True) - 1
    last_document = torch.searchsorted(bounds, last, right=True) - 1
    return first, last, bounds[first_document], bounds[last_document + 1]


def rectangles(
    row_low: torch.Tensor,
    row_high: torch.Tensor,
    col_low: torch.Tensor,
    col_high: torch.Tensor,
    meta: dict,
    causal: bool,
) -> BlockLayout:
    """Union of block rectangles [row_low[k], row_high[k]] x [col_low[k], col_high[k]]
    (int64 [K] each, inclusive); with causal only blocks c <= r."""
    heights = (row_high - row_low + 1).clamp(min=0)
    rect = torch.repeat_interleave(torch.arange(heights.numel(), device=heights.device), heights)
    row = (
        row_low[rect]
        + torch.arange(rect.numel(), device=rect.device)
        - (torch.cumsum(heights, 0) - heights)[rect]
    )  # [R] one row of one rectangle each
    high = torch.minimum(col_high[rect], row) if causal else col_high[rect]
    widths = (high - col_low[rect] + 1).clamp(min=0)
    entry = torch.repeat_interleave(torch.arange(row.numel(), device=row.device), widths)
    col = (
        col_low[rect][entry]
        + torch.arange(entry.numel(), device=entry.device)
        - (torch.cumsum(widths, 0) - widths)[entry]
    )
    num_kv_blocks = math.ceil(meta["seq_len_kv"] / meta["kv_block"])
    return BlockLayout.from_keys(torch.unique(row[entry] * num_kv_blocks + col), **meta)
