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


def assert_compiled_matches_eager(attention, inputs, compiler):
    """attention under torch.compile(fullgraph=True) gives eager's output and gradients."""
    compiled = torch.compile(attention, fullgraph=True, backend=compiler)
    out = compiled(*inputs)
    out.square().sum().backward()
    grads = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    expected = attention(*inputs)
    expected.square().sum().backward()
    assert relative_error(out, expected) < 1e-6
    for got, t in zip(grads, inputs, strict=True):
        assert relative_error(got, t.grad) < 1e-6


@needs_triton
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compiled_op_matches_eager(compiler):
    torch._dynamo.reset()
    layout = patterns.bigbird(96, 32, 16, 1, block_size=16, device=DEVICE)  # no transpose yet
    q, k, v = random_qkv(1, 96, 4, 16, heads_kv=2, device=DEVICE, requires_grad=True, seed=1)

    def attention(q, k, v):
        return block_sparse_attn_func(q, k, v, layout, causal=True, backend="triton")

    assert_compiled_matches_eager(attention, (q, k, v), compiler)


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


def test_compiled_torch_backend_matches_eager():
    """The torch backend runs inside the custom op: fullgraph tracing, no graph break."""
    torch._dynamo.reset()
    layout = patterns.random_blocks(96, 2, seed=3, block_size=16, device=DEVICE)
    q, k, v = random_qkv(2, 96, 4, 16, heads_kv=2, device=DEVICE, requires_grad=True, seed=2)

    def attention(q, k, v):
        # On CUDA the torch backend's backward adds with atomics: not bitwise reproducible.
        return block_sparse_attn_func(q, k, v, layout, causal=True, backend="torch",
                                      deterministic=DEVICE == "cpu")  # fmt: skip

    assert_compiled_matches_eager(attention, (q, k, v), "aot_eager")


def backends():
    return ["torch", pytest.param("triton", marks=needs_triton)]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("per_batch_layout", [False, True])
def test_vmap_matches_a_loop(backend, per_batch_layout):
    """torch.func.vmap folds its dimension into the batch (per-batch layouts repeated)."""
    mask = torch.rand(2, 1, 4, 4, generator=torch.Generator().manual_seed(0)) < 0.6
    layout = patterns.from_dense_mask(
        mask if per_batch_layout else mask[:1], seq_len_q=64, block_size=16, device=DEVICE
    )
    q, k, v = (torch.stack(pair) for pair in zip(
        random_qkv(2, 64, 2, 16, heads_kv=1, device=DEVICE, seed=4),
        random_qkv(2, 64, 2, 16, heads_kv=1, device=DEVICE, seed=5), strict=True,
    ))  # fmt: skip  # [2 (vmapped), B, S, H, D]

    def attention(q, k, v):
        return block_sparse_attn_func(q, k, v, layout, return_lse=True, backend=backend)

    out, lse = torch.func.vmap(attention)(q, k, v)
    for index in range(2):
        expected_out, expected_lse = attention(q[index], k[index], v[index])
        assert relative_error(out[index], expected_out) < 1e-6
        assert relative_error(lse[index], expected_lse) < 1e-6


@pytest.mark.parametrize("backend", backends())
def test_func_grad_matches_autograd(backend):
    """torch.func.grad, and vmap of it, reach the backend's backward."""
    layout = patterns.causal(64, block_size=16, device=DEVICE)
    q, k, v = random_qkv(1, 64, 2, 16, heads_kv=1, device=DEVICE, seed=6)

    def loss(q, k, v):
        out = block_sparse_attn_func(q, k, v, layout, causal=True, backend=backend,
                                     deterministic=False)  # torch's on CUDA: not reproducible
        return out.square().sum()

    grads = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    loss(*leaves).backward()
    for got, leaf in zip(grads, leaves, strict=True):
        assert relative_error(got, leaf.grad) < 1e-6
    batched = torch.func.vmap(torch.func.grad(loss))(*(torch.stack([t, 2 * t]) for t in (q, k, v)))
    assert relative_error(batched[0], grads[0]) < 1e-6
    assert relative_error(batched[1], torch.func.grad(loss)(2 * q, 2 * k, 2 * v)) < 1e-6
