"""msa_func (block scores, selection, main attention, KL kernels) against the float64 eager MSA."""

import math

import pytest
import torch

from flash_msa import MSAAttention
from flash_msa.msa import msa_func, msa_reference
from flash_msa.msa.fp8 import FP8
from flash_msa.msa.interface import GRANULARITIES, select
from flash_msa.testing import fp8_exact_proxies, relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


def _inputs(batch, seq_len, heads, dim, proxy_dim, *, dtype=torch.float32, seed=0):
    """q_proxy, k_proxy, q, k, v for heads = (H_q, H_kv, H_p, H_pk), requiring grad."""
    heads_q, heads_kv, heads_proxy, heads_proxy_keys = heads
    generator = torch.Generator().manual_seed(seed)
    shapes = [
        (heads_proxy, proxy_dim), (heads_proxy_keys, proxy_dim), (heads_q, dim), (heads_kv, dim),
        (heads_kv, dim),
    ]  # fmt: skip
    return [
        torch.randn(batch, seq_len, h, d, generator=generator).to(DEVICE, dtype).requires_grad_()
        for h, d in shapes
    ]


def _gradients(out, kl_loss, tensors, grad_out):
    """(grads of sum(out * grad_out) for q, k, v; grads of kl_loss for q_proxy, k_proxy), in
    one backward: out does not depend on the proxies, nor kl_loss on q, k, v."""
    grads = torch.autograd.grad([out, kl_loss], tensors, [grad_out, torch.ones_like(kl_loss)])
    return grads[2:], grads[:2]


def _element_mask(selection, seq_len):
    """bool [L, S, S]: the (query, key) pairs of the selection's blocks whose query chose them
    (every query of the row without query_masks), before the causal mask."""
    layout, words = selection
    q_block, kv_block = layout.q_block, layout.kv_block
    offsets = layout.row_offsets.cpu()  # [L, nq + 1]
    columns = layout.col_indices.cpu().tolist()
    mask = torch.zeros(offsets.shape[0], seq_len, seq_len, dtype=torch.bool)
    for index in range(offsets.shape[0]):
        for row in range(offsets.shape[1] - 1):
            for entry in range(int(offsets[index, row]), int(offsets[index, row + 1])):
                keys = slice(columns[entry] * kv_block, (columns[entry] + 1) * kv_block)
                for bit in range(min(q_block, seq_len - row * q_block)):
                    if words is None or int(words[entry]) >> bit & 1:
                        mask[index, row * q_block + bit, keys] = True
    return mask


def _check_against_reference(
    tensors, grad_out, top_k, q_block, kv_block, warmup, documents=None, granularity="token"
):
    out, kl_loss, selection = msa_func(
        *tensors, top_k=top_k, q_block=q_block, kv_block=kv_block, warmup=warmup,
        granularity=granularity, return_selection=True,
        **({} if documents is None else {"cu_seqlens": documents[1]}),
    )  # fmt: skip
    exact = [t.detach().cpu().double().requires_grad_() for t in tensors]
    if documents is not None:  # packed [T, H, D]: the reference runs it as one row [1, T, H, D]
        exact = [t.detach()[None].requires_grad_() for t in exact]
        grad_out = grad_out[None]
    expected, expected_kl, expected_mask = msa_reference(
        *exact, top_k=top_k, q_block=q_block, kv_block=kv_block, warmup=warmup,
        document_ids=None if documents is None else documents[0][None].cpu(),
        granularity=granularity,
    )  # fmt: skip
    assert relative_error(out.reshape(expected.shape), expected) < 1e-5
    assert abs(kl_loss.item() - expected_kl.item()) < 1e-5 * max(1.0, expected_kl.item())
    seq_len = expected.shape[1]
    visible = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    if documents is not None:
        ids = documents[0].cpu()
        visible &= ids[:, None] == ids[None, :]
    mask = _element_mask(selection, seq_len) & visible  # [L, S, S]
    assert torch.equal(mask.expand(expected_mask.flatten(0, 1).shape), expected_mask.flatten(0, 1))
    main, proxy = _gradients(
        out, kl_loss, tensors, grad_out.to(out.dtype).to(DEVICE).reshape(out.shape)
    )
    expected_main, expected_proxy = _gradients(expected, expected_kl, exact, grad_out.double())
    for got, want in zip([*main, *proxy], [*expected_main, *expected_proxy], strict=True):
        assert relative_error(got.reshape(want.shape), want) < 1e-5


