"""Layout from a dense boolean block mask."""

from __future__ import annotations

import math

import torch

from flash_msa.layout import BlockLayout


def block_grid_meta(
    grid: torch.Tensor, name: str, seq_len_q: int, seq_len_kv: int | None, block_size: int
) -> dict:
    """Metadata for a [..., nq, nk] block grid ([nq, nk], [H, nq, nk] or [B, H, nq, nk]),
    checking its last two sizes against the sequence lengths."""
    if not isinstance(grid, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(grid).__name__}")
    if grid.dim() not in (2, 3, 4):
        raise ValueError(
            f"{name} must be [nq, nk], [heads, nq, nk] or [batch, heads, nq, nk], "
            f"got shape {list(grid.shape)}"
        )
    seq_len_kv = seq_len_q if seq_len_kv is None else seq_len_kv
    expected = (math.ceil(seq_len_q / block_size), math.ceil(seq_len_kv / block_size))
    if tuple(grid.shape[-2:]) != expected:
        raise ValueError(
            f"{name} has {list(grid.shape[-2:])} blocks, but seq_len_q={seq_len_q}, "
            f"seq_len_kv={seq_len_kv} with block_size={block_size} need {list(expected)}"
        )
    leading = (1,) * (4 - grid.dim()) + tuple(grid.shape[:-2])
    return dict(
        seq_len_q=seq_len_q,
        seq_len_kv=seq_len_kv,
        q_block=block_size,
        kv_block=block_size,
        layout_batch=leading[-2],
        layout_heads=leading[-1],
    )


def from_dense_mask(
    block_mask: torch.Tensor,
    *,
    seq_len_q: int,
    seq_len_kv: int | None = None,
    block_size: int = 128,
    device=None,
) -> BlockLayout:
    """block_mask bool [nq, nk], [heads, nq, nk] or [batch, heads, nq, nk]: True = active."""
    meta = block_grid_meta(block_mask, "block_mask", seq_len_q, seq_len_kv, block_size)
    if block_mask.dtype != torch.bool:
        raise TypeError(f"block_mask must be bool, got {block_mask.dtype}; pass mask != 0")
    block_mask = block_mask.to(device) if device is not None else block_mask
    return BlockLayout.from_keys(block_mask.flatten().nonzero().squeeze(1), **meta)
