"""Global (sink) tokens: the first tokens of each document are seen by all its queries."""

from __future__ import annotations

import torch

from flash_msa.layout import BlockLayout, layout_device
from flash_msa.patterns._build import check_flags, layout_meta, rectangles, tokens_to_blocks
from flash_msa.sequences import check_cu_seqlens


def global_tokens(
    seq_len: int,
    num_global: int,
    *,
    causal: bool = True,
    block_size: int = 128,
    q_block: int | None = None,
    kv_block: int | None = None,
    device=None,
    cu_seqlens=None,
) -> BlockLayout:
    """Every query sees the blocks of the first num_global tokens of its document (only
    those at or before it when causal); without causal the global queries also see their
    whole document.

    Args:
        seq_len: tokens of queries and keys.
        num_global: sink tokens per document (more than a document has: all of it).
        block_size: q_block and kv_block when they are not given.
        cu_seqlens: int32 [N + 1] documents packed over the seq_len tokens, or None (one).

    Returns:
        A single-head BlockLayout.
    """
    check_flags(causal=causal)
    device = layout_device(device)
    meta = layout_meta(seq_len, None, block_size, q_block, kv_block)
    tokens_to_blocks("num_global", num_global, meta["kv_block"])
    num_global = min(num_global, seq_len)  # fits int64 however large
    q_block, kv_block = meta["q_block"], meta["kv_block"]
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, seq_len], dtype=torch.int32)
    check_cu_seqlens(cu_seqlens, total_tokens=seq_len)
    bounds = cu_seqlens.to(device=device, dtype=torch.int64)
    start, end = bounds[:-1], bounds[1:]
    start, end = start[end > start], end[end > start]  # [N'] non-empty documents
    sink_end = torch.minimum(start + num_global, end)  # exclusive
    row_low, row_high = [start // q_block], [(end - 1) // q_block]  # every query ...
    col_low, col_high = [start // kv_block], [(sink_end - 1) // kv_block]  # ... sees its sinks
    if not causal:  # ... and the sinks see the whole document
        row_low.append(start // q_block)
        row_high.append((sink_end - 1) // q_block)
        col_low.append(start // kv_block)
        col_high.append((end - 1) // kv_block)
    has_sinks = sink_end > start
    keep = torch.cat([has_sinks] * len(row_low))
    parts = [torch.cat(part)[keep] for part in (row_low, row_high, col_low, col_high)]
    return rectangles(*parts, meta, causal)