# (B, S, (H_q, H_kv, H_p, H_pk), D, D_p, q_block, kv_block, top_k)
CASES = {
    "gqa-ragged": (2, 130, (4, 2, 2, 1), 16, 16, 16, 32, 3),
    "equal-blocks": (1, 100, (2, 1, 2, 2), 16, 32, 32, 32, 2),
    "top1-one-proxy": (1, 96, (4, 1, 1, 1), 32, 16, 16, 32, 1),
    "topk-beyond-blocks": (1, 80, (2, 2, 2, 1), 16, 16, 16, 16, 100),
    # q_block 1: a layout row per token, its tiles the 16 query heads of its proxy head
    "token-rows": (1, 70, (16, 1, 1, 1), 16, 16, 1, 32, 2),
    # q_block 8: tiles of 8 tokens x 2 heads, and 4 tokens x 4 heads
    "eight-token-rows": (1, 75, (4, 2, 2, 1), 16, 16, 8, 32, 2),
    "four-token-rows": (1, 75, (8, 1, 2, 1), 16, 16, 4, 16, 3),
}


@pytest.mark.parametrize("name", CASES)
def test_msa_func_matches_reference(name, poisoned_allocations):
    batch, seq_len, heads, dim, proxy_dim, q_block, kv_block, top_k = CASES[name]
    tensors = _inputs(batch, seq_len, heads, dim, proxy_dim, seed=len(name))
    grad_out = torch.randn(
        batch, seq_len, heads[0], dim, generator=torch.Generator().manual_seed(1)
    )
    _check_against_reference(tensors, grad_out, top_k, q_block, kv_block, warmup=False)


@pytest.mark.parametrize(
    "q_block, kv_block, kl_q_block", [(2, 32, 16), (8, 16, 16), (16, 32, 16), (1, 32, 1)]
)
def test_kl_tiles_hold_each_tokens_choices(q_block, kv_block, kl_q_block):
    """Tiles of 2 to 8 tokens leave the KL walking tiles of 16 over the
    same per-token choices; other tiles are the main attention's own."""
    q_proxy, k_proxy = _inputs(1, 150, (4, 2, 2, 1), 16, 16, seed=q_block)[:2]
    main, kl = select(
        q_proxy, k_proxy, top_k=3, q_block=q_block, kv_block=kv_block, proxy_softmax_scale=0.25,
        granularity="token", warmup=False, document_ids=None, cu_seqlens=None,
    )  # fmt: skip
    assert (main.layout.q_block, kl.layout.q_block) == (q_block, kl_q_block)
    assert (kl is main) == (kl_q_block == q_block)
    assert torch.equal(_element_mask(kl, 150), _element_mask(main, 150))


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("name", ["q_proxy", "k_proxy", "q", "k"])
def test_a_nan_input_gives_a_nan_kl(name, granularity):
    """One NaN element in an input makes kl_loss NaN (as PyTorch's own arithmetic would),
    never a finite loss that hides it; in q or k it reaches the output too."""
    tensors = [t.detach() for t in _inputs(1, 150, (4, 2, 2, 1), 16, 16, seed=9)]
    index = ["q_proxy", "k_proxy", "q", "k"].index(name)
    tensors[index][0, 70, 0, 3] = float("nan")
    out, kl_loss = msa_func(*tensors, top_k=2, q_block=16, kv_block=32, granularity=granularity)
    assert kl_loss.isnan()
    assert out.isnan().any() == (name in ("q", "k"))


@pytest.mark.parametrize(
    "heads, q_block",
    [((16, 1, 1, 1), 8), ((32, 2, 2, 1), 8), ((24, 1, 1, 1), 16), ((8, 1, 1, 1), 16)],
)
def test_default_token_tiles_follow_the_heads_a_proxy_head_packs(heads, q_block):
    """q_block None: tiles of 8 tokens where a proxy head's query heads pack 16 or more to a
    tile (24 heads pack 8), else 16; the layer takes the same default."""
    tensors = _inputs(1, 40, heads, 16, 16)
    _, _, selection = msa_func(*tensors, top_k=2, kv_block=32, return_selection=True)
    assert selection.layout.q_block == q_block
    layer = MSAAttention(16 * heads[0], heads[0], num_kv_heads=heads[1],
                         num_proxy_heads=heads[2], proxy_head_dim=16)  # fmt: skip
    assert layer.q_block == q_block
    assert MSAAttention(16 * heads[0], heads[0], num_kv_heads=heads[1], num_proxy_heads=heads[2],
                        granularity="block").q_block == 64  # fmt: skip


