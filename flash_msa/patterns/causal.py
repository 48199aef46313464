"""Causal layout: every block on or below the diagonal."""

from __future__ import annotations

from flash_msa.layout import BlockLayout
from flash_msa.patterns._build import band_rows, query_blocks, square_meta


def causal(seq_len: int, *, block_size: int = 128, device=None) -> BlockLayout:
    """Blocks (r, c) with c <= r: pair with causal=True in the attention call."""
    meta = square_meta(seq_len, block_size)
    rows = query_blocks(meta, device)
    return band_rows(rows * 0, rows, meta)
