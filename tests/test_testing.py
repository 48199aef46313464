"""The shared test helpers: the sampled-row reference behind the long-context GPU test."""

import torch

from flash_msa import patterns
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.testing import random_qkv, relative_error, sampled_rows_reference


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
