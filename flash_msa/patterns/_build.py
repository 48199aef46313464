"""Shared construction steps of the pattern builders (no Python loop over rows or blocks)."""

from __future__ import annotations

import math

import torch

from flash_msa.layout import BlockLayout


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
