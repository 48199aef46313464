"""Sliding-window (local) layout."""

from __future__ import annotations

from flash_msa.layout import BlockLayout
from flash_msa.patterns._build import band_rows, query_blocks, square_meta, tokens_to_blocks


def window_bounds(seq_len: int, window: int, causal: bool, block_size: int, device):
    """First and last kv block of each query block whose tokens lie within `window`
    tokens: keys j with i - window <= j <= i (+ window when not causal)."""
    tokens_to_blocks("window", window, block_size)
    rows = query_blocks(square_meta(seq_len, block_size), device)
    lower = (rows * block_size - window).clamp(min=0) // block_size
    upper = rows if causal else (rows * block_size + block_size - 1 + window) // block_size
    return lower, upper


def sliding_window(
    seq_len: int, window: int, *, causal: bool = True, block_size: int = 128, device=None
) -> BlockLayout:
    """Blocks holding the pairs with i - window <= j <= i (causal) or |i - j| <= window.

    Matches window_size=(window, 0) (causal) or (window, window) in the attention call;
    without window_size the whole blocks are attended.
    """
    lower, upper = window_bounds(seq_len, window, causal, block_size, device)
    return band_rows(lower, upper, square_meta(seq_len, block_size))