def test_warmup_is_dense_causal_with_the_full_kl(poisoned_allocations):
    tensors = _inputs(1, 110, (4, 2, 2, 1), 16, 16, seed=5)
    grad_out = torch.randn(1, 110, 4, 16, generator=torch.Generator().manual_seed(2))
    _check_against_reference(tensors, grad_out, 1, 16, 32, warmup=True)


@pytest.mark.parametrize(
    "warmup, heads, q_block",
    [(False, (4, 2, 2, 1), 16), (True, (4, 2, 2, 1), 16), (False, (16, 1, 1, 1), 1)],
)
def test_packed_documents_never_cross(warmup, heads, q_block, poisoned_allocations):
    """Empty and one-token documents; selection, attention and KL stay within documents."""
    lengths = [0, 1, 45, 1, 70, 20] if q_block > 1 else [0, 1, 30, 1, 25]  # 16 heads: shorter
    bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).int()
    total = sum(lengths)
    tensors = [t.detach()[0].requires_grad_() for t in _inputs(1, total, heads, 16, 16)]
    grad_out = torch.randn(total, heads[0], 16, generator=torch.Generator().manual_seed(3))
    documents = (ids.to(DEVICE), bounds.to(DEVICE))
    _check_against_reference(tensors, grad_out, 2, q_block, 32, warmup, documents)


def test_kl_loss_leaves_the_main_gradients_alone():
    tensors = _inputs(1, 64, (2, 1, 1, 1), 16, 16, seed=9)
    out, kl_loss = msa_func(*tensors, top_k=2, q_block=16, kv_block=16)
    assert kl_loss.dim() == 0 and kl_loss.dtype == torch.float32 and kl_loss.item() > 0
    kl_loss.backward()
    assert all(t.grad is None for t in tensors[2:])
    assert all(bool(t.grad.abs().sum() > 0) for t in tensors[:2])


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda t: (t[0][0], *t[1:]), ValueError, r"q_proxy must be 4-D \[B, S, H, D\]"),
        (lambda t: (*t[:2], t[2].double(), *t[3:]), TypeError, "float64"),
        (lambda t: (t[0].half(), *t[1:]), ValueError, "one dtype on one device"),
        (lambda t: (*t[:2], t[2][:, :, :3], *t[3:]), ValueError, r"H_q \(3\) a multiple of H_p"),
        (lambda t: (t[0], t[1][:, :10], *t[2:]), ValueError, "must agree in B and S"),
        (lambda t: (*t[:4], t[4][..., :8]), ValueError, "must match"),
        (lambda t: (t[0], t[1][..., :8], *t[2:]), ValueError, "head dims differ"),
        (lambda t: (*t[:2], None, *t[3:]), TypeError, "q must be a torch.Tensor"),
    ],
)
def test_msa_func_rejects_bad_tensors(change, error, match):
    tensors = [t.detach() for t in _inputs(1, 32, (4, 2, 2, 1), 16, 16)]
    with pytest.raises(error, match=match):
        msa_func(*change(tensors), top_k=2, q_block=16, kv_block=16)


