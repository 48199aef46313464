"""Layout from a dense boolean block mask."""

from __future__ import annotations

import torch

from flash_msa.layout import BlockLayout, layout_device
from flash_msa.patterns._build import grid_meta


def from_dense_mask(
    block_mask: torch.Tensor,
    *,
    seq_len_q: int,
    seq_len_kv: int | None = None,
    block_size: int = 128,
    q_block: int | None = None,
    kv_block: int | None = None,
    device=None,
) -> BlockLayout:
    """The blocks a dense boolean block mask marks True.

    Args:
        block_mask: bool [nq, nk], [heads, nq, nk] or [batch, heads, nq, nk].
        seq_len_q, seq_len_kv: tokens of queries and keys (seq_len_kv defaults to seq_len_q).
        block_size: q_block and kv_block when they are not given.

    Returns:
        A BlockLayout with layout_batch and layout_heads from block_mask's leading sizes.
    """
    meta = grid_meta(block_mask, "block_mask", seq_len_q, seq_len_kv, block_size, q_block, kv_block)
    if block_mask.dtype != torch.bool:
        raise TypeError(f"block_mask must be bool, got {block_mask.dtype}; pass mask != 0")
    device = layout_device(device)
    block_mask = block_mask.to(device) if device is not None else block_mask
    return BlockLayout.from_keys(block_mask.flatten().nonzero().squeeze(1), **meta, validate=False)
