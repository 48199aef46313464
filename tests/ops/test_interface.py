"""Bad input gets a ValueError or TypeError that names the value and the fix."""

import warnings

import pytest
import torch

from flash_msa import (
    BlockLayout,
    _env,
    block_sparse_attn_func,
    block_sparse_attn_varlen_func,
    patterns,
)
from flash_msa.testing import random_qkv, relative_error

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not _env.interpreting(), reason="CPU interpreter runs"
)

LAYOUT = patterns.causal(64, block_size=16)


def inputs(**changes):
    q, k, v = random_qkv(2, 64, 4, 16, heads_kv=2)
    args = {"q": q, "k": k, "v": v, "layout": LAYOUT, **changes}
    return args


CASES = [
    ({"q": [1.0]}, {}, TypeError, "q must be a torch.Tensor, got list"),
    ({"q": torch.randn(64, 4, 16)}, {}, ValueError, r"q must be 4-D .* got shape \[64, 4, 16\]"),
    (
        {"k": torch.randn(2, 64, 2, 16).long()},
        {},
        TypeError,
        "k must be float16, .* got torch.int64",
    ),
    ({"v": torch.randn(2, 64, 2, 16).half()}, {}, TypeError, "share one dtype"),
    ({"v": torch.randn(2, 64, 2, 8)}, {}, ValueError, "k and v must have the same shape"),
    (
        {"k": torch.randn(1, 64, 2, 16), "v": torch.randn(1, 64, 2, 16)},
        {},
        ValueError,
        "q has batch 2 but k, v have batch 1",
    ),
    (
        {"k": torch.randn(2, 64, 3, 16), "v": torch.randn(2, 64, 3, 16)},
        {},
        ValueError,
        r"query heads \(4\) must be a positive multiple of key/value heads \(3\)",
    ),
    (
        {
            "q": torch.randn(2, 64, 4, 0),
            "k": torch.randn(2, 64, 2, 0),
            "v": torch.randn(2, 64, 2, 0),
        },
        {},
        ValueError,
        r"head_dim must be at least 1, got q of shape \[2, 64, 4, 0\]",
    ),
    (
        {
            "q": torch.randn(2, 64, 4, 264),
            "k": torch.randn(2, 64, 2, 264),
            "v": torch.randn(2, 64, 2, 264),
        },
        {"backend": "triton"},
        ValueError,
        "backend='triton' cannot run this call: triton takes head dims up to 256, not 264",
    ),
    (
        {"q": torch.randn(2, 64, 0, 16)},
        {},
        ValueError,
        r"query heads \(0\) must be a positive multiple of key/value heads \(2\)",
    ),
    ({"q": torch.randn(2, 64, 4, 8)}, {}, ValueError, "q has head_dim 8 but k, v have head_dim 16"),
    ({"layout": "causal"}, {}, TypeError, "layout must be a flash_msa.BlockLayout, got str"),
    (
        {"layout": patterns.causal(80, block_size=16)},
        {},
        ValueError,
        "layout is for seq_len_q=80, seq_len_kv=80 but q has 64",
    ),
    (
        {"layout": patterns.stack([LAYOUT] * 3)},
        {},
        ValueError,
        r"layout_heads 3 must divide H_q=4: query head h uses layout head",
    ),
    (
        {
            "layout": patterns.from_dense_mask(
                torch.ones(3, 1, 4, 4, dtype=torch.bool), seq_len_q=64, block_size=16
            )
        },
        {},
        ValueError,
        "layout_batch 3 must be 1 .* batch size 2",
    ),
    ({}, {"causal": 1}, TypeError, "causal must be a bool, got int"),
    ({}, {"window_size": (4,)}, ValueError, r"window_size must be \(left, right\)"),
    ({}, {"window_size": (-2, 0)}, ValueError, r"ints >= -1 .* got \(-2, 0\)"),
    ({}, {"softmax_scale": -1.0}, ValueError, "softmax_scale must be a positive finite"),
    ({}, {"softmax_scale": True}, ValueError, "softmax_scale must be a positive finite"),
    ({}, {"window_size": (True, False)}, ValueError, r"window_size must be \(left, right\)"),
    ({}, {"dropout_p": False}, ValueError, "dropout_p must be a float"),
    ({}, {"deterministic": 1}, TypeError, "deterministic must be a bool, got int"),
    ({}, {"backend": 3}, TypeError, "backend must be a str, got int"),
    ({}, {"dropout_p": 1.5}, ValueError, r"dropout_p must be a float in \[0, 1\), got 1.5"),
    ({}, {"backend": "cuda"}, ValueError, "backend must be 'auto' or one of .* got 'cuda'"),
    ({}, {"document_ids": torch.tensor([[0] * 32 + [2**32] * 32] * 2)}, ValueError,
     "document_ids must lie in int32's range"),
]


