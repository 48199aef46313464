"""Rotary position embeddings, rotate-half convention (GPT-NeoX, Llama).

Channel i of the first half and channel i of the second half form a pair rotated by the angle
position * base ** (-2 i / D), i < D / 2.
"""

from __future__ import annotations

import math

import torch

from flash_msa.layout import checked_device


def check_base(name: str, base) -> None:
    """A rotary base: a finite number above 1 (1 rotates nothing, below 1 is no frequency
    ladder, 0 or NaN give NaN tables)."""
    if type(base) not in (int, float) or not math.isfinite(base) or base <= 1:
        raise ValueError(f"{name} must be a finite number > 1, got {base!r}")


def rotary_tables(
    seq_len: int, dim: int, *, base: float = 10000.0, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, fp32 [seq_len, dim / 2], of the angles at positions 0 .. seq_len - 1."""
    if type(seq_len) is not int or seq_len < 0:
        raise ValueError(f"rotary seq_len must be a non-negative int, got {seq_len!r}")
    if type(dim) is not int or dim < 2 or dim % 2:
        raise ValueError(f"rotary dim must be a positive even int, got {dim!r}")
    check_base("rotary base", base)
    device = checked_device(device)
    # float64 angles: in fp32, positions near 1M would be off by a few hundredths of a radian.
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, D] by tables [S, D / 2] from rotary_tables; computed in x's dtype."""
    for name, tensor in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise TypeError(f"apply_rotary's {name} must be a floating-point tensor, got {kind}")
    if x.dim() != 4:
        raise ValueError(f"apply_rotary's x must be [B, S, H, D], got shape {list(x.shape)}")
    need = (x.shape[1], x.shape[-1] // 2)
    if cos.shape != need or sin.shape != need or x.shape[-1] % 2:
        raise ValueError(
            f"tables cos {list(cos.shape)}, sin {list(sin.shape)} do not fit x "
            f"{list(x.shape)}: need [S, D / 2] = [{x.shape[1]}, {x.shape[-1] / 2:g}] from "
            "rotary_tables(S, D)"
        )
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(
            f"tables on {cos.device} / {sin.device} but x on {x.device}: build them with "
            "rotary_tables(..., device=x.device)"
        )
    cos, sin = (table.to(x.dtype)[:, None, :] for table in (cos, sin))  # [S, 1, D / 2]
    first, second = x.chunk(2, dim=-1)  # [B, S, H, D / 2] each
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
