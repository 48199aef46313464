"""Global (sink) tokens: the first tokens are seen by every query."""

from __future__ import annotations

import torch

from flash_msa.layout import BlockLayout
from flash_msa.patterns._build import band_rows, query_blocks, square_meta, tokens_to_blocks


def global_tokens(
    seq_len: int, num_global: int, *, causal: bool = True, block_size: int = 128, device=None
) -> BlockLayout:
    """Every query sees the blocks of the first num_global tokens (only those at or
    before it when causal); without causal the global queries also see every block."""
    meta = square_meta(seq_len, block_size)
    global_blocks = tokens_to_blocks("num_global", num_global, block_size)
    rows = query_blocks(meta, device)
    upper = torch.full_like(rows, global_blocks - 1)
    if causal:
        upper = torch.minimum(upper, rows)
    else:
        upper = torch.where(rows < global_blocks, rows.numel() - 1, upper)
    return band_rows(rows * 0, upper, meta)
