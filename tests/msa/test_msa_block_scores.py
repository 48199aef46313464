"""block_scores (Triton, interpreter on CPU) against the float64 eager reference."""

import math

import pytest
import torch

from flash_msa.msa import block_scores, block_scores_gluon, block_scores_reference
from flash_msa.msa.fp8 import FP8
from flash_msa.sequences import document_ids_of
from flash_msa.testing import fp8_exact_proxies

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter

# (S, q_block, kv_block, H_p, H_pk, D_p): ragged tails, both block ratios, packed proxy heads,
# a head dim that is not a power of two.
GEOMETRIES = [
    (256, 64, 128, 4, 1, 32),
    (200, 64, 128, 4, 2, 16),
    (129, 32, 32, 2, 2, 16),
    (77, 16, 32, 4, 4, 24),
    (130, 128, 64, 2, 1, 16),
    (16, 16, 16, 1, 1, 16),
]


def _grid(seq_len, q_block, kv_block):
    return math.ceil(seq_len / q_block), math.ceil(seq_len / kv_block)


def _inputs(seq_len, heads, heads_keys, dim, *, batch=2, dtype=torch.float32, seed=0,
            device="cpu"):  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    q_proxy = torch.randn(batch, seq_len, heads, dim, generator=generator).to(device, dtype)
    k_proxy = torch.randn(batch, seq_len, heads_keys, dim, generator=generator).to(device, dtype)
    return q_proxy, k_proxy


def _assert_matches(scores, reference, tolerance):
    finite = torch.isfinite(reference)
    assert torch.equal(torch.isfinite(scores), finite)
    assert bool((scores[~finite] == float("-inf")).all())
    relative = (scores.double() - reference).abs()[finite] / reference.abs()[finite]
    assert relative.max().item() < tolerance


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_block_scores_match_reference(geometry):
    seq_len, q_block, kv_block, heads, heads_keys, dim = geometry
    q_proxy, k_proxy = _inputs(seq_len, heads, heads_keys, dim, seed=seq_len, device=DEVICE)
    out = torch.full((2, heads, *_grid(seq_len, q_block, kv_block)), float("nan"), device=DEVICE)
    scores = block_scores(q_proxy, k_proxy, q_block=q_block, kv_block=kv_block, out=out)
    assert scores is out and scores.dtype == torch.float32
    reference = block_scores_reference(q_proxy.double(), k_proxy.double(), q_block, kv_block)
    _assert_matches(scores, reference, 1e-5)


