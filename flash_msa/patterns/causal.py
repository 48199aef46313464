"""Causal layout: every block on or below the diagonal."""

from __future__ import annotations

from flash_msa.layout import BlockLayout
from flash_msa.patterns._build import band_rows, square_meta
from flash_msa.patterns.sliding_window import window_bounds


def causal(seq_len: int, *, block_size: int = 128, device=None, cu_seqlens=None) -> BlockLayout:
    """Blocks (r, c) with c <= r: pair with causal=True in the attention call. With
    cu_seqlens (int32 [N + 1] over seq_len packed tokens) only blocks within a document."""
    lower, upper = window_bounds(seq_len, seq_len, True, block_size, device, cu_seqlens)
    return band_rows(lower, upper, square_meta(seq_len, block_size))
