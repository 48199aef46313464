"""The shared test helpers: the sampled-row reference behind the long-context GPU test."""

import torch

from flash_msa import block_sparse_attn_func, patterns
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.testing import (
    random_qkv,
    relative_error,
    sampled_rows_errors,
    sampled_rows_reference,
)


def test_sampled_rows_reference_on_the_cpu():
    """The sampled-row reference agrees with the dense one (so the GPU test is meaningful)."""
    window = patterns.sliding_window(300, 64, block_size=32)
    layout = window | patterns.global_tokens(300, 16, block_size=32)
    q, k, v = random_qkv(1, 300, 4, 16, heads_kv=2, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(1, 300, 4, 16, dtype=torch.float64)
    rows = [0, 4, 9]
    out, dq = sampled_rows_reference(q, k, v, layout, rows, grad_out)
    expected, _ = attention_reference(q, k, v, layout_mask(layout, 1, 4, causal=True))
    expected.backward(grad_out)
    positions = torch.cat([torch.arange(r * 32, min(r * 32 + 32, 300)) for r in rows])
    assert relative_error(out, expected[0, positions]) < 1e-6
    assert relative_error(dq, q.grad[0, positions]) < 1e-6


def test_sampled_rows_errors_of_an_exact_computation_are_small():
    layout = patterns.sliding_window(300, 64, block_size=32)
    q, k, v = random_qkv(1, 300, 4, 16, heads_kv=2, requires_grad=True)
    out = block_sparse_attn_func(q, k, v, layout, causal=True)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    out_error, dq_error = sampled_rows_errors(q, k, v, layout, out, q.grad, grad_out, 3)
    assert out_error < 1e-5 and dq_error < 1e-5
    wrong_out, _ = sampled_rows_errors(q, k, v, layout, out * 1.01, q.grad, grad_out, 3)
    assert wrong_out > 5e-3
