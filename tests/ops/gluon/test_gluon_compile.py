"""The Gluon forward: its sm_90 code compiled on any machine (wgmma, registers, spills,
shared memory, the softmax beside the P V matmul, the unmasked variant's instructions; the
backward's too: wgmma, register budgets, shared memory), and
on an H100 / H200 its output and lse against float64 by FlashAttention's rule, unmasked and
masked (causal, windows, documents, ragged lengths).
"""

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import triton

from flash_msa import _env, patterns
from flash_msa.layout import BlockLayout
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.testing import random_qkv, relative_error

HOPPER_SHARED_MEMORY = 232_448
CONSUMER_REGISTERS = 240  # forward.CONSUMER_REGISTERS, the consumers' setmaxnreg budget
MASK_NAMES = ("left", "right", "documents", "kv_tail", "q_tail")  # forward.Masks' fields

# The unmasked kernel's instructions (codegen.sass_fingerprint) with a program per tile,
# per Triton version (its bundled ptxas): those timed at 071849a (the GQA launch order,
# benchmarks/results/h200/tile_order.md); a change to the fast path must be deliberate.
# (head_dim, dtype, num_stages, pingpong) -> fingerprint.
FAST_PATH_SASS = {
    "3.6.0": {
        (128, "bf16", 2, True): "aa1df615ede0bd4e",
        (128, "bf16", 2, False): "31511ce68d56889a",
        (128, "fp16", 2, True): "f0aade721d4fb30c",
        (64, "bf16", 3, True): "a1dbf9e06f99ea5e",
    },
}

# Compiles the variants given as JSON on argv[2] ([[head_dim, dtype, num_stages, pingpong,
# {mask: True, ...}, persistent, pack], ...]) into the folder argv[1]; prints one JSON report
# per variant.
SCRIPT = """
import json, sys
from flash_msa.ops.gluon import codegen, forward
for head_dim, dtype, num_stages, pingpong, masks, persistent, pack in json.loads(sys.argv[2]):
    report = codegen.compile_forward(sys.argv[1], head_dim=head_dim, dtype=dtype,
                                     num_stages=num_stages, pingpong=pingpong,
                                     masks=forward.Masks(**masks), persistent=persistent,
                                     pack=pack)
    print(json.dumps(dict(report, head_dim=head_dim, dtype=dtype, num_stages=num_stages,
                          pingpong=pingpong, masks=masks, persistent=persistent, pack=pack)))
"""
# The same for the backward: [[head_dim, dtype, num_stages, grad_q, {mask: True, ...}, pack],
# ...].
BACKWARD_SCRIPT = """
import json, sys
from flash_msa.ops.gluon import codegen, forward
for head_dim, dtype, num_stages, grad_q, masks, pack in json.loads(sys.argv[2]):
    report = codegen.compile_backward(sys.argv[1], head_dim=head_dim, dtype=dtype,
                                      num_stages=num_stages, grad_q=grad_q,
                                      masks=forward.Masks(**masks), pack=pack)
    print(json.dumps(dict(report, grad_q=grad_q, masks=masks, pack=pack)))
"""


def compile_variants(folder, variants: list, script: str = SCRIPT) -> list[dict]:
    """Reports of the variants, compiled by up to 4 child processes at once."""
    try:
        from flash_msa.ops.gluon import codegen
    except ImportError as error:  # a Triton without Gluon, or an older Gluon API
        pytest.skip(f"this Triton cannot build the Gluon kernels: {error}")
    reason = codegen.available()
    if reason is not None:
        pytest.skip(reason)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(folder / "cache")
    workers = max(1, min(4, os.cpu_count() or 1))

    def start(chunk: list) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", script, str(folder), json.dumps(chunk)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    children = [start(variants[index::workers]) for index in range(workers)]
    reports = []
    for child in children:
        out, err = child.communicate(timeout=1800)
        assert child.returncode == 0, err[-3000:]
        reports += [json.loads(line) for line in out.splitlines()]
    return reports


