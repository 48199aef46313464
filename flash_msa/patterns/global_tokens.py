"""Global (sink) tokens: the first tokens of each document are seen by all its queries."""

from __future__ import annotations

import torch

from flash_msa.layout import BlockLayout
from flash_msa.patterns._build import rectangles, square_meta, tokens_to_blocks
from flash_msa.sequences import check_cu_seqlens


def global_tokens(
    seq_len: int,
    num_global: int,
    *,
    causal: bool = True,
    block_size: int = 128,
    device=None,
    cu_seqlens=None,
) -> BlockLayout:
    """Every query sees the blocks of the first num_global tokens of its document (only
    those at or before it when causal); without causal the global queries also see their
    whole document. Without cu_seqlens (int32 [N + 1]) the sequence is one document."""
    meta = square_meta(seq_len, block_size)
    tokens_to_blocks("num_global", num_global, block_size)
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, seq_len], dtype=torch.int32)
    check_cu_seqlens(cu_seqlens, total_tokens=seq_len)
    bounds = cu_seqlens.to(device=device, dtype=torch.int64)
    start, end = bounds[:-1], bounds[1:]
    start, end = start[end > start], end[end > start]  # [N'] non-empty documents
    sink_end = torch.minimum(start + num_global, end)  # exclusive
    first_block, last_block = start // block_size, (end - 1) // block_size
    row_low, row_high = [first_block], [last_block]  # every query of the document ...
    col_low, col_high = [first_block], [(sink_end - 1) // block_size]  # ... sees its sinks
    if not causal:  # ... and the sinks see the whole document
        row_low.append(first_block)
        row_high.append((sink_end - 1) // block_size)
        col_low.append(first_block)
        col_high.append(last_block)
    has_sinks = sink_end > start
    keep = torch.cat([has_sinks] * len(row_low))
    parts = [torch.cat(part)[keep] for part in (row_low, row_high, col_low, col_high)]
    return rectangles(*parts, meta, causal)
