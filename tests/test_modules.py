import functools

import pytest
import torch

from flash_msa import FlashSparseAttention, patterns
from flash_msa.reference import attention_reference, layout_mask


def test_layer_matches_projections_around_dense_reference():
    torch.manual_seed(0)
    pattern = functools.partial(patterns.sliding_window, window=32)
    layer = FlashSparseAttention(64, 4, num_kv_heads=2, block_size=16, pattern=pattern)
    x = torch.randn(2, 100, 64, requires_grad=True)
    out = layer(x)
    assert out.shape == x.shape
    out.square().sum().backward()
    assert x.grad is not None and layer.qkv_proj.weight.grad.abs().sum() > 0

    q, k, v = layer.qkv_proj(x.detach()).split([64, 32, 32], dim=-1)
    layout = layer.layout_for(100, x.device)
    mask = layout_mask(layout, 2, 4, causal=True)
    expected, _ = attention_reference(
        q.view(2, 100, 4, 16).double(),
        k.view(2, 100, 2, 16).double(),
        v.view(2, 100, 2, 16).double(),
        mask,
    )
    expected = layer.out_proj(expected.reshape(2, 100, 64).float())
    assert torch.allclose(out, expected, atol=1e-5)


def test_layer_accepts_a_fixed_layout_and_caches_builders():
    layout = patterns.causal(64, block_size=16)
    layer = FlashSparseAttention(32, 2, block_size=16, pattern=layout)
    assert layer(torch.randn(1, 64, 32)).shape == (1, 64, 32)
    built = FlashSparseAttention(32, 2, block_size=16)
    assert built.layout_for(64, torch.device("cpu")) is built.layout_for(64, torch.device("cpu"))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"embed_dim": 30, "num_heads": 4}, ValueError, "embed_dim 30 must be divisible by"),
        ({"embed_dim": 32, "num_heads": 4, "num_kv_heads": 3}, ValueError, "multiple of num_kv"),
        ({"embed_dim": 32, "num_heads": 4, "pattern": "causal"}, TypeError, "pattern must be"),
    ],
)
def test_layer_argument_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        FlashSparseAttention(**kwargs)
    with pytest.raises(ValueError, match=r"x must be \[batch, seq_len, embed_dim\]"):
        FlashSparseAttention(32, 2)(torch.randn(4, 32))
