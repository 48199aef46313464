"""select_tokens (Triton, interpreter on CPU) and token_selection_layout against float64 and
loop references."""

import json
import math

import pytest
import torch

from flash_msa.msa import (
    select_tokens,
    select_tokens_reference,
    token_selection,
    token_selection_layout,
)
from flash_msa.msa import token_selection_gluon as gluon_selection
from flash_msa.msa.fp8 import FP8, quantize_proxies
from flash_msa.sequences import document_ids_of
from flash_msa.testing import fp8_exact_proxies

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
POISON = 0x5A5A5A5A  # an int32 that is no block index and not -1


@pytest.fixture
def poisoned(poisoned_allocations, monkeypatch):
    """Besides NaN floats, fill every int32 buffer torch.empty allocates with POISON."""
    empty = torch.empty

    def poison(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        return tensor.fill_(POISON) if tensor.dtype == torch.int32 else tensor

    monkeypatch.setattr(torch, "empty", poison)


def _inputs(batch, seq_len, heads, heads_keys, dim, *, seed, dtype=torch.float32, device=DEVICE):
    """Normal q_proxy, k_proxy rounded to multiples of 1/16 in [-4, 4]: every product and sum
    is exact in fp32 (and the values in bf16), so the kernel's logits equal float64's and
    the rare ties are ties in both."""
    generator = torch.Generator().manual_seed(seed)

    def draw(heads_count):
        values = torch.randn(batch, seq_len, heads_count, dim, generator=generator)
        return ((values * 16).round().clamp(-64, 64) / 16).to(device, dtype)

    return draw(heads), draw(heads_keys)


def _documents(batch, seq_len, bounds):
    """int32 [batch, S]: the same documents (cu_seqlens-like bounds) in every batch row."""
    cu_seqlens = torch.tensor([0, *bounds, seq_len], dtype=torch.int32)
    return document_ids_of(cu_seqlens)[None].expand(batch, -1).to(DEVICE)


# (B, S, H_p, H_pk, D_p, kv_block, top_k, document bounds): ragged lengths; tiles (128 rows
# under the interpreter) of several own blocks (64 or 128 tokens on kv_block 16 or 32) and
# inside one (32 tokens on kv_block 64 or 128); packed proxy heads (2 and 4 per key head) and
# one per key head; a D_p that is no power of two; top_k 1, 3, 4, 5 and 16; documents, one
# of a single token.
GEOMETRIES = [
    (2, 200, 4, 2, 16, 32, 4, None),
    (1, 333, 4, 1, 24, 64, 3, None),
    (1, 300, 1, 1, 16, 16, 1, None),
    (1, 512, 1, 1, 16, 16, 16, None),
    (2, 256, 2, 1, 32, 16, 5, (50, 51, 120, 200)),
    (1, 250, 4, 4, 16, 32, 3, (70, 160)),
    (1, 400, 4, 1, 16, 128, 3, (150,)),
]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_select_tokens_match_reference(geometry, poisoned):
    batch, seq_len, heads, heads_keys, dim, kv_block, top_k, bounds = geometry
    q_proxy, k_proxy = _inputs(batch, seq_len, heads, heads_keys, dim, seed=seq_len)
    document_ids = None if bounds is None else _documents(batch, seq_len, bounds)
    selected = select_tokens(q_proxy, k_proxy, top_k=top_k, kv_block=kv_block,
                             document_ids=document_ids)  # fmt: skip
    expected = select_tokens_reference(q_proxy, k_proxy, top_k=top_k, kv_block=kv_block,
                                       document_ids=document_ids)  # fmt: skip
    assert selected.dtype == torch.int32
    assert selected.shape == (batch, heads, seq_len, top_k)
    assert torch.equal(selected, expected)


@pytest.mark.parametrize("geometry", [GEOMETRIES[0], GEOMETRIES[1], GEOMETRIES[4]], ids=str)
def test_fp8_scores_match_reference_on_inputs_fp8_holds(geometry, poisoned):
    """score_dtype FP8 through quantize_proxies: per-row and per-block factors, ragged last
    blocks, packed heads and documents."""
    batch, seq_len, heads, heads_keys, dim, kv_block, top_k, bounds = geometry
    q_proxy, k_proxy = fp8_exact_proxies(batch, seq_len, heads, heads_keys, dim, kv_block,
                                         seed=seq_len, device=DEVICE)  # fmt: skip
    document_ids = None if bounds is None else _documents(batch, seq_len, bounds)
    selected = select_tokens(q_proxy, k_proxy, top_k=top_k, kv_block=kv_block,
                             document_ids=document_ids, score_dtype=FP8)  # fmt: skip
    expected = select_tokens_reference(q_proxy, k_proxy, top_k=top_k, kv_block=kv_block,
                                       document_ids=document_ids)  # fmt: skip
    assert torch.equal(selected, expected)


def test_quantize_proxies_scales_rows_and_blocks():
    """q8 rows reach 448, q8 * q_scales and k8 * k_scales are the proxies to e4m3's rounding
    (3 mantissa bits), and all-zero rows and blocks keep the factor 1."""
    generator = torch.Generator().manual_seed(1)
    q_proxy = torch.randn(2, 70, 4, 16, generator=generator)
    q_proxy[:, 5] = 0
    k_proxy = torch.randn(2, 70, 2, 16, generator=generator) * 5
    k_proxy[:, 32:64] = 0  # block 1 of 32
    quantized = quantize_proxies(q_proxy.to(DEVICE), k_proxy.to(DEVICE), 32)
    q8, q_scales, k8, k_scales = (tensor.cpu() for tensor in quantized)
    assert (q8.dtype, k8.dtype) == (FP8, FP8)
    assert (q_scales.shape, k_scales.shape) == ((2, 70, 4), (2, 2, 3))
    rows = q8.float().abs().amax(-1)
    assert torch.equal(rows[:, 5], torch.zeros(2, 4))
    assert torch.equal(q_scales[:, 5], torch.ones(2, 4))
    assert torch.equal(rows[:, :5], torch.full((2, 5, 4), 448.0))
    row_error = (q8.float() * q_scales[..., None] - q_proxy).abs()
    assert (row_error <= q_scales[..., None] * 448 * 2**-4).all()
    assert torch.equal(k_scales[:, :, 1], torch.ones(2, 2))
    factors = k_scales.transpose(1, 2).repeat_interleave(32, dim=1)[:, :70, :, None]
    block_amax = factors * 448  # each block's largest magnitude
    error = (k8.float() * factors - k_proxy).abs()
    assert (error <= block_amax * 2**-4).all()


def quantize_reference(q_proxy, k_proxy, kv_block):
    """quantize_proxies in torch ops, rounding as the kernels do: a row's factor is
    (1 / its largest magnitude) x 448, a factor's inverse its largest magnitude x fp32(1 / 448),
    and keys are divided by their block's inverse factor."""
    inverse = torch.tensor(1 / 448, dtype=torch.float32)
    q_amax = q_proxy.abs().amax(-1, keepdim=True).float()
    factor = torch.where(q_amax > 0, q_amax, 448.0).reciprocal() * 448.0
    q8 = (q_proxy.float() * factor).to(FP8)
    q_scales = torch.where(q_amax > 0, q_amax * inverse, 1.0)[..., 0]
    batch, seq_len, heads_keys, _ = k_proxy.shape
    blocks = -(-seq_len // kv_block)
    key_amax = k_proxy.abs().amax(-1).float()
    padded = torch.nn.functional.pad(key_amax, (0, 0, 0, blocks * kv_block - seq_len))
    block_amax = padded.view(batch, blocks, kv_block, heads_keys).amax(2)
    k_scales = torch.where(block_amax > 0, block_amax * inverse, 1.0)  # [B, blocks, H_pk]
    key_scales = k_scales.repeat_interleave(kv_block, dim=1)[:, :seq_len, :, None]
    k8 = (k_proxy.float() / key_scales).to(FP8)
    return q8, q_scales, k8, k_scales.transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "shape", [(2, 70, 70, 4, 2, 16, 32), (1, 300, 300, 2, 1, 48, 128), (2, 40, 130, 4, 1, 16, 32)],
    ids=str,
)
def test_quantize_proxies_rounds_as_the_reference(shape, dtype, poisoned_allocations):
    """The quantization kernels equal quantize_reference bit for bit: ragged last blocks, a
    head dim that is not a power of two, strided proxies, zero rows and blocks, and fewer
    query rows than keys (a context-parallel rank's queries against every key)."""
    batch, query_len, seq_len, heads, heads_keys, dim, kv_block = shape
    generator = torch.Generator().manual_seed(seq_len)
    q_proxy = torch.randn(batch, heads, query_len, dim, generator=generator).transpose(1, 2)
    q_proxy = (q_proxy * 3).to(dtype)  # [B, S_q, H_p, D], strided
    q_proxy[:, 5] = 0
    k_proxy = (torch.randn(batch, seq_len, heads_keys, dim, generator=generator) * 5).to(dtype)
    k_proxy[:, kv_block : 2 * kv_block] = 0  # block 1
    q_proxy, k_proxy = q_proxy.to(DEVICE), k_proxy.to(DEVICE)
    actual = quantize_proxies(q_proxy, k_proxy, kv_block)
    expected = quantize_reference(q_proxy, k_proxy, kv_block)
    for got, want in zip(actual, expected, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.float(), want.float())


def test_fp8_scores_agree_with_fp32_on_most_choices():
    """On normal proxies FP8 keeps nearly every choice of fp32 scoring (only near ties differ)."""
    generator = torch.Generator().manual_seed(2)
    q_proxy = torch.randn(1, 512, 2, 32, generator=generator).to(DEVICE)
    k_proxy = torch.randn(1, 512, 1, 32, generator=generator).to(DEVICE)
    options = dict(top_k=4, kv_block=32)
    fp8 = select_tokens(q_proxy, k_proxy, score_dtype=FP8, **options)
    fp32 = select_tokens(q_proxy, k_proxy, **options)
    assert (fp8 == fp32).float().mean() > 0.95


def _padded(rows, top_k):
    """int32 [len(rows), top_k] from lists of blocks, padded with -1."""
    return torch.tensor([row + [-1] * (top_k - len(row)) for row in rows], dtype=torch.int32)


def test_select_tokens_ties_go_to_the_lower_block(poisoned):
    """Keys repeat every kv block, so for a token every earlier block scores the same: it
    keeps blocks 0 .. top_k - 2 and its own."""
    q_proxy, k_proxy = _inputs(1, 200, 2, 1, 16, seed=3)
    k_proxy = k_proxy[:, :16].repeat(1, 13, 1, 1)[:, :200].contiguous()
    selected = select_tokens(q_proxy, k_proxy, top_k=4, kv_block=16)
    own = (torch.arange(200) // 16).tolist()
    expected = _padded([sorted({*range(min(3, block)), block}) for block in own], 4)
    assert torch.equal(selected[0].cpu(), expected.expand(2, -1, -1))
    reference = select_tokens_reference(q_proxy, k_proxy, top_k=4, kv_block=16)
    assert torch.equal(selected, reference)


def test_select_tokens_keep_every_visible_block_when_top_k_exceeds_them(poisoned):
    """top_k past the number of blocks: each token keeps all causal blocks, then -1."""
    q_proxy, k_proxy = _inputs(1, 100, 2, 2, 16, seed=4)
    selected = select_tokens(q_proxy, k_proxy, top_k=7, kv_block=32)  # 4 blocks
    expected = _padded([list(range(token // 32 + 1)) for token in range(100)], 7)
    assert torch.equal(selected[0].cpu(), expected.expand(2, -1, -1))


def test_select_tokens_strided_inputs_and_scale(poisoned):
    """[B, S, H, D] views of [B, H, S, D] storage; a positive scale changes no choice."""
    q_proxy, k_proxy = _inputs(2, 150, 4, 2, 16, seed=5)
    q_strided = q_proxy.transpose(1, 2).contiguous().transpose(1, 2)
    k_strided = k_proxy.transpose(1, 2).contiguous().transpose(1, 2)
    selected = select_tokens(q_strided, k_strided, top_k=3, kv_block=32, proxy_softmax_scale=3.0)
    reference = select_tokens_reference(q_proxy, k_proxy, top_k=3, kv_block=32)
    assert torch.equal(selected, reference)


@pytest.mark.parametrize("bounds", [None, (70, 71, 200)], ids=["no-documents", "documents"])
def test_select_tokens_of_some_query_blocks(bounds, poisoned):
    """q_blocks (context parallelism): the rows of some query blocks, in any order, against
    the keys of the whole sequence select as the whole sequence's rows do."""
    q_proxy, k_proxy = _inputs(2, 300, 4, 2, 16, seed=6)
    document_ids = None if bounds is None else _documents(2, 300, bounds)
    q_blocks = torch.tensor([3, 0, 1, 4], device=DEVICE)  # 4: the ragged last (256-299)
    rows = torch.cat([torch.arange(64 * b, min(64 * b + 64, 300)) for b in q_blocks.tolist()])
    selected = select_tokens(
        q_proxy[:, rows.to(DEVICE)], k_proxy, top_k=3, kv_block=32, document_ids=document_ids,
        q_blocks=q_blocks, q_block=64,
    )  # fmt: skip
    whole = select_tokens_reference(q_proxy, k_proxy, top_k=3, kv_block=32,
                                    document_ids=document_ids)  # fmt: skip
    assert torch.equal(selected, whole[:, :, rows.to(DEVICE)])
    layout, words = token_selection_layout(
        selected, seq_len=rows.numel(), q_block=64, kv_block=32, seq_len_kv=300
    )
    assert (layout.seq_len_q, layout.seq_len_kv, layout.num_q_blocks) == (300 - 64, 300, 4)
    with pytest.raises(ValueError, match="q_blocks and q_block together"):
        select_tokens(q_proxy, k_proxy, top_k=3, kv_block=32, q_blocks=q_blocks)


def test_select_tokens_reference_brute_force():
    """The reference against the definition, token by token."""
    q_proxy, k_proxy = _inputs(1, 40, 2, 1, 8, seed=6, dtype=torch.float64, device="cpu")
    document_ids = torch.tensor([[0] * 7 + [1] * 30 + [2] * 3])
    selected = select_tokens_reference(
        q_proxy, k_proxy, top_k=3, kv_block=8, proxy_softmax_scale=0.5, document_ids=document_ids
    )
    documents = document_ids[0].tolist()
    for head in range(2):
        rows = []
        for i in range(40):
            scores = {}
            for j in range(i + 1):
                if documents[j] == documents[i] and j // 8 != i // 8:
                    logit = 0.5 * float(q_proxy[0, i, head] @ k_proxy[0, j, 0])
                    scores[j // 8] = max(scores.get(j // 8, -math.inf), logit)
            best = sorted(scores, key=lambda block: (-scores[block], block))[:2]
            rows.append(sorted([*best, i // 8]))
        assert torch.equal(selected[0, head], _padded(rows, 3))


def test_select_tokens_compile_in_one_graph():
    torch._dynamo.reset()
    q_proxy, k_proxy = _inputs(1, 100, 2, 1, 16, seed=8)

    def select(q_proxy, k_proxy):
        return select_tokens(q_proxy, k_proxy, top_k=3, kv_block=16)

    compiled = torch.compile(select, fullgraph=True, backend="aot_eager")(q_proxy, k_proxy)
    assert torch.equal(compiled, select(q_proxy, k_proxy))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "geometry",
    [(1, 2000, 4, 1, 128, 128, 16, None), (2, 1500, 4, 2, 128, 64, 16, (700, 701))],
    ids=str,
)
def test_select_tokens_on_gpu(geometry, dtype):
    """MSA's sizes on the GPU (every autotune config runs), bf16 included: the inputs are
    exact in it and the fp32 products and sums exact too."""
    batch, seq_len, heads, heads_keys, dim, kv_block, top_k, bounds = geometry
    q_proxy, k_proxy = _inputs(batch, seq_len, heads, heads_keys, dim, seed=7, dtype=dtype)
    document_ids = None if bounds is None else _documents(batch, seq_len, bounds)
    selected = select_tokens(q_proxy, k_proxy, top_k=top_k, kv_block=kv_block,
                             document_ids=document_ids)  # fmt: skip
    expected = select_tokens_reference(q_proxy, k_proxy, top_k=top_k, kv_block=kv_block,
                                       document_ids=document_ids)  # fmt: skip
    assert torch.equal(selected, expected)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "geometry",
    [(1, 2000, 4, 1, 128, 128, 16, None), (2, 1500, 4, 2, 128, 64, 16, (700, 701))],
    ids=str,
)
def test_fp8_scores_on_gpu(geometry):
    """FP8 scoring on Hopper's tensor cores (every autotune config runs) on inputs it holds
    exactly: the float64 reference's selection."""
    batch, seq_len, heads, heads_keys, dim, kv_block, top_k, bounds = geometry
    q_proxy, k_proxy = fp8_exact_proxies(batch, seq_len, heads, heads_keys, dim, kv_block,
                                         seed=8, device=DEVICE)  # fmt: skip
    document_ids = None if bounds is None else _documents(batch, seq_len, bounds)
    selected = select_tokens(
        q_proxy.bfloat16(), k_proxy.bfloat16(), top_k=top_k, kv_block=kv_block,
        document_ids=document_ids, score_dtype=FP8,
    )  # fmt: skip
    expected = select_tokens_reference(q_proxy, k_proxy, top_k=top_k, kv_block=kv_block,
                                       document_ids=document_ids)  # fmt: skip
    assert torch.equal(selected, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("scores", ["bf16", "fp16", "fp8"])
@pytest.mark.parametrize(
    "geometry",
    [(2, 1000, 4, 1, 128, 16), (1, 5000, 4, 2, 128, 16), (1, 4099, 4, 4, 64, 16),
     (1, 129, 4, 1, 128, 16), (1, 3000, 2, 1, 128, 4), (1, 700, 4, 1, 128, 40)],
    ids=str,
)  # fmt: skip
def test_gluon_selection_equals_the_triton_kernel(geometry, scores, monkeypatch):
    """On sm_90 select_tokens runs the Gluon kernel: on random (inexact) proxies its choices
    are the Triton kernel's, bit for bit (the same products, maxima and top-k), for 1, 2
    and 4 proxy heads a key head, D_p 64 and 128, ragged lengths, top_k 4 to 40, and proxy
    keys at an address TMA cannot read from (batch 1)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon selection runs on sm_90")
    batch, seq_len, heads, heads_keys, dim, top_k = geometry
    generator = torch.Generator().manual_seed(seq_len)
    dtype = torch.float16 if scores == "fp16" else torch.bfloat16
    q_proxy, k_proxy = (
        torch.randn(batch, seq_len, count, dim, generator=generator).to(DEVICE, dtype)
        for count in (heads, heads_keys)
    )
    if batch == 1:  # k_proxy 2 bytes past an aligned address: the kernel's TMA needs a copy
        shifted = torch.empty(k_proxy.numel() + 1, dtype=dtype, device=DEVICE)[1:]
        k_proxy = shifted.view(k_proxy.shape).copy_(k_proxy)
    options = dict(top_k=top_k, kv_block=128, score_dtype=FP8 if scores == "fp8" else None)
    assert gluon_selection.supports(q_proxy, 128, top_k, documents=False, q_blocks=False)
    selected = select_tokens(q_proxy, k_proxy, **options)
    monkeypatch.setattr(gluon_selection, "supports", lambda *args, **kwargs: False)
    assert torch.equal(selected, select_tokens(q_proxy, k_proxy, **options))


def test_gluon_selection_is_refused_off_sm90():
    """Without an sm_90 GPU (here: the CPU) select_tokens takes the Triton kernel."""
    q_proxy = torch.zeros(1, 256, 4, 128, dtype=torch.bfloat16)
    assert not gluon_selection.supports(q_proxy, 128, 16, documents=False, q_blocks=False)


# ---- token_selection_layout ------------------------------------------------------------------
def _layout_by_loops(selected, seq_len, q_block):
    """{(layout, row): {block: mask}} by walking every token's choices."""
    rows = {}
    batch, heads, _, _ = selected.shape
    for layout in range(batch * heads):
        for token in range(seq_len):
            key = (layout, token // q_block)
            rows.setdefault(key, {})
            for block in selected[layout // heads, layout % heads, token].tolist():
                if block >= 0:
                    masks = rows[key]
                    masks[block] = masks.get(block, 0) | (1 << (token % q_block))
    return rows


@pytest.mark.parametrize("union", ["kernel", "sort"])
@pytest.mark.parametrize(
    "seq_len, q_block, kv_block, top_k, bounds",
    [(130, 16, 32, 3, None), (200, 64, 16, 4, (90,)), (100, 32, 128, 2, None),
     (150, 1, 16, 3, (70,)), (130, 8, 16, 16, (60,))],
)  # fmt: skip
def test_token_selection_layout_matches_loops(seq_len, q_block, kv_block, top_k, bounds, union,
                                              poisoned, monkeypatch):  # fmt: skip
    """Selections of the reference (float64, CPU), on the test device; q_block 64 sets bit 63
    of the masks, q_block 1 has none (each row is one token's choices). union "kernel": the
    tiles' unions from _tile_union_kernel (on the CPU too, interpreted); "sort": from one
    sort of every choice."""
    kernel = union == "kernel"
    monkeypatch.setattr(token_selection, "_unions_in_kernel", lambda selected, q_block: kernel)
    q_proxy, k_proxy = _inputs(2, seq_len, 2, 1, 8, seed=seq_len, dtype=torch.float64,
                               device="cpu")  # fmt: skip
    document_ids = None if bounds is None else _documents(2, seq_len, bounds).cpu()
    selected = select_tokens_reference(q_proxy, k_proxy, top_k=top_k, kv_block=kv_block,
                                       document_ids=document_ids).to(DEVICE)  # fmt: skip
    layout, query_masks = token_selection_layout(selected, seq_len=seq_len, q_block=q_block,
                                                 kv_block=kv_block)  # fmt: skip
    assert (layout.layout_batch, layout.layout_heads) == (2, 2)
    assert (layout.q_block, layout.kv_block, layout.seq_len_q) == (q_block, kv_block, seq_len)
    if q_block == 1:
        assert query_masks is None
    else:
        assert query_masks.dtype == torch.int64 and query_masks.shape == (layout.nnz,)
    layout._validate()  # sorted, unique, in range
    expected = _layout_by_loops(selected, seq_len, q_block)
    offsets = layout.row_offsets.tolist()
    for (entry_layout, row), masks in expected.items():
        start, end = offsets[entry_layout][row], offsets[entry_layout][row + 1]
        assert layout.col_indices[start:end].tolist() == sorted(masks)
        if query_masks is not None:  # bit 63 is int64's sign: compare unsigned 64-bit patterns
            got = [mask % (1 << 64) for mask in query_masks[start:end].tolist()]
            assert got == [masks[block] for block in sorted(masks)]
    assert layout.nnz == sum(len(masks) for masks in expected.values())


# ---- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda q, k: (q[0], k), ValueError, "4-D"),
        (lambda q, k: (q.double(), k.double()), TypeError, "select_tokens_reference"),
        (lambda q, k: (q.int(), k), TypeError, "int32"),
        (lambda q, k: (q, k.half()), ValueError, "share dtype"),
        (lambda q, k: (q[:, :, :3], k), ValueError, "multiple of proxy key heads"),
        (lambda q, k: (q, k[:, :50]), ValueError, "in B, S and D_p"),
        (lambda q, k: (q[:, :0], k[:, :0]), ValueError, "at least 1"),
        (lambda q, k: (q.cpu().numpy(), k), TypeError, "ndarray"),
    ],
)
def test_select_tokens_rejects_bad_tensors(change, error, match):
    q_proxy, k_proxy = change(*_inputs(2, 64, 4, 2, 16, seed=0))
    with pytest.raises(error, match=match):
        select_tokens(q_proxy, k_proxy, top_k=4, kv_block=32)


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(top_k=0), ValueError, "top_k must be a positive int, got 0"),
        (dict(top_k=2.0), ValueError, "top_k must be a positive int, got 2.0"),
        (dict(top_k=True), ValueError, "top_k must be a positive int, got True"),
        (dict(kv_block=48), ValueError, "kv_block must be one of"),
        (dict(proxy_softmax_scale=-1.0), ValueError, "proxy_softmax_scale must be a positive"),
        (dict(document_ids=torch.zeros(2, 63, dtype=torch.int32)), ValueError, r"\[2, 64\]"),
        (dict(document_ids=torch.zeros(2, 64)), TypeError, "int32 or int64"),
        (dict(document_ids=torch.arange(64).flip(0).expand(2, -1)), ValueError, "non-decreasing"),
        (dict(score_dtype=torch.float16), ValueError, "score_dtype must be None .* got torch.fl"),
    ],
)
def test_select_tokens_rejects_bad_options(options, error, match):
    q_proxy, k_proxy = _inputs(2, 64, 4, 2, 16, seed=0)
    options = dict(dict(top_k=4, kv_block=32), **options)
    if "document_ids" in options:
        options["document_ids"] = options["document_ids"].to(DEVICE)
    with pytest.raises(error, match=match):
        select_tokens(q_proxy, k_proxy, **options)


def test_rows_of_one_token_refuse_more_entries_than_int32_counts():
    selected = torch.zeros(1, 1, 1, 1, dtype=torch.int32).expand(1, 2, 2**15, 2**15)  # no memory
    with pytest.raises(ValueError, match="2,147,483,648 entries, more than int32"):
        token_selection_layout(selected, seq_len=2**15, q_block=1, kv_block=128, check=False)


def test_token_selection_layout_rejects_bad_input():
    selected = torch.full((1, 1, 40, 2), -1, dtype=torch.int32)
    selected[..., 0] = torch.arange(40) // 16  # 3 kv blocks
    good = dict(seq_len=40, q_block=16, kv_block=16)
    assert token_selection_layout(selected, **good)[0].nnz == 3
    with pytest.raises(TypeError, match="must be int32"):
        token_selection_layout(selected.long(), **good)
    with pytest.raises(ValueError, match=r"\[B, H_p, 41, top_k\]"):
        token_selection_layout(selected, **dict(good, seq_len=41))
    with pytest.raises(ValueError, match="at most 64"):
        token_selection_layout(selected, **dict(good, q_block=128))
    with pytest.raises(ValueError, match="q_block must be one of"):
        token_selection_layout(selected, **dict(good, q_block=12))
    with pytest.raises(TypeError, match="check must be a bool, got None"):
        token_selection_layout(selected, **good, check=None)
    for row, match in [
        ([0, 3], r"in \[0, 3\) .* from -1 to 3"),
        ([0, 0], r"ascending without repeats .* token 5 holds \[0, 0\]"),
        ([1, 0], r"token 5 holds \[1, 0\]"),
        ([-1, 0], r"padded with -1 at the end only"),
    ]:
        bad = selected.clone()
        bad[0, 0, 5] = torch.tensor(row)
        with pytest.raises(ValueError, match=match):
            token_selection_layout(bad, **good)


# ---- sm_90 code without a GPU ------------------------------------------------------------
# Compiles the kernel at MSA's 1M-token sizes (bf16, D_p 128, kv_block 128, top_k 16, 4 proxy
# heads on one key head) for each [BLOCK_M, warps, stages, proxies' Triton dtype] of argv[2]
# (fp8e4nv: FP8 scores, with the blocks' factors), pointers and strides divisible by 16 as
# the launcher specialises them. Prints one JSON report per config.
SM90_COMPILE = """
import json, sys
from flash_msa.msa import token_selection
from flash_msa.testing import compile_for_sm90

for block_m, warps, stages, scores in json.loads(sys.argv[2]):
    types = dict(q_proxy=f"*{scores}", k_proxy=f"*{scores}", selected="*i32", documents="*i32",
                 document_starts="*i32", q_blocks="*i32", k_scales="*fp32")
    constexprs = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, KV_BLOCK=128, PACK=4, TOP_K=16, SLOTS=16,
                      DOT_PRECISION="tf32", HAS_DOCUMENTS=False, BLOCK_M=block_m, Q_BLOCK=64,
                      HAS_Q_BLOCKS=False, SCALED=scores == "fp8e4nv")
    print(json.dumps(compile_for_sm90(token_selection._token_selection_kernel, constexprs, types,
                                      warps, stages, sys.argv[1], aligned=True)))
"""


def test_select_tokens_kernel_compiles_for_hopper(sm90):
    """The interpreter never reaches GPU code generation: the 128-row tile compiles for
    sm_90 to tensor cores (wgmma), key tiles loaded ahead (cp.async) and no register
    spills, in bf16 and with FP8 scores (e4m3 wgmma)."""
    reports = sm90(SM90_COMPILE, json.dumps([[128, 8, 3, "bf16"], [128, 8, 3, "fp8e4nv"]]))
    assert [report["fp8"] for report in reports] == [False, True]
    for report in reports:
        assert report["wgmma"] and report["pipelined"] and report["spills"] == 0, report
