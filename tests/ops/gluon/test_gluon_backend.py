"""The "gluon" backend through block_sparse_attn_func on an H100 / H200: its forward (Gluon)
and backward (the Triton kernels) against float64 by FlashAttention's rule, and "auto"
choosing it for unmasked whole blocks only."""

import pytest
import torch

from flash_msa import block_sparse_attn_func, patterns
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.testing import random_qkv, relative_error


def on_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not on_hopper(), reason="needs an sm_90 GPU (H100, H200)")

CASES = {  # name: batch, seq_len, heads_q, heads_kv, head_dim, layout
    "bigbird-gqa-128": (1, 1024, 8, 2, 128, lambda s: patterns.bigbird(s, 256, 128, 2)),
    "per-head-mha-64": (2, 768, 4, 4, 64, lambda s: patterns.stack(
        [patterns.random_blocks(s, 2, seed=h, causal=False) for h in range(4)])),
}  # fmt: skip


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_gluon_backend_within_twice_torch_error(name, dtype):
    batch, seq_len, heads_q, heads_kv, head_dim, build = CASES[name]
    layout = build(seq_len).to("cuda")
    q, k, v = random_qkv(batch, seq_len, heads_q, head_dim, heads_kv=heads_kv, dtype=dtype,
                         device="cuda", seed=3, requires_grad=True)  # fmt: skip
    grad_out = torch.randn_like(q)
    out, lse = block_sparse_attn_func(q, k, v, layout, backend="gluon", return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    mask = layout_mask(layout, batch, heads_q)
    results = {}
    for label, precision in (("exact", torch.float64), ("torch", dtype)):
        inputs = [t.detach().to(precision).requires_grad_() for t in (q, k, v)]
        expected, expected_lse = attention_reference(*inputs, mask)
        expected_grads = torch.autograd.grad(expected, inputs, grad_out.to(precision))
        results[label] = (expected, expected_lse, *expected_grads)
    for index, (label, mine) in enumerate(zip(("out", "lse", "dq", "dk", "dv"),
                                              (out, lse, *grads), strict=True)):  # fmt: skip
        error = relative_error(mine, results["exact"][index])
        torch_error = relative_error(results["torch"][index], results["exact"][index])
        assert error <= 2 * torch_error + 1e-6, f"{label}: {error:.3g} vs torch {torch_error:.3g}"


@pytest.mark.gpu
@needs_hopper
def test_auto_takes_gluon_for_whole_blocks_only():
    layout = patterns.bigbird(1024, 256, 128, 2, device="cuda")
    q, k, v = random_qkv(1, 1024, 4, 128, dtype=torch.bfloat16, device="cuda")
    gluon = block_sparse_attn_func(q, k, v, layout, backend="gluon")
    assert torch.equal(block_sparse_attn_func(q, k, v, layout), gluon)
    triton = block_sparse_attn_func(q, k, v, layout, causal=True, backend="triton")
    assert torch.equal(block_sparse_attn_func(q, k, v, layout, causal=True), triton)
