"""Documents packed back to back: the block-diagonal layout."""

from __future__ import annotations

import torch

from flash_msa.layout import BlockLayout
from flash_msa.patterns._build import band_rows, row_documents, square_meta


def documents(cu_seqlens: torch.Tensor, *, block_size: int = 128, device=None) -> BlockLayout:
    """Blocks holding a pair of tokens of one document, for documents packed by
    cu_seqlens (int32 [N + 1]). Intersect a pattern with it (`&`) to drop the blocks
    that lie wholly across documents."""
    seq_len = int(cu_seqlens[-1]) if isinstance(cu_seqlens, torch.Tensor) else None
    meta = square_meta(seq_len, block_size)
    device = cu_seqlens.device if device is None else device
    _, _, start, end = row_documents(seq_len, block_size, cu_seqlens, device)
    return band_rows(start // block_size, (end - 1) // block_size, meta)
