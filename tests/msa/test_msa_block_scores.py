"""block_scores (Triton, interpreter on CPU) against the float64 eager reference."""

import math

import pytest
import torch

from flash_msa.msa import block_scores, block_scores_reference

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


def _inputs(seq_len, heads, heads_keys, dim, *, batch=2, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q_proxy = torch.randn(batch, seq_len, heads, dim, generator=generator).to(dtype)
    k_proxy = torch.randn(batch, seq_len, heads_keys, dim, generator=generator).to(dtype)
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
    q_proxy, k_proxy = _inputs(seq_len, heads, heads_keys, dim, seed=seq_len)
    out = torch.full((2, heads, *_grid(seq_len, q_block, kv_block)), float("nan"))
    scores = block_scores(q_proxy, k_proxy, q_block=q_block, kv_block=kv_block, out=out)
    assert scores is out and scores.dtype == torch.float32
    reference = block_scores_reference(q_proxy.double(), k_proxy.double(), q_block, kv_block)
    _assert_matches(scores, reference, 1e-5)


def test_block_scores_scale_strides_and_float16():
    q_proxy, k_proxy = _inputs(150, 4, 2, 32, seed=1)
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
    with pytest.raises(ValueError, match="proxy_softmax_scale must be > 0"):
        block_scores(q_proxy, k_proxy, q_block=32, kv_block=32, proxy_softmax_scale=-1.0)
    with pytest.raises(ValueError, match=r"out must be a float32 \[2, 4, 2, 2\]"):
        block_scores(q_proxy, k_proxy, q_block=32, kv_block=32, out=torch.empty(2, 4, 2, 3))
