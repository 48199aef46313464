"""Random blocks (BigBird's random attention), reproducible for a seed on any device."""

from __future__ import annotations

import math

import torch

from flash_msa.layout import BlockLayout, layout_device
from flash_msa.patterns._build import check_flags, diagonals, is_int, layout_meta, query_blocks

_MASK32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix in int64 arithmetic: identical on every device."""
    x = x & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def random_blocks(
    seq_len: int,
    blocks_per_row: int,
    *,
    seed: int = 0,
    causal: bool = True,
    block_size: int = 128,
    q_block: int | None = None,
    kv_block: int | None = None,
    device=None,
) -> BlockLayout:
    """blocks_per_row distinct blocks per row drawn uniformly, by Floyd's sampling
    vectorised over rows.

    Args:
        seq_len: tokens of queries and keys.
        blocks_per_row: blocks drawn per row; a row with fewer candidates (the blocks
            0 .. d(r) when causal, d(r) the kv block of r's last query; all kv blocks
            otherwise) takes them all, so counts past the kv blocks cost no more.
        seed: the same seed gives the same layout on every device.
        block_size: q_block and kv_block when they are not given.

    Returns:
        A single-head BlockLayout.
    """
    if not is_int(blocks_per_row) or blocks_per_row < 0:
        raise ValueError(f"blocks_per_row must be a non-negative int, got {blocks_per_row!r}")
    if not is_int(seed):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    check_flags(causal=causal)
    device = layout_device(device)
    meta = layout_meta(seq_len, None, block_size, q_block, kv_block)
    rows = query_blocks(meta, device)  # [nq]
    num_kv_blocks = math.ceil(seq_len / meta["kv_block"])
    draws = min(blocks_per_row, num_kv_blocks)  # no row has more candidates
    everything = torch.full_like(rows, num_kv_blocks)
    candidates = diagonals(rows, meta) + 1 if causal else everything  # [nq]
    picks = torch.minimum(candidates, torch.full_like(rows, draws))  # [nq]
    row_seed = _hash32(_hash32(torch.full_like(rows, seed & _MASK32)) ^ rows)  # [nq]
    chosen = torch.full((rows.numel(), draws), -1, dtype=torch.int64, device=rows.device)
    for draw in range(draws):  # Floyd: the draw-th pick is uniform in [0, last]
        last = candidates - picks + draw  # [nq]
        uniform = (_hash32(row_seed ^ (draw * 0x9E3779B1)) * (last + 1)) >> 32  # [nq] in [0, last]
        taken = (chosen[:, :draw] == uniform[:, None]).any(dim=1)
        pick = torch.where(taken, last, uniform)
        chosen[:, draw] = torch.where(draw < picks, pick, -1)
    chosen = chosen.sort(dim=1).values  # [nq, draws], -1 (unused) first
    keys = (rows[:, None] * num_kv_blocks + chosen)[chosen >= 0]
    return BlockLayout.from_keys(keys, **meta, validate=False)
