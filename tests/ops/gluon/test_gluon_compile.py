"""The Gluon forward: its sm_90 code compiled on any machine (wgmma, registers, spills,
shared memory, the softmax beside the P V matmul), and on an H100 / H200 its output and
lse against float64 by FlashAttention's rule.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from flash_msa import patterns
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.testing import random_qkv, relative_error

HOPPER_SHARED_MEMORY = 232_448
CONSUMER_REGISTERS = 240  # forward.CONSUMER_REGISTERS, the consumers' setmaxnreg budget
SPILL_LIMIT = 64  # bytes of spill stores tolerated

# Compiles the variants given as JSON on argv[2] ([[head_dim, dtype, num_stages, pingpong],
# ...]) into the folder argv[1]; prints one JSON report per variant.
SCRIPT = """
import json, sys
from flash_msa.ops.gluon import codegen
for head_dim, dtype, num_stages, pingpong in json.loads(sys.argv[2]):
    report = codegen.compile_forward(sys.argv[1], head_dim=head_dim, dtype=dtype,
                                     num_stages=num_stages, pingpong=pingpong)
    print(json.dumps(dict(report, head_dim=head_dim, dtype=dtype, num_stages=num_stages,
                          pingpong=pingpong)))
"""


def compile_variants(folder, variants: list) -> list[dict]:
    try:
        from flash_msa.ops.gluon import codegen
    except ImportError as error:  # a Triton without Gluon, or an older Gluon API
        pytest.skip(f"this Triton cannot build the Gluon kernels: {error}")
    reason = codegen.available()
    if reason is not None:
        pytest.skip(reason)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(folder / "cache")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(folder), json.dumps(variants)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


VARIANTS = [
    [128, "bf16", 3, True],
    [128, "bf16", 2, False],
    [128, "fp16", 2, True],
    [64, "bf16", 3, True],
]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    return compile_variants(tmp_path_factory.mktemp("sm90"), VARIANTS)


def label(report: dict) -> str:
    return "D={head_dim} {dtype} stages={num_stages} pingpong={pingpong}".format(**report)


def test_forward_compiles_for_hopper(reports):
    """Every variant uses wgmma, fits the consumers' register budget without spilling and
    Hopper's shared memory, and keeps the softmax's exponentials between the wait for S and
    the wait for P V (ptxas did not hoist the latter above them)."""
    assert len(reports) == len(VARIANTS)
    for report in reports:
        name = label(report)
        assert report["wgmma"], f"{name}: no warpgroup MMA"
        assert not report["warnings"], f"{name}: {report['warnings']}"  # wgmma serialised
        assert report["spills"] <= SPILL_LIMIT, f"{name}: {report['spills']} bytes of spills"
        assert report["max_register"] <= CONSUMER_REGISTERS, name
        assert CONSUMER_REGISTERS in report["setmaxnreg"], f"{name}: {report['setmaxnreg']}"
        assert report["shared"] <= HOPPER_SHARED_MEMORY, f"{name}: {report['shared']} bytes"
        # 64 query rows x 128 keys over 128 threads: 64 exponentials a thread a block.
        assert report["overlapped_exps"] >= 64, f"{name}: {report['overlapped_exps']}"


def test_shared_memory_need_bounds_the_compiled_kernel(reports):
    """forward.shared_memory_need, by which the launcher refuses stages that cannot launch,
    is at least what Triton allocates and at most 4 KiB above it."""
    from flash_msa.ops.gluon import forward

    for report in reports:
        need = forward.shared_memory_need(report["head_dim"], report["num_stages"])
        assert report["shared"] <= need <= report["shared"] + 4096, (label(report), need)


def test_refuses_cpu_tensors():
    from flash_msa.ops.gluon import attention_forward

    q, k, v = random_qkv(1, 128, 2, 64)
    layout = patterns.from_dense_mask(torch.ones(1, 1, dtype=torch.bool), seq_len_q=128)
    with pytest.raises(ValueError, match="CUDA"):
        attention_forward(q, k, v, layout.row_offsets, layout.col_indices, softmax_scale=0.125)


# ---- on the GPU ----------------------------------------------------------------------------


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def random_layout(batch, heads, num_blocks, density, seed, empty_row):
    """A random block mask [batch, heads, nq, nq] with an empty row when asked (row 1 of
    head 0), as a layout; layout_batch = batch."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, heads, num_blocks, num_blocks, generator=generator) < density
    mask[..., 0] = True  # every other row has a block
    if empty_row:
        mask[0, 0, 1] = False
    return patterns.from_dense_mask(mask, seq_len_q=num_blocks * 128, block_size=128)


