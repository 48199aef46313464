"""A million tokens and more on one GPU (64-bit addressing), checked on sampled rows."""

import pathlib
import runpy

import pytest
import torch

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "long_context_layer.py"


@pytest.mark.gpu
@pytest.mark.large_memory
@pytest.mark.parametrize("seq_len", [1 << 20, 1 << 21])  # S * H * D = 2^31 and 2^32
@pytest.mark.parametrize("pattern", ["window", "topk"])
def test_long_context_layer(seq_len, pattern):
    result = runpy.run_path(str(EXAMPLE))["run"](seq_len, 16, 16, pattern)
    print(result)
    assert result["out_error"] < 1e-2 and result["dq_error"] < 2e-2, result
    torch.cuda.empty_cache()


def test_sampled_rows_reference_on_the_cpu():
    """The sampled-row reference agrees with the dense one (so the GPU test is meaningful)."""
    from flash_msa import patterns
    from flash_msa.reference import attention_reference, layout_mask
    from flash_msa.testing import random_qkv, relative_error, sampled_rows_reference

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