@pytest.mark.parametrize("option", ["warmup", "deterministic", "return_selection"])
def test_msa_func_rejects_flags_that_are_not_bools(option):
    tensors = [t.detach() for t in _inputs(1, 32, (4, 2, 2, 1), 16, 16)]
    with pytest.raises(TypeError, match=f"{option} must be a bool, got 'yes'"):
        msa_func(*tensors, top_k=2, q_block=16, kv_block=16, **{option: "yes"})


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_reaches_the_main_attention(monkeypatch, deterministic):
    """msa_func's and MSAAttention's deterministic flag is the main attention's, with the
    same outputs either way where the backend has one backward (the CPU's)."""
    from flash_msa.msa import interface

    seen = []
    attention = interface.block_sparse_attn_func

    def recording(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return attention(*args, **kwargs)

    monkeypatch.setattr(interface, "block_sparse_attn_func", recording)
    tensors = [t.detach() for t in _inputs(1, 32, (4, 2, 2, 1), 16, 16)]
    out, kl_loss = msa_func(*tensors, top_k=2, q_block=16, kv_block=16,
                            deterministic=deterministic)  # fmt: skip
    expected = msa_func(*tensors, top_k=2, q_block=16, kv_block=16)
    assert torch.equal(out, expected[0]) and torch.equal(kl_loss, expected[1])
    layer = MSAAttention(32, 4, num_kv_heads=2, num_proxy_heads=2, proxy_head_dim=16, top_k=2,
                         q_block=16, kv_block=16, deterministic=deterministic, device=DEVICE)
    layer(torch.randn(1, 32, 32, device=DEVICE))
    assert seen == [deterministic, True, deterministic]
    with pytest.raises(TypeError, match="deterministic must be a bool, got int"):
        MSAAttention(32, 4, num_kv_heads=2, num_proxy_heads=2, deterministic=1)


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter runs on the CPU")
def test_msa_func_rejects_bfloat16_on_the_interpreter():
    tensors = [t.detach().bfloat16() for t in _inputs(1, 32, (4, 2, 2, 1), 16, 16)]
    with pytest.raises(TypeError, match="interpreter computes bfloat16 wrongly"):
        msa_func(*tensors, top_k=2, q_block=16, kv_block=16)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(top_k=0), "top_k must be a positive int"),
        (dict(q_block=48), "q_block must be one of"),
        (
            dict(q_block=1),
            "q_block 1 with H_q / H_p = 2 query heads per proxy head fills tiles of 2 rows",
        ),
        (dict(q_block=1, granularity="block"), "q_block must be one of"),
        (dict(q_block=32, kv_block=16), r"q_block \(32\) must be <= kv_block \(16\)"),
        (dict(cu_seqlens=torch.tensor([0, 32], dtype=torch.int32)), "must be 3-D"),
        (dict(proxy_softmax_scale=1e38), "proxy_softmax_scale must be at most 10000"),
        (dict(proxy_softmax_scale=True), "proxy_softmax_scale must be a positive finite"),
        (dict(softmax_scale=1e38), "softmax_scale must be at most 10000"),
        (dict(score_dtype=torch.float16), "score_dtype must be None"),
    ],
)
def test_msa_func_rejects_bad_options(options, match):
    tensors = [t.detach() for t in _inputs(1, 32, (4, 2, 2, 1), 16, 16)]
    with pytest.raises(ValueError, match=match):
        msa_func(*tensors, **{"q_block": 16, "kv_block": 16, **options})


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_top_k_past_the_kv_blocks_keeps_them_all(granularity):
    """A top_k beyond the sequence's kv blocks (here beyond int64) selects what top_k equal to
    their count selects: every visible block."""
    tensors = [t.detach() for t in _inputs(1, 64, (4, 2, 2, 1), 16, 16)]
    options = dict(q_block=16, kv_block=16, granularity=granularity, return_selection=True)
    out, kl_loss, selection = msa_func(*tensors, top_k=2**70, **options)
    expected_out, expected_kl, expected = msa_func(*tensors, top_k=4, **options)  # 4 blocks
    assert torch.equal(selection.layout.row_offsets, expected.layout.row_offsets)
    assert torch.equal(selection.layout.col_indices, expected.layout.col_indices)
    assert torch.equal(out, expected_out) and torch.equal(kl_loss, expected_kl)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fp8_scores_run_the_step_over_the_same_selection(granularity):
    """score_dtype FP8 on proxies it holds exactly: the same selection, out and kl_loss."""
    q_proxy, k_proxy = fp8_exact_proxies(1, 160, 2, 1, 16, 32, seed=3, device=DEVICE)
    q, k, v = (t.detach() for t in _inputs(1, 160, (4, 2, 2, 1), 16, 16, seed=3)[2:])
    options = dict(top_k=2, q_block=16, kv_block=32, return_selection=True,
                   granularity=granularity)  # fmt: skip
    out, kl_loss, selection = msa_func(q_proxy, k_proxy, q, k, v, score_dtype=FP8, **options)
    expected_out, expected_kl, expected = msa_func(q_proxy, k_proxy, q, k, v, **options)
    assert torch.equal(selection.layout.col_indices, expected.layout.col_indices)
    if granularity == "token":
        assert torch.equal(selection.query_masks, expected.query_masks)
    assert torch.equal(out, expected_out) and torch.equal(kl_loss, expected_kl)