GPU_CASES = {
    # name: batch, seq_len, heads_q, heads_kv, head_dim, (density, layout heads) or None
    "dense-mha-128": (2, 512, 4, 4, 128, None),
    "dense-gqa-64": (1, 384, 4, 2, 64, None),
    "sparse-per-head-128": (2, 768, 4, 4, 128, (0.4, "q")),
    "sparse-gqa-kv-heads-128": (1, 1024, 4, 2, 128, (0.3, "kv")),
}


# (case, dtype, num_stages, pingpong): every case in both dtypes with the launcher's
# defaults, and the other rings and turn-taking on a dense and a sparse case.
GPU_RUNS = [
    *((name, dtype, 3, True) for name in GPU_CASES for dtype in (torch.bfloat16, torch.float16)),
    *(("dense-mha-128", torch.bfloat16, stages, pingpong)
      for stages, pingpong in ((2, True), (2, False), (3, False))),
    *(("sparse-per-head-128", torch.bfloat16, stages, pingpong)
      for stages, pingpong in ((2, True), (2, False), (3, False))),
    ("dense-gqa-64", torch.bfloat16, 4, True),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("name, dtype, num_stages, pingpong", GPU_RUNS)
def test_within_twice_torch_error(name, dtype, num_stages, pingpong, poisoned_allocations):
    """out and lse against float64: error at most 2x that of PyTorch in the same dtype;
    outputs poisoned with NaN first, so an element left unwritten fails."""
    if not hopper():
        pytest.skip("needs an sm_90 GPU (H100 / H200)")
    from flash_msa.ops.gluon import attention_forward

    batch, seq_len, heads_q, heads_kv, head_dim, sparsity = GPU_CASES[name]
    num_blocks = seq_len // 128
    if sparsity is None:
        layout = patterns.from_dense_mask(
            torch.ones(num_blocks, num_blocks, dtype=torch.bool), seq_len_q=seq_len
        )
    else:
        density, which = sparsity
        heads = heads_q if which == "q" else heads_kv
        layout = random_layout(batch, heads, num_blocks, density, seed=7, empty_row=True)
    layout = layout.to("cuda")
    q, k, v = random_qkv(batch, seq_len, heads_q, head_dim, heads_kv=heads_kv, dtype=dtype,
                         device="cuda", seed=3)  # fmt: skip
    scale = head_dim**-0.5
    out, lse = attention_forward(
        q, k, v, layout.row_offsets, layout.col_indices, softmax_scale=scale,
        layout_batch=layout.layout_batch, num_stages=num_stages, pingpong=pingpong,
    )  # fmt: skip
    mask = layout_mask(layout, batch, heads_q)
    exact = attention_reference(q.double(), k.double(), v.double(), mask, scale)
    same_dtype = attention_reference(q, k, v, mask, scale)
    assert out.dtype == dtype and lse.dtype == torch.float32
    for label, mine, theirs, truth in zip(("out", "lse"), (out, lse), same_dtype, exact,
                                          strict=True):  # fmt: skip
        error, torch_error = relative_error(mine, truth), relative_error(theirs, truth)
        assert error <= 2 * torch_error + 1e-6, f"{label}: {error:.3g} vs torch {torch_error:.3g}"


@pytest.mark.gpu
def test_refuses_what_it_does_not_handle():
    if not hopper():
        pytest.skip("needs an sm_90 GPU (H100 / H200)")
    from flash_msa.ops.gluon import attention_forward

    layout = patterns.from_dense_mask(torch.ones(2, 2, dtype=torch.bool), seq_len_q=256)
    layout = layout.to("cuda")
    arguments = (layout.row_offsets, layout.col_indices)
    q, k, v = random_qkv(1, 256, 2, 128, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="multiple of 128"):
        attention_forward(q[:, :200], k, v, *arguments, softmax_scale=0.1)
    with pytest.raises(ValueError, match="head dim"):
        attention_forward(q[..., :96], k[..., :96], v[..., :96], *arguments, softmax_scale=0.1)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        attention_forward(q.float(), k.float(), v.float(), *arguments, softmax_scale=0.1)
    with pytest.raises(ValueError, match="row_offsets"):
        attention_forward(q, k, v, layout.row_offsets[:, :2], layout.col_indices,
                          softmax_scale=0.1)  # fmt: skip
    with pytest.raises(ValueError, match="shared memory"):
        attention_forward(q, k, v, *arguments, softmax_scale=0.1, num_stages=4)