# At the default launch (D=128, bf16, 2 stages, ping-pong: the most registers) no mask,
# causal alone and all five masks, a program per tile and persistent (docs/performance.md);
# the unmasked variant at the other launches, whose instructions are pinned above; tiles
# of packed query heads (MSA's main attention: 8 positions x 16 heads with per-token query
# masks, 64 x 2 per query block) with and without them.
ALL_MASKS = dict.fromkeys(MASK_NAMES, True)
MASK_COMBINATIONS = [{}, {"right": True}, ALL_MASKS]
PER_TOKEN = {"right": True, "query": True, "q_tail": True, "kv_tail": True}
VARIANTS = [
    *([128, "bf16", 2, True, masks, persistent, 1] for masks in MASK_COMBINATIONS
      for persistent in (False, True)),
    *([*launch, {}, False, 1] for launch in ([128, "bf16", 2, False], [128, "fp16", 2, True],
                                             [64, "bf16", 3, True])),
    [128, "bf16", 2, True, PER_TOKEN, False, 16], [128, "bf16", 2, True, PER_TOKEN, True, 16],
    [64, "fp16", 2, True, {**ALL_MASKS, "query": True}, False, 8],
    [128, "bf16", 2, True, {"right": True}, False, 2],
]  # fmt: skip


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    return compile_variants(tmp_path_factory.mktemp("sm90"), VARIANTS)


def label(report: dict) -> str:
    masks = "+".join(report["masks"]) or "no masks"
    return f"D={report['head_dim']} {report['dtype']} stages={report['num_stages']} " \
           f"pingpong={report['pingpong']} persistent={report['persistent']} " \
           f"pack={report['pack']} {masks}"  # fmt: skip


def test_forward_compiles_for_hopper(reports):
    """Every variant uses wgmma, fits the consumers' register budget without spilling and
    Hopper's shared memory, and keeps the softmax's exponentials between the wait for S and
    the wait for P V (ptxas did not hoist the latter above them)."""
    assert len(reports) == len(VARIANTS)
    for report in reports:
        name = label(report)
        assert report["wgmma"], f"{name}: no warpgroup MMA"
        assert not report["warnings"], f"{name}: {report['warnings']}"  # wgmma serialised
        # None in the partitions' code; persistent with all five masks ptxas keeps one
        # register across setmaxnreg, stored before it (docs/performance.md).
        assert report["partition_spill_stores"] == 0, f"{name}: {report['spills']} bytes"
        if not report["persistent"]:
            assert report["spills"] == 0, f"{name}: {report['spills']} bytes of spills"
        assert report["max_register"] <= CONSUMER_REGISTERS, name
        assert CONSUMER_REGISTERS in report["setmaxnreg"], f"{name}: {report['setmaxnreg']}"
        assert report["shared"] <= HOPPER_SHARED_MEMORY, f"{name}: {report['shared']} bytes"
        # 64 query rows x 128 keys over 128 threads: 64 exponentials a thread a block.
        assert report["overlapped_exps"] >= 64, f"{name}: {report['overlapped_exps']}"


def test_backward_compiles_for_hopper(tmp_path):
    """The backward in each dQ mode (the Triton dQ kernel's with every mask), and over
    query blocks of packed heads with per-token query masks (MSA's 8 x 16 per token, 64 x
    2) with dQ from the dQ kernel or added in the kernel, uses wgmma within the consumers'
    register budget and Hopper's shared memory. Its spills are measured, not pinned
    (docs/performance.md)."""
    variants = [[128, "bf16", 2, "atomic", {}, 1], [64, "bf16", 2, "ordered", ALL_MASKS, 1],
                [128, "fp16", 3, "triton", ALL_MASKS, 1],
                [128, "bf16", 2, "triton", PER_TOKEN, 16],
                [128, "bf16", 2, "atomic", PER_TOKEN, 16],
                [64, "fp16", 2, "atomic", {**ALL_MASKS, "query": True}, 2],
                [64, "fp16", 2, "triton", {**ALL_MASKS, "query": True}, 2]]  # fmt: skip
    reports = compile_variants(tmp_path, variants, BACKWARD_SCRIPT)
    assert len(reports) == len(variants)
    for report in reports:
        name = (f"grad_q={report['grad_q']} pack={report['pack']} "
                f"{'+'.join(report['masks']) or 'no masks'}")  # fmt: skip
        assert report["wgmma"], f"{name}: no warpgroup MMA"
        assert not report["warnings"], f"{name}: {report['warnings']}"
        assert report["max_register"] <= CONSUMER_REGISTERS, name
        assert CONSUMER_REGISTERS in report["setmaxnreg"], f"{name}: {report['setmaxnreg']}"
        assert report["shared"] <= HOPPER_SHARED_MEMORY, f"{name}: {report['shared']} bytes"