@pytest.mark.gpu
@pytest.mark.parametrize("q_block", [None, 8, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_msa_func_half_precision_on_gpu(dtype, q_block):
    """MSA's shapes (kv_block 128, 16 query heads per proxy head, D = D_p = 128; per-token
    tiles of the default 16 tokens, 8 and 4): out, kl_loss and the proxy gradients within a
    few half-precision ulps of float64, relative to the size of each."""
    tensors = _inputs(1, 1000, (16, 1, 1, 1), 128, 128, dtype=dtype, seed=4)
    grad_out = torch.randn(1, 1000, 16, 128, generator=torch.Generator().manual_seed(6))
    out, kl_loss = msa_func(*tensors, top_k=4, q_block=q_block)
    exact = [t.detach().cpu().double().requires_grad_() for t in tensors]
    expected, expected_kl, _ = msa_reference(*exact, top_k=4, q_block=64, kv_block=128)
    tolerance = 2 * 2.0 ** -(8 if dtype == torch.bfloat16 else 11)
    assert relative_error(out, expected) < tolerance
    assert math.isclose(kl_loss.item(), expected_kl.item(), rel_tol=tolerance)
    main, proxy = _gradients(out, kl_loss, tensors, grad_out.to(DEVICE, dtype))
    expected_main, expected_proxy = _gradients(expected, expected_kl, exact, grad_out.double())
    for got, want in zip([*main, *proxy], [*expected_main, *expected_proxy], strict=True):
        assert relative_error(got, want) < 4 * tolerance


@pytest.mark.parametrize(
    "warmup, granularity", [(False, "token"), (False, "block"), (True, "token")]
)
def test_compiled_msa_func_matches_eager(warmup, granularity):
    """torch.compile(fullgraph=True) traces the whole step: scores, selection, main attention
    and KL are custom ops or static-shape tensor code (the per-token selection's union size
    is one data-dependent symbol)."""
    torch._dynamo.reset()
    tensors = _inputs(1, 200, (4, 2, 2, 1), 16, 16, seed=4)
    grad_out = torch.randn(tensors[2].shape, generator=torch.Generator().manual_seed(5))

    def step(*tensors):
        return msa_func(
            *tensors, top_k=2, q_block=32, kv_block=64, warmup=warmup, granularity=granularity
        )

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for run in (compiled, step):
        out, kl_loss = run(*tensors)
        results.append((out, kl_loss, *_gradients(out, kl_loss, tensors, grad_out.to(DEVICE))))
    (out, kl_loss, main, proxy), (out_eager, kl_eager, main_eager, proxy_eager) = results
    assert torch.equal(out, out_eager) and torch.equal(kl_loss, kl_eager)
    for got, want in zip((*main, *proxy), (*main_eager, *proxy_eager), strict=True):
        assert relative_error(got, want) < 1e-6


@pytest.mark.parametrize("heads", [(4, 2, 0, 1), (4, 0, 2, 1), (4, 2, 2, 0)])
def test_msa_func_rejects_zero_heads(heads):
    tensors = [t.detach() for t in _inputs(1, 32, heads, 16, 16)]
    with pytest.raises(ValueError, match="every head count and head dim must be at least 1"):
        msa_func(*tensors, q_block=16, kv_block=16)


def test_msa_func_on_an_empty_batch():
    """Batch 0: empty out, a zero loss, zero-sized gradients (no division by zero)."""
    tensors = _inputs(0, 64, (4, 2, 2, 1), 16, 16)
    out, kl_loss = msa_func(*tensors, top_k=2, q_block=16, kv_block=32)
    assert out.shape == tensors[2].shape and float(kl_loss) == 0.0
    (out.sum() + kl_loss).backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in tensors)
