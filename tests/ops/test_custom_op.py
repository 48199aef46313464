"""torch.compile(fullgraph=True) traces through the Triton op (a torch.library custom op)."""

import os

import pytest
import torch

from flash_msa import FlashSparseAttention, block_sparse_attn_func, patterns
from flash_msa.testing import random_qkv, relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)


@needs_triton
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compiled_op_matches_eager(compiler):
    torch._dynamo.reset()
    layout = patterns.bigbird(96, 32, 16, 1, block_size=16, device=DEVICE)  # no transpose yet
    q, k, v = random_qkv(1, 96, 4, 16, heads_kv=2, device=DEVICE, requires_grad=True, seed=1)

    def attention(q, k, v):
        return block_sparse_attn_func(q, k, v, layout, causal=True, backend="triton")

    compiled = torch.compile(attention, fullgraph=True, backend=compiler)
    out = compiled(q, k, v)
    out.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    expected = attention(q, k, v)
    expected.square().sum().backward()
    assert relative_error(out, expected) < 1e-6
    for got, t in zip(grads, (q, k, v), strict=True):
        assert relative_error(got, t.grad) < 1e-6


@needs_triton
def test_compiled_layer_with_a_fixed_layout():
    torch._dynamo.reset()
    torch.manual_seed(0)
    layout = patterns.sliding_window(64, 16, block_size=16, device=DEVICE)
    layer = FlashSparseAttention(32, 2, block_size=16, pattern=layout, backend="triton")
    layer = layer.to(DEVICE)
    x = torch.randn(1, 64, 32, device=DEVICE, requires_grad=True)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert relative_error(compiled(x), layer(x)) < 1e-6
