"""Documents packed back to back: the block-diagonal layout."""

from __future__ import annotations

import torch

from flash_msa.layout import BlockLayout, layout_device
from flash_msa.patterns._build import band_rows, layout_meta, row_documents
from flash_msa.sequences import check_cu_seqlens


def documents(
    cu_seqlens: torch.Tensor,
    *,
    block_size: int = 128,
    q_block: int | None = None,
    kv_block: int | None = None,
    device=None,
) -> BlockLayout:
    """Blocks holding a pair of tokens of one document. Intersect a pattern with it (`&`)
    to drop the blocks that lie wholly across documents.

    Args:
        cu_seqlens: int32 [N + 1], documents packed back to back (reads its last entry).
        block_size: q_block and kv_block when they are not given.
        device: where to build (cu_seqlens' device when None).

    Returns:
        A single-head BlockLayout over cu_seqlens[-1] tokens.
    """
    check_cu_seqlens(cu_seqlens)
    seq_len = int(cu_seqlens[-1])
    if seq_len < 1:
        raise ValueError(f"cu_seqlens must end at a positive number of tokens, got {seq_len}")
    device = layout_device(device)
    meta = layout_meta(seq_len, None, block_size, q_block, kv_block)
    device = cu_seqlens.device if device is None else device
    _, _, start, end = row_documents(meta, cu_seqlens, device)
    return band_rows(start // meta["kv_block"], (end - 1) // meta["kv_block"], meta)
