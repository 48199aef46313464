"""Dilated (strided) layout: every dilation-th block within a window."""

from __future__ import annotations

from flash_msa.layout import BlockLayout
from flash_msa.patterns._build import progression_rows, query_blocks, square_meta
from flash_msa.patterns.sliding_window import window_bounds


def dilated(
    seq_len: int,
    window: int,
    dilation: int,
    *,
    causal: bool = True,
    block_size: int = 128,
    device=None,
) -> BlockLayout:
    """Blocks c within the sliding window of row r (see sliding_window) whose distance
    from the diagonal is a multiple of dilation: (r - c) % dilation == 0."""
    if not isinstance(dilation, int) or dilation < 1:
        raise ValueError(f"dilation must be a positive int (1 = dense window), got {dilation!r}")
    meta = square_meta(seq_len, block_size)
    lower, upper = window_bounds(seq_len, window, causal, block_size, device)
    row = query_blocks(meta, device)
    upper = upper.clamp(max=row.numel() - 1)
    start = row - (row - lower) // dilation * dilation  # lowest c >= lower with c = r mod dilation
    count = (upper - start) // dilation + 1
    return progression_rows(start, count, dilation, meta)
