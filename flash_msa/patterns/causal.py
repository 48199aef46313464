"""Causal layout: every block on or below the diagonal."""

from __future__ import annotations

import math

from flash_msa.layout import BlockLayout, layout_device
from flash_msa.patterns._build import (
    band_rows,
    diagonal_total,
    diagonals,
    fixed_rows,
    layout_meta,
    query_blocks,
)
from flash_msa.patterns.sliding_window import window_bounds


def causal(
    seq_len: int,
    *,
    block_size: int = 128,
    q_block: int | None = None,
    kv_block: int | None = None,
    device=None,
    cu_seqlens=None,
) -> BlockLayout:
    """Every block holding a causal pair j <= i: row b holds kv blocks 0 .. d(b), d(b) the
    block of b's last query. Pair with causal=True in the attention call.

    Args:
        seq_len: tokens of queries and keys.
        block_size: q_block and kv_block when they are not given.
        cu_seqlens: int32 [N + 1] documents packed over the seq_len tokens: only blocks
            holding a causal pair of one document. None: one document, and the layout is
            built without reading a device value (its nnz follows from the geometry).

    Returns:
        A single-head BlockLayout.
    """
    device = layout_device(device)
    meta = layout_meta(seq_len, None, block_size, q_block, kv_block)
    if cu_seqlens is not None:
        lower, upper = window_bounds(meta, seq_len, True, device, cu_seqlens)
        return band_rows(lower, upper, meta)
    counts = diagonals(query_blocks(meta, device), meta) + 1  # [nq]
    nnz = diagonal_total(meta, math.ceil(seq_len / meta["kv_block"]))
    row_offsets, _, slots = fixed_rows(counts, 1, nnz)
    return BlockLayout(row_offsets.int(), slots.int(), **meta, validate=False)