@pytest.mark.parametrize("geometry", GEOMETRIES[:5], ids=str)
def test_fp8_block_scores_match_reference_on_inputs_fp8_holds(geometry):
    """score_dtype FP8: the rows' and the blocks' factors (both varying) multiplied back,
    exactly, on proxies e4m3 holds; with documents."""
    seq_len, q_block, kv_block, heads, heads_keys, dim = geometry
    q_proxy, k_proxy = fp8_exact_proxies(2, seq_len, heads, heads_keys, dim, kv_block,
                                         seed=seq_len, device=DEVICE)  # fmt: skip
    bounds = torch.tensor([0, seq_len // 3, seq_len], dtype=torch.int32, device=DEVICE)
    for document_ids in (None, document_ids_of(bounds)[None].expand(2, -1)):
        out = torch.full((2, heads, *_grid(seq_len, q_block, kv_block)), float("nan"),
                         device=DEVICE)  # fmt: skip
        scores = block_scores(q_proxy, k_proxy, q_block=q_block, kv_block=kv_block, out=out,
                              document_ids=document_ids, score_dtype=FP8)  # fmt: skip
        reference = block_scores_reference(q_proxy.double(), k_proxy.double(), q_block,
                                           kv_block, document_ids=document_ids)  # fmt: skip
        _assert_matches(scores, reference, 1e-6)  # exact products, then one fp32 rounding


def test_fp8_block_scores_approximate_the_proxies():
    """On normal proxies FP8 scores are the fp32 ones to e4m3's rounding."""
    q_proxy, k_proxy = _inputs(256, 4, 1, 32, seed=5, device=DEVICE)
    options = dict(q_block=32, kv_block=64)
    scores = block_scores(q_proxy, k_proxy, score_dtype=FP8, **options)
    reference = block_scores(q_proxy, k_proxy, **options)
    finite = torch.isfinite(reference)
    assert torch.equal(torch.isfinite(scores), finite)
    error = (scores - reference)[finite].abs()
    assert error.max().item() < 0.1 * reference[finite].abs().max().item()
    assert error.mean().item() < 0.02 * reference[finite].abs().mean().item()


def test_block_scores_scale_strides_and_float16():
    q_proxy, k_proxy = _inputs(150, 4, 2, 32, seed=1, device=DEVICE)
    # Non-contiguous [B, S, H, D] views of [B, H, S, D] storage.
    q_strided = q_proxy.transpose(1, 2).contiguous().transpose(1, 2)
    k_strided = k_proxy.transpose(1, 2).contiguous().transpose(1, 2)
    scores = block_scores(q_strided, k_strided, q_block=32, kv_block=64, proxy_softmax_scale=0.3)
    reference = block_scores_reference(q_proxy.double(), k_proxy.double(), 32, 64, 0.3)
    _assert_matches(scores, reference, 1e-5)

    # fp16 products are exact in fp32: only the summation order differs from float64.
    q_half, k_half = q_proxy.half(), k_proxy.half()
    scores = block_scores(q_half, k_half, q_block=32, kv_block=64)
    reference = block_scores_reference(q_half.double(), k_half.double(), 32, 64)
    _assert_matches(scores, reference, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("geometry", GEOMETRIES + [(1000, 64, 128, 4, 1, 128)], ids=str)
def test_block_scores_on_gpu(geometry, dtype):
    """The interpreter cannot run bfloat16 dots; on the GPU every config of the autotuner runs."""
    seq_len, q_block, kv_block, heads, heads_keys, dim = geometry
    q_proxy, k_proxy = _inputs(seq_len, heads, heads_keys, dim, dtype=dtype, seed=seq_len)
    q_proxy, k_proxy = q_proxy.cuda(), k_proxy.cuda()
    out = torch.full((2, heads, *_grid(seq_len, q_block, kv_block)), float("nan"), device="cuda")
    scores = block_scores(q_proxy, k_proxy, q_block=q_block, kv_block=kv_block, out=out)
    reference = block_scores_reference(q_proxy.double(), k_proxy.double(), q_block, kv_block)
    _assert_matches(scores, reference, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("geometry", GEOMETRIES + [(1000, 64, 128, 4, 1, 128)], ids=str)
def test_fp8_block_scores_on_gpu(geometry):
    """FP8 scores on e4m3 tensor cores (every autotune config runs) from bf16 proxies e4m3
    holds: float64's scores."""
    seq_len, q_block, kv_block, heads, heads_keys, dim = geometry
    q_proxy, k_proxy = (tensor.to("cuda", torch.bfloat16) for tensor in fp8_exact_proxies(
        2, seq_len, heads, heads_keys, dim, kv_block, seed=seq_len))  # fmt: skip
    scores = block_scores(q_proxy, k_proxy, q_block=q_block, kv_block=kv_block,
                          score_dtype=FP8)  # fmt: skip
    reference = block_scores_reference(q_proxy.double(), k_proxy.double(), q_block, kv_block)
    _assert_matches(scores, reference, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("scores", ["bf16", "fp16", "fp8"])
@pytest.mark.parametrize(
    "geometry",
    [(2, 1000, 4, 1, 128), (1, 9000, 4, 2, 128), (1, 16447, 2, 1, 64), (1, 129, 4, 1, 128),
     (2, 8256, 8, 4, 64)],
    ids=str,
)  # fmt: skip
def test_gluon_block_scores_equal_the_triton_kernel(geometry, scores, monkeypatch):
    """On sm_90 block_scores at MSA's blocks (q_block 64, kv_block 128) runs the Gluon kernel:
    on random (inexact) proxies its scores are the Triton kernel's, bit for bit, with -inf
    past the diagonal, for 2 and 4 proxy heads a key head, D_p 64 and 128, ragged lengths,
    walks of one to several chunks of blocks (an odd and an even count of them), a batch and
    an unaligned k_proxy (which the kernel's TMA copies); on proxies FP8 holds, float64's."""
    batch, seq_len, heads, heads_keys, dim = geometry
    generator = torch.Generator().manual_seed(seq_len)
    dtype = torch.float16 if scores == "fp16" else torch.bfloat16
    q_proxy, k_proxy = (
        torch.randn(batch, seq_len, count, dim, generator=generator).to("cuda", dtype)
        for count in (heads, heads_keys)
    )
    if batch == 1:  # k_proxy 2 bytes past an aligned address
        shifted = torch.empty(k_proxy.numel() + 1, dtype=dtype, device="cuda")[1:]
        k_proxy = shifted.view(k_proxy.shape).copy_(k_proxy)
    options = dict(q_block=64, kv_block=128, score_dtype=FP8 if scores == "fp8" else None)
    assert block_scores_gluon.supports(q_proxy, heads // heads_keys, 64, 128, documents=False,
                                       q_blocks=False)  # fmt: skip
    out = torch.full((batch, heads, *_grid(seq_len, 64, 128)), float("nan"), device="cuda")
    gluon = block_scores(q_proxy, k_proxy, out=out, **options)
    with monkeypatch.context() as patch:
        patch.setattr(block_scores_gluon, "supports", lambda *args, **kwargs: False)
        triton = block_scores(q_proxy, k_proxy, **options)
    assert torch.equal(gluon, triton)
    if scores == "fp8":
        exact = (tensor.to("cuda", torch.bfloat16) for tensor in fp8_exact_proxies(
            batch, seq_len, heads, heads_keys, dim, 128, seed=seq_len))  # fmt: skip
        q_proxy, k_proxy = exact
        reference = block_scores_reference(q_proxy.double(), k_proxy.double(), 64, 128)
        _assert_matches(block_scores(q_proxy, k_proxy, **options), reference, 1e-6)


def test_gluon_block_scores_are_refused_off_sm90_and_off_their_blocks():
    """Without an sm_90 GPU (here: the CPU), or at other blocks, block_scores takes the
    Triton kernel."""
    q_proxy = torch.zeros(1, 256, 4, 128, dtype=torch.bfloat16)
    assert not block_scores_gluon.supports(q_proxy, 4, 64, 128, documents=False, q_blocks=False)


def test_block_scores_reference_brute_force():
    q_proxy, k_proxy = _inputs(40, 2, 1, 8, batch=1, dtype=torch.float64, seed=2)
    reference = block_scores_reference(q_proxy, k_proxy, 16, 32)  # [1, 2, 3, 2]
    for head in range(2):
        for b in range(3):
            for c in range(2):
                pairs = [
                    float(q_proxy[0, i, head] @ k_proxy[0, j, 0]) / math.sqrt(8)
                    for i in range(16 * b, min(16 * b + 16, 40))
                    for j in range(32 * c, min(32 * c + 32, 40))
                    if j <= i
                ]
                expected = max(pairs) if pairs else float("-inf")
                assert reference[0, head, b, c].item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda q, k: (q[0], k), ValueError, "4-D"),
        (lambda q, k: (q.double(), k.double()), TypeError, "float64"),
        (lambda q, k: (q.int(), k), TypeError, "int32"),
        (lambda q, k: (q, k.half()), ValueError, "share dtype"),
        (lambda q, k: (q[:, :, :3], k), ValueError, "multiple of proxy key heads"),
        (lambda q, k: (q, k[:, :50]), ValueError, "B, S and D_p"),
        (lambda q, k: (q.numpy(), k), TypeError, "ndarray"),
        (lambda q, k: (q, k[:, :, :0]), ValueError, "at least one position, head and head dim"),
    ],
)
def test_block_scores_rejects_bad_tensors(change, error, match):
    q_proxy, k_proxy = change(*_inputs(64, 4, 2, 16))
    with pytest.raises(error, match=match):
        block_scores(q_proxy, k_proxy, q_block=32, kv_block=32)


def test_block_scores_rejects_bad_arguments():
    q_proxy, k_proxy = _inputs(64, 4, 2, 16)
    with pytest.raises(ValueError, match="q_block must be one of"):
        block_scores(q_proxy, k_proxy, q_block=48, kv_block=32)
    for scale in (-1.0, float("inf"), True, "a"):
        with pytest.raises(ValueError, match="proxy_softmax_scale must be"):
            block_scores(q_proxy, k_proxy, q_block=32, kv_block=32, proxy_softmax_scale=scale)
    with pytest.raises(ValueError, match=r"out must be a float32 \[2, 4, 2, 2\]"):
        block_scores(q_proxy, k_proxy, q_block=32, kv_block=32, out=torch.empty(2, 4, 2, 3))
    expanded = torch.empty(2, 1, 2, 2).expand(2, 4, 2, 2)  # the heads would overwrite each other
    with pytest.raises(ValueError, match="no expanded dimension"):
        block_scores(q_proxy, k_proxy, q_block=32, kv_block=32, out=expanded)
    with pytest.raises(TypeError, match="out must be a torch.Tensor or None, got list"):
        block_scores(q_proxy, k_proxy, q_block=32, kv_block=32, out=[0])


# ---- a rank's query blocks (context parallelism) -----------------------------------------
# (S, q_block, kv_block, blocks, documents): ragged global ends, q_block < kv_block, equal
# blocks, q_block > kv_block; head-tail chunks or a random subset; documents or not.
RANK_CASES = [
    (333, 32, 64, "head-tail", True),
    (333, 32, 64, "random", False),
    (200, 16, 32, "head-tail", False),
    (400, 64, 32, "random", True),
]


def rank_blocks(num_blocks, kind):
    """A rank's global query blocks, ascending: two head-tail chunks (the first and the last
    three blocks), or a seeded random subset."""
    if kind == "head-tail":
        return torch.tensor([0, 1, 2, num_blocks - 3, num_blocks - 2, num_blocks - 1])
    picked = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(num_blocks))
    return picked[: num_blocks // 2].sort().values


def rank_tokens(q_blocks, q_block, seq_len):
    """The global positions of the rows of q_blocks, back to back."""
    return torch.cat([torch.arange(b * q_block, min((b + 1) * q_block, seq_len))
                      for b in q_blocks.tolist()])  # fmt: skip


@pytest.mark.parametrize("case", RANK_CASES, ids=str)
def test_block_scores_of_query_blocks_equal_the_global_rows(case):
    """q_proxy holds a rank's rows, k_proxy the whole sequence: each row of scores is,
    bit for bit, the whole sequence's row of its global block (documents crossing the
    chunks' edges)."""
    seq_len, q_block, kv_block, kind, documents = case
    q_proxy, k_proxy = _inputs(seq_len, 2, 1, 16, seed=seq_len, device=DEVICE)
    document_ids = None
    if documents:
        bounds = torch.tensor([0, 50, 100, 270, seq_len], dtype=torch.int32, device=DEVICE)
        document_ids = document_ids_of(bounds)[None].expand(2, -1)
    common = dict(q_block=q_block, kv_block=kv_block, document_ids=document_ids)
    whole = block_scores(q_proxy, k_proxy, **common)
    q_blocks = rank_blocks(whole.shape[2], kind)
    tokens = rank_tokens(q_blocks, q_block, seq_len).to(DEVICE)
    out = torch.full((2, 2, len(q_blocks), whole.shape[3]), float("nan"), device=DEVICE)
    scores = block_scores(q_proxy[:, tokens], k_proxy, **common, q_blocks=q_blocks.to(DEVICE),
                          out=out)  # fmt: skip
    assert scores is out
    assert torch.equal(scores, whole[:, :, q_blocks.to(DEVICE)])


def test_block_scores_of_query_blocks_compile_in_one_graph():
    torch._dynamo.reset()
    q_proxy, k_proxy = _inputs(300, 2, 1, 16, seed=4, device=DEVICE)
    q_blocks = torch.tensor([1, 2, 9], device=DEVICE)  # 9: the ragged last block
    local = q_proxy[:, rank_tokens(q_blocks.cpu(), 32, 300).to(DEVICE)]

    def scores(local, k_proxy):
        return block_scores(local, k_proxy, q_block=32, kv_block=64, q_blocks=q_blocks)

    compiled = torch.compile(scores, fullgraph=True, backend="aot_eager")(local, k_proxy)
    assert torch.equal(compiled, scores(local, k_proxy))


@pytest.mark.parametrize(
    "q_blocks, error, match",
    [
        ([0, 3, 9], TypeError, "q_blocks must be a torch.Tensor, got list"),
        (torch.tensor([0.0, 3.0, 9.0]), TypeError, "integer block indices, got torch.float32"),
        (torch.tensor([True, False, True]), TypeError, "integer block indices, got torch.bool"),
        (torch.tensor([0, 3, 9], device="meta"), ValueError, "q_blocks is on meta but the"),
        (torch.tensor([0, 3]), ValueError, r"3 for 76 local rows .* got shape \[2\]"),
        (torch.tensor([[0, 3, 9]]), ValueError, r"got shape \[1, 3\]"),
        (torch.tensor([0, 3, 10]), ValueError, r"lie in \[0, 10\) .* from 0 to 10"),
        (torch.tensor([-1, 3, 9]), ValueError, "from -1 to 9"),
        (torch.tensor([0, 3, 8]), ValueError, "block 2 holds 12 rows but global query block 8"),
        (torch.tensor([9, 3, 0]), ValueError, "block 0 holds 32 rows but global query block 9"),
    ],
)
def test_block_scores_reject_bad_query_blocks(q_blocks, error, match):
    """300 tokens in blocks of 32: global blocks 0..9, block 9 holds 12; a rank of 76 rows."""
    q_proxy, k_proxy = _inputs(300, 2, 1, 16)
    with pytest.raises(error, match=match):
        block_scores(q_proxy[:, :76], k_proxy, q_block=32, kv_block=64, q_blocks=q_blocks)


def test_block_scores_of_query_blocks_reject_bad_tensors():
    q_proxy, k_proxy = _inputs(300, 2, 1, 16)
    q_blocks = torch.tensor([0, 9])
    with pytest.raises(ValueError, match=r"in B and D_p \(it holds the whole sequence\)"):
        block_scores(q_proxy[:, :44], k_proxy[..., :8], q_block=32, kv_block=64, q_blocks=q_blocks)
    with pytest.raises(ValueError, match=r"document_ids must be \[batch, seq_len\] = \[2, 300\]"):
        block_scores(q_proxy[:, :44], k_proxy, q_block=32, kv_block=64, q_blocks=q_blocks,
                     document_ids=torch.zeros(2, 44, dtype=torch.int32))  # fmt: skip
    with pytest.raises(ValueError, match=r"out must be a float32 \[2, 2, 2, 5\]"):
        block_scores(q_proxy[:, :44], k_proxy, q_block=32, kv_block=64, q_blocks=q_blocks,
                     out=torch.empty(2, 2, 10, 5))  # fmt: skip


# Compiles the first and last autotune configs at MSA's blocks (q_block 64, kv_block 128, D_p
# 128, 4 proxy heads per key head), bf16 and FP8 scores; one JSON report per compile.
SM90_COMPILE = """
import importlib, json, sys
from flash_msa.testing import compile_for_sm90

block_scores = importlib.import_module("flash_msa.msa.block_scores")  # the module, not the op

Q_BLOCK, KV_BLOCK, PACK = 64, 128, 2
configs = block_scores._configs(KV_BLOCK, Q_BLOCK * PACK)
for config in (configs[0], configs[-1]):
    for proxies in ("bf16", "fp8e4nv"):  # FP8 scores: e4m3 proxies and their factors
        constexprs = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, Q_BLOCK=Q_BLOCK, KV_BLOCK=KV_BLOCK,
                          PACK=PACK, DOT_PRECISION="tf32", TAIL=block_scores.TAIL_COLUMNS,
                          HAS_DOCUMENTS=False, HAS_Q_BLOCKS=False,
                          SCALED=proxies == "fp8e4nv", **config.kwargs)
        types = dict(q_proxy=f"*{proxies}", k_proxy=f"*{proxies}", scores="*fp32",
                     q_scales="*fp32", k_scales="*fp32", documents="*i32", q_blocks="*i32",
                     scale="fp32")
        print(json.dumps(compile_for_sm90(block_scores._block_scores_kernel, constexprs, types,
                                          config.num_warps, config.num_stages, sys.argv[1])))
"""


def test_block_scores_kernel_compiles_for_hopper(sm90):
    """The interpreter never reaches GPU code generation: compile the first and last
    autotune configs for sm_90 (bf16 and FP8 scores, D_p = 128) with the ptxas Triton
    bundles; tensor cores (wgmma, e4m3 ones for FP8) and no register spills."""
    reports = sm90(SM90_COMPILE)
    got = [(report["wgmma"], report["fp8"], report["spills"]) for report in reports]
    assert got == [(True, False, 0), (True, True, 0)] * 2, reports
