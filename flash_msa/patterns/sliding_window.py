"""Sliding-window (local) layout."""

from __future__ import annotations

import torch

from flash_msa.layout import BlockLayout
from flash_msa.patterns._build import band_rows, row_documents, square_meta, tokens_to_blocks


def window_bounds(
    seq_len: int, window: int, causal: bool, block_size: int, device, cu_seqlens=None
):
    """First and last kv block of each query block holding keys j of the same document
    with i - window <= j <= i (+ window when not causal), int64 [nq] each."""
    tokens_to_blocks("window", window, block_size)
    square_meta(seq_len, block_size)
    first, last, start, end = row_documents(seq_len, block_size, cu_seqlens, device)
    lower = torch.maximum(first - window, start) // block_size
    upper = first // block_size if causal else torch.minimum(last + window, end - 1) // block_size
    return lower, upper


def sliding_window(
    seq_len: int,
    window: int,
    *,
    causal: bool = True,
    block_size: int = 128,
    device=None,
    cu_seqlens=None,
) -> BlockLayout:
    """Blocks holding the pairs with i - window <= j <= i (causal) or |i - j| <= window;
    with cu_seqlens (int32 [N + 1] over seq_len packed tokens) only pairs of one document.

    Matches window_size=(window, 0) (causal) or (window, window) in the attention call;
    without window_size the whole blocks are attended.
    """
    lower, upper = window_bounds(seq_len, window, causal, block_size, device, cu_seqlens)
    return band_rows(lower, upper, square_meta(seq_len, block_size))
