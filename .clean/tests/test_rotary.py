"""Rotary embeddings against a rotation by complex numbers."""

import pytest
import torch

from flash_msa.rotary import apply_rotary, rotary_tables


def test_rotary_matches_complex_rotation():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 50, 3, 8, generator=generator, dtype=torch.float64)
    cos, sin = rotary_tables(50, 8, base=500.0)
    # Channel pair (i, i + D/2) as the complex number x_i + 1j x_(i+D/2), times e^(1j angle).
    frequencies = 500.0 ** (-torch.arange(4, dtype=torch.float64) / 4)  # base^(-2i / D)
    angles = torch.arange(50, dtype=torch.float64)[:, None] * frequencies  # [S, D / 2]
    turns = torch.polar(torch.ones_like(angles), angles)[:, None, :]  # [S, 1, D / 2]
    rotated = torch.complex(x[..., :4], x[..., 4:]) * turns
    expected = torch.cat([rotated.real, rotated.imag], dim=-1)
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"tables \[50, 4\] do not fit x \[2, 50, 3, 6\]"):
        apply_rotary(x[..., :6], cos, sin)
    with pytest.raises(ValueError, match="rotary dim must be a positive even int, got 7"):
        rotary_tables(50, 7)