# The Gluon dQ kernel: [[head_dim, dtype, num_stages, {mask: True, ...}, pack], ...].
GRAD_Q_SCRIPT = """
import json, sys
from flash_msa.ops.gluon import codegen, forward
for head_dim, dtype, num_stages, masks, pack in json.loads(sys.argv[2]):
    report = codegen.compile_grad_q(sys.argv[1], head_dim=head_dim, dtype=dtype,
                                    num_stages=num_stages, masks=forward.Masks(**masks),
                                    pack=pack)
    print(json.dumps(dict(report, head_dim=head_dim, masks=masks, pack=pack)))
"""


def test_grad_q_kernel_compiles_for_hopper(tmp_path):
    """The Gluon dQ kernel, unmasked, with every mask, and over packed heads with per-token
    query masks: wgmma not serialised (ptxas notes none), within the consumers' registers
    and Hopper's shared memory, without spills where no mask needs registers, and every
    exponential of a block between the wait for S and the wait for dS K and dP."""
    variants = [[128, "bf16", 2, {}, 1], [128, "fp16", 2, ALL_MASKS, 1],
                [128, "bf16", 2, PER_TOKEN, 16],
                [64, "bf16", 2, {**ALL_MASKS, "query": True}, 2]]  # fmt: skip
    reports = compile_variants(tmp_path, variants, GRAD_Q_SCRIPT)
    assert len(reports) == len(variants)
    for report in reports:
        name = f"D={report['head_dim']} pack={report['pack']} {'+'.join(report['masks'])}"
        assert report["wgmma"], f"{name}: no warpgroup MMA"
        assert not report["warnings"], f"{name}: {report['warnings']}"
        assert report["max_register"] <= CONSUMER_REGISTERS, name
        assert report["shared"] <= HOPPER_SHARED_MEMORY, f"{name}: {report['shared']} bytes"
        if not report["masks"]:
            assert report["spills"] == 0, f"{name}: {report['spills']} bytes of spills"
        # 64 query rows x 128 keys over 128 threads: 64 exponentials a thread a block.
        assert report["overlapped_exps"] >= 64, f"{name}: {report['overlapped_exps']}"


def test_unmasked_variant_keeps_its_instructions(reports):
    """Without masks the kernel compiles to the pinned instructions (the measured fast
    path), up to shared-memory offsets."""
    expected = FAST_PATH_SASS.get(triton.__version__)
    if expected is None:
        pytest.skip(f"no recorded fingerprints for Triton {triton.__version__}")
    unmasked = {
        (r["head_dim"], r["dtype"], r["num_stages"], r["pingpong"]): r["fingerprint"]
        for r in reports
        if not r["masks"] and not r["persistent"] and r["pack"] == 1
    }
    assert unmasked == expected


def test_shared_memory_need_bounds_the_compiled_kernel(reports):
    """forward.shared_memory_need, by which the launcher refuses stages that cannot launch,
    is at least what Triton allocates and at most 4 KiB above it."""
    from flash_msa.ops.gluon import forward

    for report in reports:
        need = forward.shared_memory_need(report["head_dim"], report["num_stages"])
        assert report["shared"] <= need <= report["shared"] + 4096, (label(report), need)


@pytest.mark.parametrize("q_block, head_dim, expected", [
    (8, 128, 2048),  # 8 x 16 tiles: 138 MB of Q and dO in flight, aligned to the span
    (16, 128, 2048),  # 16 x 8 tiles: 69 MB
    (32, 128, 2048),  # 32 x 4 tiles: 35 MB
    (32, 64, 0),  # 17 MB, as 64 x 2 tiles at D 128: the plain walk
    (64, 128, 0),
])  # fmt: skip
def test_backward_aligns_walks_whose_working_set_overflows_the_l2(q_block, head_dim, expected):
    from flash_msa.ops.gluon import walk

    cpu = torch.device("cpu")  # an H100's multiprocessors and L2
    position_bytes = 128 // q_block * 2 * head_dim * 2  # Q and dO of the packed heads, bf16
    window = patterns.sliding_window(32768, 2048, q_block=q_block).transpose()
    assert walk.walk_alignment(window, position_bytes, cpu) == expected
    causal = patterns.causal(32768, q_block=q_block).transpose()
    assert walk.walk_alignment(causal, position_bytes, cpu) == (expected and walk.MAX_ALIGN)


