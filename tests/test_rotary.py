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
    fit = r"tables cos \[50, 4\], sin \[50, 4\] do not fit x \[2, 50, 3, 6\]"
    with pytest.raises(ValueError, match=fit):
        apply_rotary(x[..., :6], cos, sin)
    with pytest.raises(ValueError, match="rotary dim must be a positive even int, got 7"):
        rotary_tables(50, 7)


@pytest.mark.parametrize(
    "arguments, options, match",
    [
        ((-1, 8), {}, "rotary seq_len must be a non-negative int, got -1"),
        ((1.5, 8), {}, "rotary seq_len must be a non-negative int, got 1.5"),
        ((True, 8), {}, "rotary seq_len must be a non-negative int, got True"),
        ((4, 8), {"base": 0}, "rotary base must be a finite number > 1, got 0"),
        ((4, 8), {"base": 1.0}, "rotary base must be a finite number > 1, got 1.0"),
        ((4, 8), {"base": float("nan")}, "rotary base must be a finite number > 1, got nan"),
        ((4, 8), {"device": "nowhere"}, "device must name a torch device"),
    ],
)
def test_rotary_tables_refuse_bad_arguments(arguments, options, match):
    with pytest.raises(ValueError, match=match):
        rotary_tables(*arguments, **options)


def test_apply_rotary_refuses_what_it_cannot_rotate():
    cos, sin = rotary_tables(8, 16)
    x = torch.randn(1, 8, 2, 16)
    for bad, error, match in [
        ((x.long(), cos, sin), TypeError, "x must be a floating-point tensor, got torch.int64"),
        ((x.bool(), cos, sin), TypeError, "x must be a floating-point tensor, got torch.bool"),
        ((x, cos.tolist(), sin), TypeError, "cos must be a floating-point tensor, got list"),
        ((x[0], cos, sin), ValueError, r"x must be \[B, S, H, D\], got shape \[8, 2, 16\]"),
        ((x, cos, sin[:1]), ValueError, r"sin \[1, 8\] do not fit"),
        ((x, cos.to("meta"), sin.to("meta")), ValueError, "tables on meta / meta but x on cpu"),
    ]:
        with pytest.raises(error, match=match):
            apply_rotary(*bad)
