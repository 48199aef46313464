"""Rotary position embeddings, rotate-half convention (GPT-NeoX, Llama).

Channel i of the first half and channel i of the second half form a pair rotated by the angle
position * base ** (-2 i / D), i < D / 2.
"""

from __future__ import annotations

import torch


def rotary_tables(
    seq_len: int, dim: int, *, base: float = 10000.0, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, fp32 [seq_len, dim / 2], of the angles at positions 0 .. seq_len - 1."""
    if not isinstance(dim, int) or dim < 2 or dim % 2:
        raise ValueError(f"rotary dim must be a positive even int, got {dim!r}")
    # float64 angles: in fp32, positions near 1M would be off by a few hundredths of a radian.
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, D] by tables [S, D / 2] from rotary_tables; computed in x's dtype."""
    if cos.shape != (x.shape[1], x.shape[-1] // 2) or x.shape[-1] % 2:
        raise ValueError(
            f"tables {list(cos.shape)} do not fit x {list(x.shape)}: need [S, D / 2] = "
            f"[{x.shape[1]}, {x.shape[-1] / 2:g}] from rotary_tables(S, D)"
        )
    cos, sin = (table.to(x.dtype)[:, None, :] for table in (cos, sin))  # [S, 1, D / 2]
    first, second = x.chunk(2, dim=-1)  # [B, S, H, D / 2] each
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
