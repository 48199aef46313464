"""Dropout: the kernels' Philox mask, exact gradients given that mask, and statistics."""

import math

import pytest
import torch

from flash_msa import block_sparse_attn_func, patterns
from flash_msa.ops.triton import attention_backward, attention_forward
from flash_msa.ops.triton.dropout import dropout_mask
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.testing import random_qkv, relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


@pytest.mark.parametrize(
    "heads_q, heads_kv, seq_len, causal, window_size",
    [(4, 2, 100, True, (-1, -1)), (2, 2, 130, False, (30, 10))],
)
def test_kernels_match_reference_given_the_mask(heads_q, heads_kv, seq_len, causal, window_size):
    seed, p = 1234, 0.3
    layout = patterns.random_blocks(seq_len, 3, causal=causal, block_size=32, device=DEVICE)
    layout = layout | patterns.sliding_window(seq_len, 32, causal=causal, block_size=32,
                                              device=DEVICE)  # fmt: skip
    q, k, v = random_qkv(2, seq_len, heads_q, 16, heads_kv=heads_kv, device=DEVICE, seed=5)
    options = dict(causal=causal, window_size=window_size, softmax_scale=0.25)
    out, lse = attention_forward(q, k, v, layout, **options, dropout_p=p, dropout_seed=seed)
    grad_out = torch.randn_like(out)
    grads = attention_backward(
        grad_out, q, k, v, out, lse, layout, **options, dropout_p=p, dropout_seed=seed
    )
    keep = dropout_mask(seed, p, 2, heads_q, seq_len, seq_len, DEVICE).cpu()
    mask = layout_mask(layout, 2, heads_q, causal=causal, window_size=window_size).cpu()
    exact = [t.cpu().double().requires_grad_() for t in (q, k, v)]
    expected, expected_lse = attention_reference(*exact, mask, 0.25, keep, p)
    expected.backward(grad_out.cpu().double())
    assert relative_error(out, expected) < 1e-4
    assert relative_error(lse, expected_lse) < 1e-4  # the normaliser keeps every probability
    for got, tensor in zip(grads, exact, strict=True):
        assert relative_error(got, tensor.grad) < 1e-4


def test_mask_keep_rate_and_independence():
    p = 0.2
    keep = dropout_mask(7, p, 2, 2, 128, 256, DEVICE).float()
    rate, count = float(keep.mean()), keep.numel()
    assert abs(rate - (1 - p)) < 4 * math.sqrt(p * (1 - p) / count)
    per_head = keep.flatten(2).mean(-1)  # [B, H]: each near 1 - p
    assert torch.allclose(per_head, torch.full_like(per_head, 1 - p), atol=0.01)
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])
    assert torch.equal(keep, dropout_mask(7, p, 2, 2, 128, 256, DEVICE).float())
    assert not torch.equal(keep, dropout_mask(8, p, 2, 2, 128, 256, DEVICE).float())


def test_interface_draws_its_seed_from_torch_generator():
    layout = patterns.causal(64, block_size=32, device=DEVICE)
    q, k, v = random_qkv(1, 64, 2, 16, device=DEVICE, seed=2)
    torch.manual_seed(11)
    first = block_sparse_attn_func(q, k, v, layout, causal=True, dropout_p=0.5, backend="triton")
    torch.manual_seed(11)
    seed = int(torch.randint(2**31 - 1, ()))
    keep = dropout_mask(seed, 0.5, 1, 2, 64, 64, DEVICE).cpu()
    mask = layout_mask(layout, 1, 2, causal=True).cpu()
    expected, _ = attention_reference(*(t.cpu().double() for t in (q, k, v)), mask, None, keep, 0.5)
    assert relative_error(first, expected) < 1e-4
    second = block_sparse_attn_func(q, k, v, layout, causal=True, dropout_p=0.5, backend="triton")
    assert not torch.equal(first, second)  # a fresh seed per call


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dropout_is_unbiased(backend):
    layout = patterns.causal(64, block_size=32, device=DEVICE)
    q, k, v = random_qkv(1, 64, 1, 16, device=DEVICE, seed=3)
    plain = block_sparse_attn_func(q, k, v, layout, causal=True, backend=backend)
    draws = 200 if backend == "torch" or DEVICE == "cuda" else 40
    mean = (
        sum(
            block_sparse_attn_func(q, k, v, layout, causal=True, dropout_p=0.3, backend=backend)
            for _ in range(draws)
        )
        / draws
    )
    # Each output is a mean of kept values / (1 - p): the average over draws converges on it.
    assert relative_error(mean, plain) < 3.0 / math.sqrt(draws)
