"""Random blocks (BigBird's random attention), reproducible for a seed on any device."""

from __future__ import annotations

import torch

from flash_msa.layout import BlockLayout
from flash_msa.patterns._build import query_blocks, square_meta

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
    device=None,
) -> BlockLayout:
    """blocks_per_row distinct blocks per row drawn uniformly (among c <= r when causal;
    all of them when fewer exist), by Floyd's sampling vectorised over rows."""
    if not isinstance(blocks_per_row, int) or blocks_per_row < 0:
        raise ValueError(f"blocks_per_row must be a non-negative int, got {blocks_per_row!r}")
    if not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    meta = square_meta(seq_len, block_size)
    rows = query_blocks(meta, device)  # [nb]
    num_blocks = rows.numel()
    candidates = rows + 1 if causal else torch.full_like(rows, num_blocks)  # [nb]
    picks = torch.minimum(candidates, torch.full_like(rows, blocks_per_row))  # [nb]
    row_seed = _hash32(_hash32(torch.full_like(rows, seed & _MASK32)) ^ rows)  # [nb]
    chosen = torch.full((num_blocks, blocks_per_row), -1, dtype=torch.int64, device=rows.device)
    for draw in range(blocks_per_row):  # Floyd: the draw-th pick is uniform in [0, last]
        last = candidates - picks + draw  # [nb]
        uniform = (_hash32(row_seed ^ (draw * 0x9E3779B1)) * (last + 1)) >> 32  # [nb] in [0, last]
        taken = (chosen[:, :draw] == uniform[:, None]).any(dim=1)
        pick = torch.where(taken, last, uniform)
        chosen[:, draw] = torch.where(draw < picks, pick, -1)
    chosen = chosen.sort(dim=1).values  # [nb, k], -1 (unused) first
    keys = (rows[:, None] * num_blocks + chosen)[chosen >= 0]
    return BlockLayout.from_keys(keys, **meta)
