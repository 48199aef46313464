"""torch_ref (the gather backend) against dense float64 ground truth."""

import pytest
import torch

from flash_msa import _env, block_sparse_attn_func, patterns
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.testing import random_qkv, relative_error

TOLERANCE = 1e-5  # fp32 against float64


def check_against_reference(q, k, v, layout, causal=False, window_size=(-1, -1), seed=0):
    """Run torch_ref in fp32 and the dense reference in float64; compare out, lse, grads."""
    out, lse = block_sparse_attn_func(
        q, k, v, layout, causal=causal, window_size=window_size, return_lse=True, backend="torch"
    )
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    out.backward(grad_out)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    mask = layout_mask(layout, q.shape[0], q.shape[2], causal=causal, window_size=window_size)
    expected_out, expected_lse = attention_reference(*exact, mask)
    expected_out.backward(grad_out.double())
    errors = {
        "out": relative_error(out, expected_out),
        "lse": relative_error(lse, expected_lse),
        **{
            name: relative_error(t.grad, e.grad)
            for name, t, e in zip(("dq", "dk", "dv"), (q, k, v), exact, strict=True)
        },
    }
    assert all(error < TOLERANCE for error in errors.values()), errors


def pattern_cases(seq_len, block):
    return {
        "causal": patterns.causal(seq_len, block_size=block),
        "sliding_window": patterns.sliding_window(seq_len, 40, block_size=block),
        "global_tokens": patterns.global_tokens(seq_len, 20, causal=False, block_size=block),
        "dilated": patterns.dilated(seq_len, 96, 2, block_size=block),
        "random_blocks": patterns.random_blocks(seq_len, 2, seed=1, block_size=block),
        "bigbird": patterns.bigbird(seq_len, 32, 16, 1, block_size=block),
        "longformer": patterns.longformer(seq_len, 32, 16, block_size=block),
        "topk": patterns.topk(
            torch.randn(-(-seq_len // block), -(-seq_len // block)),
            2,
            seq_len_q=seq_len,
            block_size=block,
        ),
    }


@pytest.mark.parametrize("name", list(pattern_cases(64, 16)))
@pytest.mark.parametrize("causal", [True, False])
def test_every_pattern(name, causal):
    seq_len = 150  # not a multiple of the block
    layout = pattern_cases(seq_len, 32)[name]
    q, k, v = random_qkv(2, seq_len, 2, 16, requires_grad=True, seed=len(name))
    check_against_reference(q, k, v, layout, causal=causal)


@pytest.mark.parametrize("window_size", [(16, 0), (30, 30), (-1, 8), (0, 0)])
@pytest.mark.parametrize("causal", [True, False])
def test_windows(window_size, causal):
    layout = patterns.sliding_window(130, 40, causal=False, block_size=16)
    q, k, v = random_qkv(1, 130, 2, 32, requires_grad=True, seed=3)
    check_against_reference(q, k, v, layout, causal=causal, window_size=window_size)


@pytest.mark.parametrize("heads_q, heads_kv", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("layout_heads", ["one", "kv", "q", "half"])
def test_gqa_with_per_head_layouts(heads_q, heads_kv, layout_heads):
    count = {"one": 1, "kv": heads_kv, "q": heads_q, "half": heads_q // 2}[layout_heads]
    layout = (
        patterns.stack(
            [patterns.random_blocks(100, 2, seed=h, block_size=16) for h in range(count)]
        )
        if count > 1
        else patterns.causal(100, block_size=16)
    )
    q, k, v = random_qkv(1, 100, heads_q, 16, heads_kv=heads_kv, requires_grad=True, seed=count)
    check_against_reference(q, k, v, layout, causal=True)


def test_layout_per_batch_element_and_empty_rows():
    mask = torch.rand(2, 1, 5, 4, generator=torch.Generator().manual_seed(5)) < 0.5
    mask[0, 0, 2] = False  # an empty row: zeros and lse = -inf
    layout = patterns.from_dense_mask(mask, seq_len_q=70, seq_len_kv=60, block_size=16)
    q, k, v = random_qkv(2, 70, 2, 16, seq_len_kv=60, requires_grad=True, seed=9)
    check_against_reference(q, k, v, layout)
    out, lse = block_sparse_attn_func(q, k, v, layout, return_lse=True)
    assert torch.all(out[0, 32:48] == 0) and torch.all(lse[0, :, 32:48] == float("-inf"))


def test_rows_emptied_by_the_causal_mask():
    # seq_len_kv > seq_len_q with top-left causal: fine; a block right of the diagonal alone
    # leaves its queries with nothing to see.
    mask = torch.tensor([[False, True], [True, True]])
    layout = patterns.from_dense_mask(mask, seq_len_q=32, block_size=16)
    q, k, v = random_qkv(1, 32, 1, 16, requires_grad=True, seed=4)
    check_against_reference(q, k, v, layout, causal=True)


def test_float64_matches_to_rounding():
    layout = patterns.bigbird(96, 16, 16, 1, block_size=16)
    q, k, v = random_qkv(1, 96, 2, 16, dtype=torch.float64, seed=2)
    out = block_sparse_attn_func(q, k, v, layout, causal=True, backend="torch")
    expected, _ = attention_reference(q, k, v, layout_mask(layout, 1, 2, causal=True))
    assert relative_error(out, expected) < 1e-13


def test_chunking_does_not_change_the_result():
    from flash_msa.ops import torch_ref

    layout = patterns.sliding_window(256, 64, block_size=16)
    q, k, v = random_qkv(1, 256, 2, 16, seed=6)
    options = dict(causal=True, window_size=(-1, -1), softmax_scale=0.25)
    whole = torch_ref.attention_forward(q, k, v, layout, **options)
    chunked = torch_ref.attention_forward(q, k, v, layout, **options, score_budget=1)
    for got, want in zip(chunked, whole, strict=True):  # one query block per chunk
        assert torch.equal(got, want)


def test_reference_against_an_explicit_softmax():
    q, k, v = random_qkv(1, 5, 1, 8, seq_len_kv=7, dtype=torch.float64, seed=8)
    mask = torch.rand(1, 1, 5, 7, generator=torch.Generator().manual_seed(0)) < 0.6
    mask[..., 0, :] = False
    out, lse = attention_reference(q, k, v, mask)
    for i in range(5):
        keys = mask[0, 0, i].nonzero().flatten().tolist()
        if not keys:
            assert torch.all(out[0, i] == 0) and lse[0, 0, i] == float("-inf")
            continue
        logits = torch.stack([q[0, i, 0] @ k[0, j, 0] for j in keys]) / 8**0.5
        weights = torch.softmax(logits, 0)
        expected = sum(w * v[0, j, 0] for w, j in zip(weights, keys, strict=True))
        assert torch.allclose(out[0, i, 0], expected, atol=1e-12)
        assert torch.isclose(lse[0, 0, i].double(), torch.logsumexp(logits, 0), atol=1e-6)


@pytest.mark.parametrize("std", [1, 4, 16, 40])
def test_float16_keeps_its_accuracy_as_inputs_grow(std):
    """Scores are accumulated and scaled in fp32, as the kernels do: against float64 the fp16
    output stays within twice the error of PyTorch's SDPA in fp16 (on the CPU), at any scale
    of the inputs (rounding q @ k^T to fp16 first lost 100x at std 40)."""
    layout = patterns.causal(128, block_size=32)
    q, k, v = random_qkv(1, 128, 2, 64, seed=std)
    q, k, v = (t.half() for t in (q * std, k * std, v))
    mask = layout_mask(layout, 1, 2, causal=True)
    exact, _ = attention_reference(*(t.double() for t in (q, k, v)), mask)
    out = block_sparse_attn_func(q, k, v, layout, causal=True, backend="torch")
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask
    ).transpose(1, 2)
    assert sdpa.dtype == torch.float16
    assert relative_error(out, exact) <= 2 * relative_error(sdpa, exact)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and not _env.interpreting(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)


@needs_triton
@pytest.mark.parametrize("seed", [0, 1234, 2**31 - 2, 2**40 + 5])  # the last: a high seed word
def test_dropout_keeps_what_the_kernels_keep(seed):
    """The torch backend's Philox bits are the kernels': its keep pattern is the mask
    flash_msa.ops.triton.dropout materialises, element for element."""
    from flash_msa.ops.torch_ref import dropout_keep
    from flash_msa.ops.triton.dropout import dropout_mask

    batch, heads, seq_len_q, seq_len_kv = 2, 3, 70, 90
    expected = dropout_mask(seed, 0.3, batch, heads, seq_len_q, seq_len_kv, DEVICE)
    index = [torch.arange(size, device=DEVICE) for size in (batch, heads, seq_len_q, seq_len_kv)]
    keep = dropout_keep(seed, 0.3, index[0][:, None, None, None], index[1][:, None, None],
                        index[2][:, None], index[3])  # fmt: skip
    assert torch.equal(keep, expected)


@needs_triton
def test_dropout_matches_the_triton_backend():
    """Same seed, same kept weights: the torch and triton backends agree on out and gradients
    (GQA, a layout per kv head, documents, a ragged end)."""
    layout = patterns.stack(
        [patterns.random_blocks(150, 2, seed=h, block_size=32, device=DEVICE) for h in range(2)]
    )
    document_ids = torch.tensor([[0] * 60 + [1] * 90], device=DEVICE)
    results = []
    for backend in ("torch", "triton"):
        q, k, v = random_qkv(1, 150, 4, 16, heads_kv=2, device=DEVICE, requires_grad=True, seed=7)
        torch.manual_seed(3)  # the call's dropout seed
        out = block_sparse_attn_func(q, k, v, layout, causal=True, dropout_p=0.4,
                                     document_ids=document_ids, backend=backend,
                                     deterministic=False)  # fmt: skip  # torch's on CUDA
        out.backward(torch.ones_like(out))
        results.append((out, q.grad, k.grad, v.grad))
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert relative_error(got, want) < 1e-5, name


def test_dropout_does_not_depend_on_chunking():
    from flash_msa.ops import torch_ref

    layout = patterns.sliding_window(256, 64, block_size=16)
    q, k, v = random_qkv(2, 256, 2, 16, seed=6)
    options = dict(causal=True, window_size=(-1, -1), softmax_scale=0.25, dropout_p=0.3,
                   dropout_seed=99)  # fmt: skip
    whole = torch_ref.attention_forward(q, k, v, layout, **options)
    for budget in (1, 20000):  # one query block per chunk; a few
        chunked = torch_ref.attention_forward(q, k, v, layout, **options, score_budget=budget)
        for got, want in zip(chunked, whole, strict=True):
            assert torch.equal(got, want)
