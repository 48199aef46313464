"""A million tokens and more on one GPU (64-bit addressing), checked on sampled rows."""

import pytest
import torch

from flash_msa import block_sparse_attn_func, patterns
from flash_msa.testing import sampled_rows_errors

HEADS, HEAD_DIM, BLOCK = 16, 128, 128


def long_context_layout(pattern: str, seq_len: int, device):
    if pattern == "window":  # sliding window of 4096 tokens + 128 sink tokens
        window = patterns.sliding_window(seq_len, 4096, device=device)
        return window | patterns.global_tokens(seq_len, 128, device=device)
    # up to 16 blocks per row: its own, the previous one and 14 random ones at or before it
    random = patterns.random_blocks(seq_len, 14, device=device)
    return random | patterns.sliding_window(seq_len, BLOCK, device=device)


def sampled_errors(seq_len: int, pattern: str, check_rows: int = 4) -> tuple[float, float]:
    """Relative errors of out and dq on check_rows query blocks, against float32 over the
    same blocks, after one bf16 forward + backward on the GPU."""
    device = torch.device("cuda")
    layout = long_context_layout(pattern, seq_len, device)
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad_out = (
        torch.randn(
            1, seq_len, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=generator
        )
        for _ in range(4)
    )
    for tensor in (q, k, v):
        tensor.requires_grad_()
    out = block_sparse_attn_func(q, k, v, layout, causal=True)
    out.backward(grad_out)
    return sampled_rows_errors(q, k, v, layout, out, q.grad, grad_out, check_rows)


@pytest.mark.gpu
@pytest.mark.large_memory
@pytest.mark.parametrize("seq_len", [1 << 20, 1 << 21])  # S * H * D = 2^31 and 2^32
@pytest.mark.parametrize("pattern", ["window", "topk"])
def test_long_context_layer(seq_len, pattern):
    out_error, dq_error = sampled_errors(seq_len, pattern)
    torch.cuda.empty_cache()
    assert out_error < 1e-2 and dq_error < 2e-2, (out_error, dq_error)