def test_backward_of_packed_tiles_refuses_the_ordered_mode():
    """The ordered mode counts its adds per query half of one head: over query blocks of
    packed heads the backward refuses it before any launch, naming the modes left."""
    from flash_msa.ops.gluon import backward

    q, k, v = random_qkv(1, 256, 16, 64)
    layout = patterns.causal(256, q_block=8, kv_block=128)
    lse = torch.zeros(1, 16, 256)
    with pytest.raises(ValueError, match="q_block 8 packs 16 heads a tile, use grad_q='triton' "
                                         "or 'atomic'"):  # fmt: skip
        backward.attention_backward(q, q, k, v, q, lse, layout, causal=True,
                                    window_size=(-1, -1), softmax_scale=0.125,
                                    grad_q="ordered")  # fmt: skip


@pytest.mark.parametrize("q_block, deterministic, available, grad_q", [
    (128, True, None, ["triton"]), (64, True, None, ["triton"]), (8, True, None, ["triton"]),
    # deterministic=False: both modes, each run twice (compiled, then timed) on a new key
    (128, False, None, ["atomic", "atomic", "triton", "triton"]),
    (8, False, None, ["atomic", "atomic", "triton", "triton"]),
    # the atomic mode's fp32 dQ buffer (4 bytes an element of q) must fit the free memory
    (8, False, 4 * 256 * 16 * 64, ["atomic", "atomic", "triton", "triton"]),
    (8, False, 4 * 256 * 16 * 64 - 1, ["triton"]), (128, False, 0, ["triton"]),
])  # fmt: skip
def test_registry_backward_takes_the_dq_mode(monkeypatch, q_block, deterministic, available,
                                             grad_q):  # fmt: skip
    """The gluon backend's backward takes the Triton dQ kernel when deterministic; with
    deterministic=False, where the atomic mode's fp32 buffer fits the device's free memory
    (available: bytes; None: plenty), the first call of a key times both modes and the
    next call takes the faster (here the Triton dQ: the atomic mode is made slower)."""
    from flash_msa.ops import gluon
    from flash_msa.ops.fastest import FastestPath

    taken = []

    def attention_backward(*args, grad_q, **kwargs):
        taken.append(grad_q)
        time.sleep(0.02 if grad_q == "atomic" else 0.0)

    monkeypatch.setattr(gluon.backward, "attention_backward", attention_backward)
    monkeypatch.setattr(gluon, "_NONDETERMINISTIC_DQ", FastestPath(("atomic", "triton")))
    monkeypatch.setattr(_env, "available_bytes",
                        lambda device: 1 << 40 if available is None else available)  # fmt: skip
    layout = patterns.causal(256, q_block=q_block, kv_block=128)
    q = torch.zeros(1, 256, 16, 64)
    for _ in range(2):
        gluon._backward(q, q, q, q, q, None, layout, causal=True, window_size=(-1, -1),
                        softmax_scale=0.125, document_ids=None, query_masks=None,
                        deterministic=deterministic)  # fmt: skip
    assert taken == grad_q + [grad_q[-1]]


def test_refuses_cpu_tensors_and_bad_mask_options():
    from flash_msa.ops.gluon import attention_forward

    q, k, v = random_qkv(1, 128, 2, 64)
    layout = patterns.from_dense_mask(torch.ones(1, 1, dtype=torch.bool), seq_len_q=128)
    arguments = (q, k, v, layout.row_offsets, layout.col_indices)
    with pytest.raises(ValueError, match="CUDA"):
        attention_forward(*arguments, softmax_scale=0.125)
    with pytest.raises(TypeError, match="causal must be a bool"):
        attention_forward(*arguments, softmax_scale=0.125, causal=1)
    with pytest.raises(ValueError, match="window_size must be a tuple of two ints"):
        attention_forward(*arguments, softmax_scale=0.125, window_size=[4, 4])


# ---- on the GPU ----------------------------------------------------------------------------


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def random_layout(batch, heads, seq_len, density, seed, empty_row=False) -> BlockLayout:
    """A random block mask [batch, heads, nq, nq] (blocks of 128, nq = ceil(S / 128)) with
    an empty row when asked (row 1 of head 0), as a layout; layout_batch = batch."""
    num_blocks = -(-seq_len // 128)
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, heads, num_blocks, num_blocks, generator=generator) < density
    mask[..., 0] = True  # every other row has a block
    if empty_row:
        mask[0, 0, 1] = False
    return patterns.from_dense_mask(mask, seq_len_q=seq_len, block_size=128)


