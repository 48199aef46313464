"""Sliding-window (local) layout."""

from __future__ import annotations

import torch

from flash_msa.layout import BlockLayout, layout_device
from flash_msa.patterns._build import (
    band_rows,
    check_flags,
    layout_meta,
    row_documents,
    tokens_to_blocks,
)


def window_bounds(meta: dict, window: int, causal: bool, device, cu_seqlens=None):
    """First and last kv block of each query block holding keys j of the same document
    with i - window <= j <= i (+ window when not causal), int64 [nq] each."""
    tokens_to_blocks("window", window, meta["kv_block"])
    window = min(window, meta["seq_len_q"])  # a longer window sees no more (and fits int64)
    first, last, start, end = row_documents(meta, cu_seqlens, device)
    lower = torch.maximum(first - window, start) // meta["kv_block"]
    upper = last if causal else torch.minimum(last + window, end - 1)
    return lower, upper // meta["kv_block"]


def sliding_window(
    seq_len: int,
    window: int,
    *,
    causal: bool = True,
    block_size: int = 128,
    q_block: int | None = None,
    kv_block: int | None = None,
    device=None,
    cu_seqlens=None,
) -> BlockLayout:
    """Blocks holding the pairs with i - window <= j <= i (causal) or |i - j| <= window;
    with cu_seqlens only pairs of one document.

    Matches window_size=(window, 0) (causal) or (window, window) in the attention call;
    without window_size the whole blocks are attended.

    Args:
        seq_len: tokens of queries and keys.
        window: tokens a query sees on each side it looks (windows past seq_len see it all).
        block_size: q_block and kv_block when they are not given.
        cu_seqlens: int32 [N + 1] documents packed over the seq_len tokens, or None.

    Returns:
        A single-head BlockLayout.
    """
    check_flags(causal=causal)
    device = layout_device(device)
    meta = layout_meta(seq_len, None, block_size, q_block, kv_block)
    lower, upper = window_bounds(meta, window, causal, device, cu_seqlens)
    return band_rows(lower, upper, meta)
