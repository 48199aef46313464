"""Shared test helpers: random inputs, output poisoning, error measures."""

from __future__ import annotations

import torch


def random_qkv(
    batch: int,
    seq_len_q: int,
    heads_q: int,
    head_dim: int,
    *,
    seq_len_kv: int | None = None,
    heads_kv: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh normal q [B, S_q, H_q, D], k/v [B, S_kv, H_kv, D] from a seed (never zeros)."""
    seq_len_kv = seq_len_q if seq_len_kv is None else seq_len_kv
    heads_kv = heads_q if heads_kv is None else heads_kv
    generator = torch.Generator(device="cpu").manual_seed(seed)
    shapes = [
        (batch, seq_len_q, heads_q, head_dim),
        (batch, seq_len_kv, heads_kv, head_dim),
        (batch, seq_len_kv, heads_kv, head_dim),
    ]
    return tuple(
        torch.randn(shape, generator=generator, dtype=torch.float32)
        .to(device=device, dtype=dtype)
        .requires_grad_(requires_grad)
        for shape in shapes
    )


def poisoned_like(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An output buffer full of NaN: an element the kernel fails to write stays NaN."""
    return torch.full_like(tensor, float("nan"), dtype=dtype)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64, over finite entries of expected;
    infinite entries (lse = -inf of empty rows) must match exactly, NaN never passes."""
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    if torch.isnan(actual).any():
        return float("inf")
    finite = torch.isfinite(expected)
    if not torch.equal(actual[~finite], expected[~finite]):
        return float("inf")
    difference = torch.linalg.vector_norm(actual[finite] - expected[finite])
    return float(difference / torch.linalg.vector_norm(expected[finite]).clamp_min(1e-30))