def dense_layout(seq_len_q, seq_len_kv=None) -> BlockLayout:
    seq_len_kv = seq_len_q if seq_len_kv is None else seq_len_kv
    mask = torch.ones(-(-seq_len_q // 128), -(-seq_len_kv // 128), dtype=torch.bool)
    return patterns.from_dense_mask(mask, seq_len_q=seq_len_q, seq_len_kv=seq_len_kv)


def above_the_diagonal(seq_len: int, row: int) -> BlockLayout:
    """The causal diagonal for every block row but `row`, which has the two blocks after it
    only: under the causal mask its queries see no key."""
    num_blocks = -(-seq_len // 128)
    mask = torch.eye(num_blocks, dtype=torch.bool)
    mask[row] = False
    mask[row, row + 1 : row + 3] = True
    return patterns.from_dense_mask(mask, seq_len_q=seq_len)


def random_document_ids(batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """int32 [B, S], non-decreasing: runs of 1 to 400 tokens, some of one token."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < seq_len:
            lengths += [int(torch.randint(1, 400, (1,), generator=generator)), 1]
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return torch.stack([row[:seq_len] for row in rows]).int()


class Case(NamedTuple):
    batch: int
    seq_len_q: int
    seq_len_kv: int
    heads_q: int
    heads_kv: int
    head_dim: int
    layout: Callable[[], BlockLayout]  # built on the CPU
    causal: bool = False
    window_size: tuple[int, int] = (-1, -1)
    documents: bool = False  # random document ids (S_q == S_kv)


GPU_CASES = {
    # whole blocks, no masks
    "dense-mha-128": Case(2, 512, 512, 4, 4, 128, lambda: dense_layout(512)),
    "dense-gqa-64": Case(1, 384, 384, 4, 2, 64, lambda: dense_layout(384)),
    "sparse-per-head-128": Case(2, 768, 768, 4, 4, 128,
                                lambda: random_layout(2, 4, 768, 0.4, seed=7, empty_row=True)),
    "sparse-gqa-kv-heads-128": Case(1, 1024, 1024, 4, 2, 128,
                                    lambda: random_layout(1, 2, 1024, 0.3, seed=7, empty_row=True)),
    # the causal diagonal
    "causal-mha-128": Case(2, 640, 640, 4, 4, 128, lambda: patterns.causal(640), causal=True),
    # ragged tails: 1000 = 7 * 128 + 104 (both halves of the last tile hold rows), 650 = 5 *
    # 128 + 10 (the lower half is past S_q), S_q != S_kv
    "causal-ragged-gqa-64": Case(2, 1000, 1000, 4, 2, 64, lambda: patterns.causal(1000),
                                 causal=True),
    "causal-short-tail-128": Case(3, 650, 650, 2, 1, 128, lambda: patterns.causal(650),
                                  causal=True),
    "causal-cross-lengths-128": Case(2, 300, 1000, 4, 2, 128, lambda: dense_layout(300, 1000),
                                     causal=True),
    "ragged-only-128": Case(2, 1000, 300, 4, 4, 128, lambda: dense_layout(1000, 300)),
    # window edges
    "window-both-128": Case(1, 1536, 1536, 4, 4, 128,
                            lambda: patterns.sliding_window(1536, 512, causal=False),
                            window_size=(200, 100)),
    "window-left-causal-gqa-128": Case(2, 777, 777, 4, 2, 128,
                                       lambda: patterns.sliding_window(777, 256),
                                       causal=True, window_size=(100, -1)),
    "window-sinks-causal-128": Case(1, 2048, 2048, 4, 4, 128, lambda: patterns.sliding_window(
        2048, 512) | patterns.global_tokens(2048, 128), causal=True),
    # document boundaries
    "documents-causal-ragged-128": Case(2, 900, 900, 4, 2, 128, lambda: patterns.causal(900),
                                        causal=True, documents=True),
    "documents-window-64": Case(2, 833, 833, 2, 2, 64, lambda: dense_layout(833),
                                window_size=(64, 64), documents=True),
    # blocks above the diagonal hide every score: rows that see nothing have zero output and
    # lse -inf; per-head layouts
    "causal-per-head-random-128": Case(2, 700, 700, 4, 4, 128,
                                       lambda: random_layout(2, 4, 700, 0.5, seed=3), causal=True),
    "causal-sees-nothing-128": Case(1, 640, 640, 2, 2, 128, lambda: above_the_diagonal(640, 2),
                                    causal=True),
    "causal-kv-heads-random-64": Case(1, 1000, 1000, 4, 2, 64,
                                      lambda: random_layout(1, 2, 1000, 0.4, 5, empty_row=True),
                                      causal=True),
}  # fmt: skip


# (case, dtype, launch options): every case in both dtypes with the launcher's defaults (a
# program per tile), then on an unmasked, a sparse (an empty row), a ragged and a document
# case: persistent programs walking several tiles (the ring's, the query halves' and the
# turns' phases running on across tiles, rows without blocks between them), without
# turn-taking, and deeper rings at D = 64.
GPU_RUNS = [
    *((name, dtype, {}) for name in GPU_CASES for dtype in (torch.bfloat16, torch.float16)),
    *((name, torch.bfloat16, options)
      for name in ("dense-mha-128", "sparse-per-head-128", "causal-ragged-gqa-64",
                   "documents-causal-ragged-128")
      for options in ({"programs": 1}, {"programs": 5}, {"programs": 3, "pingpong": False},
                      {"pingpong": False})),
    ("dense-gqa-64", torch.bfloat16, {"num_stages": 4, "programs": 2}),
    ("causal-ragged-gqa-64", torch.bfloat16, {"num_stages": 3, "programs": 7}),
    ("causal-sees-nothing-128", torch.bfloat16, {"programs": 2}),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("name, dtype, options", GPU_RUNS)
def test_within_twice_torch_error(name, dtype, options, poisoned_allocations):
    """out and lse against float64: error at most 2x that of PyTorch in the same dtype;
    outputs poisoned with NaN first, so an element left unwritten fails."""
    if not hopper():
        pytest.skip("needs an sm_90 GPU (H100 / H200)")
    from flash_msa.ops.gluon import attention_forward

    case = GPU_CASES[name]
    layout = case.layout().to("cuda")
    q, k, v = random_qkv(case.batch, case.seq_len_q, case.heads_q, case.head_dim,
                         seq_len_kv=case.seq_len_kv, heads_kv=case.heads_kv, dtype=dtype,
                         device="cuda", seed=3)  # fmt: skip
    documents = (
        random_document_ids(case.batch, case.seq_len_q, seed=11).cuda() if case.documents else None
    )
    scale = case.head_dim**-0.5
    out, lse = attention_forward(
        q, k, v, layout.row_offsets, layout.col_indices, softmax_scale=scale,
        layout_batch=layout.layout_batch, causal=case.causal, window_size=case.window_size,
        document_ids=documents, **options,
    )  # fmt: skip
    mask = layout_mask(layout, case.batch, case.heads_q, causal=case.causal,
                       window_size=case.window_size, document_ids=documents)  # fmt: skip
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
    documents = torch.zeros(1, 256, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="row_offsets must be"):
        attention_forward(q[:, :100], k, v, *arguments, softmax_scale=0.1)  # 1 query block
    with pytest.raises(ValueError, match="head dim"):
        attention_forward(q[..., :96], k[..., :96], v[..., :96], *arguments, softmax_scale=0.1)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        attention_forward(q.float(), k.float(), v.float(), *arguments, softmax_scale=0.1)
    with pytest.raises(ValueError, match="row_offsets"):
        attention_forward(q, k, v, layout.row_offsets[:, :2], layout.col_indices,
                          softmax_scale=0.1)  # fmt: skip
    with pytest.raises(ValueError, match="shared memory"):
        attention_forward(q, k, v, *arguments, softmax_scale=0.1, num_stages=3)
    with pytest.raises(ValueError, match="row_order must be"):
        attention_forward(
            q,
            k,
            v,
            *arguments,
            softmax_scale=0.1,
            row_order=torch.arange(3, dtype=torch.int32, device="cuda"),
        )
    with pytest.raises(ValueError, match="programs must be"):
        attention_forward(q, k, v, *arguments, softmax_scale=0.1, programs=0)
    with pytest.raises(TypeError, match="document_ids must be int32"):
        attention_forward(q, k, v, *arguments, softmax_scale=0.1, document_ids=documents.long())
    with pytest.raises(ValueError, match="document_ids must be"):
        attention_forward(q, k, v, *arguments, softmax_scale=0.1, document_ids=documents[:, :9])
    with pytest.raises(ValueError, match="document_ids needs S_q == S_kv"):
        attention_forward(q, k[:, :200], v[:, :200], *arguments, softmax_scale=0.1,
                          document_ids=documents)  # fmt: skip