@pytest.mark.parametrize("changes, options, error, match", CASES)
def test_bad_input_is_rejected_with_the_fix(changes, options, error, match):
    args = inputs(**changes)
    with pytest.raises(error, match=match):
        block_sparse_attn_func(args["q"], args["k"], args["v"], args["layout"], **options)


def test_triton_backend_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.setattr(_env, "interpreting", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = inputs()
    with pytest.raises(ValueError, match="Triton kernels need CUDA tensors"):
        block_sparse_attn_func(args["q"], args["k"], args["v"], LAYOUT, backend="triton")


def test_interpreter_set_after_import_is_explained(monkeypatch):
    monkeypatch.setattr(_env, "interpreting", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = inputs()
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1 was set after flash_msa was"):
        block_sparse_attn_func(args["q"], args["k"], args["v"], LAYOUT, backend="triton")


@needs_interpreter
def test_float64_is_for_the_torch_backend_only():
    q, k, v = random_qkv(1, 64, 2, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match="triton' cannot run this call: triton takes float16, "):
        block_sparse_attn_func(q, k, v, LAYOUT, backend="triton")
    assert block_sparse_attn_func(q, k, v, LAYOUT).dtype == torch.float64


@needs_interpreter
def test_interpreted_bfloat16_is_rejected():
    q, k, v = random_qkv(1, 64, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="interpreter computes bfloat16 wrongly"):
        block_sparse_attn_func(q, k, v, LAYOUT, backend="triton")
    assert block_sparse_attn_func(q, k, v, LAYOUT).dtype == torch.bfloat16  # auto: torch


def test_layout_on_another_device_is_rejected():
    layout = LAYOUT.to("meta")
    args = inputs()
    with pytest.raises(
        ValueError, match=r"layout is on meta but q on cpu; use layout.to\(q.device\)"
    ):
        block_sparse_attn_func(args["q"], args["k"], args["v"], layout)


BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def attention_with_grads(q, k, v, layout, grad_out=None, **options):
    """(out, lse, dq, dk, dv) of one call with fresh leaves."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = block_sparse_attn_func(q, k, v, layout, return_lse=True, **options)
    if out.numel():
        out.backward(torch.ones_like(out) if grad_out is None else grad_out)
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in (q, k, v)]
    return out.detach(), lse, *grads


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_layout_tensors_give_the_contiguous_result(backend):
    good = patterns.causal(256, block_size=64)
    col_indices = torch.stack([good.col_indices, torch.zeros_like(good.col_indices)], 1)[:, 0]
    row_offsets = good.row_offsets.t().contiguous().t()  # column-major: strides (1, L)
    strided = BlockLayout(row_offsets, col_indices, seq_len_q=256, q_block=64)
    assert not strided.col_indices.is_contiguous()
    q, k, v = random_qkv(1, 256, 2, 16, heads_kv=1, seed=11)
    grad_out = torch.randn(1, 256, 2, 16, generator=torch.Generator().manual_seed(12))
    expected = attention_with_grads(q, k, v, good, grad_out, causal=True, backend=backend)
    actual = attention_with_grads(q, k, v, strided, grad_out, causal=True, backend=backend)
    for got, want in zip(actual, expected, strict=True):  # the torch backward reorders sums
        assert torch.equal(got, want) if backend == "triton" else relative_error(got, want) < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_layout_with_no_active_block_gives_zeros(backend):
    empty = patterns.from_dense_mask(torch.zeros(4, 4, dtype=torch.bool), seq_len_q=256,
                                     block_size=64)  # fmt: skip
    assert empty.nnz == 0
    q, k, v = random_qkv(1, 256, 2, 16, heads_kv=1, seed=13)
    out, lse, *grads = attention_with_grads(q, k, v, empty, causal=True, backend=backend)
    assert torch.equal(out, torch.zeros_like(q))
    assert torch.equal(lse, torch.full((1, 2, 256), float("-inf")))
    for grad, like in zip(grads, (q, k, v), strict=True):
        assert torch.equal(grad, torch.zeros_like(like))


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_zero_gives_empty_results(backend):
    q, k, v = random_qkv(0, 64, 4, 16, heads_kv=2)
    out, lse, dq, dk, dv = attention_with_grads(q, k, v, LAYOUT, causal=True, backend=backend)
    assert out.shape == (0, 64, 4, 16) and lse.shape == (0, 4, 64)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    block_sparse_attn_func(q, k, v, LAYOUT, backend=backend).sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


@pytest.mark.parametrize(
    "scale", [1e38, 3.4e38, 1e5, float("inf"), 10**400], ids=["1e38", "3.4e38", "1e5", "inf",
                                                              "10**400"]
)  # fmt: skip
def test_softmax_scales_that_overflow_are_refused(scale):
    args = inputs()
    with pytest.raises(ValueError, match=r"softmax_scale must be at most 10000, got .*: larger "
                                         "scales overflow the fp32 logits"):  # fmt: skip
        block_sparse_attn_func(args["q"], args["k"], args["v"], LAYOUT, softmax_scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_largest_softmax_scale_stays_finite(backend):
    q, k, v = random_qkv(1, 64, 2, 16, dtype=torch.float16, seed=14)
    q, k = q * 40, k * 40  # logits up to about 1e4 * 40 * 40 * 16: finite in fp32
    out, lse = block_sparse_attn_func(q, k, v, LAYOUT, causal=True, softmax_scale=1e4,
                                      return_lse=True, backend=backend)  # fmt: skip
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_return_lse_must_be_a_bool():
    args = inputs()
    with pytest.raises(TypeError, match="return_lse must be a bool, got int"):
        block_sparse_attn_func(args["q"], args["k"], args["v"], LAYOUT, return_lse=1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_longer_than_the_sequences_is_unbounded(backend):
    q, k, v = random_qkv(1, 64, 2, 16, seed=15)
    unbounded = block_sparse_attn_func(q, k, v, LAYOUT, causal=True, backend=backend)
    huge = block_sparse_attn_func(q, k, v, LAYOUT, causal=True, window_size=(2**70, 10**30),
                                  backend=backend)  # fmt: skip
    assert torch.equal(huge, unbounded)


@pytest.fixture
def eight_threads():
    """Eight CPU threads whatever the machine has: work split across threads is where
    an atomic accumulation (CPU index_put_ with accumulate does one) loses its order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(8)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_gradients_are_bitwise_equal(backend, eight_threads):
    layout = patterns.bigbird(256, 64, 64, 2, block_size=32)
    q, k, v = random_qkv(2, 256, 4, 32, heads_kv=2, seed=16)
    grad_out = torch.randn(2, 256, 4, 32, generator=torch.Generator().manual_seed(17))
    first, second = (
        attention_with_grads(q, k, v, layout, grad_out, causal=True, backend=backend)
        for _ in range(2)
    )  # deterministic=True is the default
    for one, two in zip(first, second, strict=True):
        assert torch.equal(one, two)


def test_layout_changed_in_place_is_refused():
    layout = patterns.causal(64, block_size=16)
    layout.col_indices[3] = 0
    args = inputs()
    with pytest.raises(ValueError, match="layout.col_indices was modified in place"):
        block_sparse_attn_func(args["q"], args["k"], args["v"], layout)


def test_a_strided_cu_seqlens_view_gives_the_contiguous_result():
    cu_seqlens = torch.tensor([0, 20, 20, 64], dtype=torch.int32)
    strided = torch.stack([cu_seqlens, cu_seqlens * 0], 1)[:, 0]
    q, k, v = (t[0] for t in random_qkv(1, 64, 2, 16, seed=18))
    layout = patterns.causal(64, block_size=16, cu_seqlens=cu_seqlens)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # searchsorted warned on strided boundaries
        out = block_sparse_attn_varlen_func(q, k, v, strided, 44, layout, causal=True)
    expected = block_sparse_attn_varlen_func(q, k, v, cu_seqlens, 44, layout, causal=True)
    assert torch.equal(out, expected)
