"""Dilated (strided) layout: every dilation-th block within a window."""

from __future__ import annotations

import math

from flash_msa.layout import BlockLayout, layout_device
from flash_msa.patterns._build import (
    check_flags,
    diagonals,
    is_int,
    layout_meta,
    progression_rows,
    query_blocks,
)
from flash_msa.patterns.sliding_window import window_bounds


def dilated(
    seq_len: int,
    window: int,
    dilation: int,
    *,
    causal: bool = True,
    block_size: int = 128,
    q_block: int | None = None,
    kv_block: int | None = None,
    device=None,
) -> BlockLayout:
    """Blocks c within the sliding window of row r (see sliding_window) whose distance
    from the diagonal d(r) (the kv block of r's last query) is a multiple of dilation:
    (d(r) - c) % dilation == 0.

    Args:
        seq_len: tokens of queries and keys.
        window: tokens of the sliding window.
        dilation: keep every dilation-th block (1 = the whole window).
        block_size: q_block and kv_block when they are not given.

    Returns:
        A single-head BlockLayout.
    """
    if not is_int(dilation) or dilation < 1:
        raise ValueError(f"dilation must be a positive int (1 = dense window), got {dilation!r}")
    check_flags(causal=causal)
    device = layout_device(device)
    meta = layout_meta(seq_len, None, block_size, q_block, kv_block)
    lower, upper = window_bounds(meta, window, causal, device)
    diagonal = diagonals(query_blocks(meta, device), meta)  # [nq]
    num_kv_blocks = math.ceil(seq_len / meta["kv_block"])
    dilation = min(dilation, num_kv_blocks)  # past the kv blocks: the diagonal alone
    upper = upper.clamp(max=num_kv_blocks - 1)
    # The lowest c >= lower with c = d(r) mod dilation.
    start = diagonal - (diagonal - lower) // dilation * dilation
    count = (upper - start) // dilation + 1
    return progression_rows(start, count, dilation, meta)
