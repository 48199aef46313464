"""block_scores (Triton, interpreter on CPU) against the float64 eager reference."""

import math

import pytest
import torch

from flash_msa.msa import block_scores, block_scores_reference

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


SM90_COMPILE = """
import importlib, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

module = importlib.import_module("flash_msa.msa.block_scores")
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
Q_BLOCK, KV_BLOCK, PACK = 64, 128, 2  # MSA's blocks, 4 proxy heads per key head
configs = module._configs(KV_BLOCK, Q_BLOCK * PACK)
for config in (configs[0], configs[-1]):
    constexprs = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, Q_BLOCK=Q_BLOCK, KV_BLOCK=KV_BLOCK,
                      PACK=PACK, DOT_PRECISION="tf32", TAIL=module.TAIL_COLUMNS,
                      HAS_DOCUMENTS=False, **config.kwargs)
    signature = {
        arg: "constexpr" if arg in constexprs
        else "*bf16" if arg in ("q_proxy", "k_proxy")
        else "*fp32" if arg == "scores"
        else "*i32" if arg == "documents"
        else "fp32" if arg == "scale"
        else "i32"
        for arg in module._block_scores_kernel.arg_names
    }
    compiled = triton.compile(
        ASTSource(module._block_scores_kernel, signature, constexprs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=config.num_warps, num_stages=config.num_stages),
    )
    path = os.path.join(sys.argv[1], "block_scores.ptx")
    open(path, "w").write(compiled.asm["ptx"])
    report = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", path, "-o", path + ".cubin"],
                            capture_output=True, text=True)
    if report.returncode:
        sys.exit(report.stderr[-3000:])
    report = report.stderr
    spills = re.search(r"(\\d+) bytes spill stores", report).group(1)
    print("wgmma" in compiled.asm["ptx"], spills)
"""


def test_block_scores_kernel_compiles_for_hopper(tmp_path):
    """The interpreter never reaches GPU code generation: compile the first and last
    autotune configs for sm_90 (bf16, D_p = 128) with the ptxas Triton bundles; tensor
    cores (wgmma) and no register spills."""
    import os
    import subprocess
    import sys

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this Triton build bundles no ptxas")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    result = subprocess.run(
        [sys.executable, "-c", SM90_COMPILE, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "0", "True", "0"], result.stdout
