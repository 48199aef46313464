"""Property-based fuzz of block_sparse_attn_func and block_sparse_attn_varlen_func.

Hypothesis draws valid and invalid inputs alike: shapes (ranks, zero sizes, mismatched batch,
heads and head dims), dtypes, strides and views (transposed storage, slices with a step,
expanded tensors), layouts (pattern builders and hand-built CSR tensors: empty, broadcast,
non-contiguous views, wrong sizes), options, document ids and cu_seqlens. Each case knows
whether it holds a fault. A call must then raise ValueError or TypeError with a message
(and must raise when the case holds a fault, or asks a backend for what it declares it does
not support), or return out (and lse, and gradients through backward) that match float64
ground truth: 1e-4 relative in fp32 (or twice PyTorch's own fp32 error, where a saturated
softmax makes that larger); in fp16 / bf16 at most twice the error of the same computation
by PyTorch in that dtype, plus one unit of rounding. Nothing is NaN unless an input is.

Both backends run: "torch" and "triton" (the CPU interpreter: small shapes, fp16 and fp32).
HYPOTHESIS_PROFILE=long (tests/conftest.py) runs many more cases, fresh ones each run.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from flash_msa import (
    BlockLayout,
    _env,
    block_sparse_attn_func,
    block_sparse_attn_varlen_func,
    patterns,
)
from flash_msa.ops.registry import lse_dtype
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.sequences import document_ids_of
from flash_msa.testing import relative_error

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not _env.interpreting(), reason="CPU interpreter runs"
)

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
NOT_FLOATS = (torch.int32, torch.int64, torch.bool)
BAD_BACKENDS = ("cuda", "", "Torch", None, 3)
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}  # relative, against float64


def fuzz_settings(examples: int):
    """`examples` cases, the same each run; the long profile chooses its own count and
    draws fresh cases."""
    if settings.get_current_profile_name() == "long":
        return settings(deadline=None)
    return settings(max_examples=examples, deadline=None, derandomize=True)


@dataclass
class Case:
    """One call, described in plain values (build_tensors, build_layout and build_documents
    make what the call receives)."""

    api: str  # "dense" or "varlen"
    backend: object
    dtype: torch.dtype
    batch: int
    seq_q: int
    seq_kv: int
    heads_q: int
    heads_kv: int
    head_dim: int
    storage: tuple[str, str, str]  # memory layout of q, k, v
    grad_storage: str
    layout: dict
    options: dict
    documents: dict = field(default_factory=dict)  # document_ids, or cu_seqlens/max_seqlen
    tensor_fault: str | None = None
    faults: tuple[str, ...] = ()  # every reason the call must be refused
    nan_input: bool = False
    seed: int = 0


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---- drawing -------------------------------------------------------------------------------
TENSOR_FAULTS = {
    "dense": ["not_tensor", "rank_q", "rank_k", "batch", "heads", "head_dim", "kv_shape",
              "zero_heads", "zero_head_dim", "zero_seq", "dtype_mix", "device_mix", "meta",
              "not_float"],
    "varlen": ["not_tensor", "rank_q", "rank_k", "tokens", "heads", "head_dim", "kv_shape",
               "zero_heads", "zero_head_dim", "dtype_mix", "device_mix", "not_float"],
}  # fmt: skip
LAYOUT_FAULTS = ["not_layout", "seq_q", "seq_kv", "layout_batch", "layout_heads", "device",
                 "row_shape", "col_range", "offsets_dtype", "modified"]  # fmt: skip
OPTION_FAULTS = {
    "causal": [1, None, "yes"],
    "window_size": [(True, False), (-2, 0), (0, -2), (4,), (1, 2, 3), (1.0, 2), "ab", None],
    "softmax_scale": [0, 0.0, -0.5, -math.inf, math.inf, math.nan, True, False, 1e5, 1e38,
                      3e38, 1e300, 10**400, "0.5"],
    "dropout_p": [1.0, -0.1, True, math.nan, math.inf, "0.1", 10**400],
    "return_lse": [1, None],
    "deterministic": [1, None],
}  # fmt: skip
CU_FAULTS = ["unsorted", "int64", "float", "end", "start", "two_d", "list", "meta", "short",
             "max_small", "max_bool", "max_float", "max_negative"]  # fmt: skip
DOCUMENT_FAULTS = ["decreasing", "float", "shape", "meta"]


# What a case gets wrong: one kind of fault, or nothing (valid: `valid` times as likely).
FAULT_KINDS = ("tensor", "tensor", "layout", "layout", "option", "option", "documents",
               "backend")  # fmt: skip


@st.composite
def cases(draw, api: str, backends: tuple, valid: int = 8):
    kind = draw(st.sampled_from((None,) * valid + FAULT_KINDS))
    backend = draw(st.sampled_from(BAD_BACKENDS if kind == "backend" else backends))
    # The rest from one drawn seed: each case independent of the others. (Hypothesis would
    # explore a space this large by mutating earlier cases, repeating most of them.)
    rng = random.Random(draw(st.integers(0, 2**64 - 1)))
    pick, integer = rng.choice, rng.randint

    def coin():
        return rng.random() < 0.5

    triton = backend == "triton"
    faults = [f"backend={backend!r}"] if kind == "backend" else []
    if triton:  # the interpreter is slow: few programs
        batch = 1 if api == "varlen" else pick([1, 1, 2, 0])
        heads_kv = pick([1, 1, 2])
        heads_q = heads_kv * pick([1, 2, 4] if heads_kv == 1 else [1, 2])
        seq_q = integer(1, 96)
        seq_kv = seq_q if api == "varlen" or coin() else integer(1, 96)
        dtype = pick([torch.float32, torch.float32, torch.float16,
                                      torch.float16, torch.bfloat16, torch.float64])  # fmt: skip
    else:
        batch = 1 if api == "varlen" else pick([1, 2, 2, 3, 0])
        heads_kv = pick([1, 2, 3])
        heads_q = heads_kv * pick([1, 2, 4])
        seq_q = integer(1, 128)
        seq_kv = seq_q if api == "varlen" or coin() else integer(1, 128)
        dtype = pick(FLOATS + (torch.float32, torch.float16))
    head_dim = pick([16, 16, 8, 32, 1, 24])

    tensor_fault = pick(TENSOR_FAULTS[api]) if kind == "tensor" else None
    if tensor_fault == "not_float":
        dtype = pick(NOT_FLOATS)
    if tensor_fault is not None:
        faults.append(tensor_fault)
    views = ["contiguous", "contiguous", "bhsd", "step_s", "step_d", "expand_heads"]
    views += ["expand_batch"] if api == "dense" else []
    storage = tuple(pick(views) for _ in range(3))
    grad_storage = pick(["contiguous", "contiguous", "expand_seq", "bhsd"])

    # the layout: a pattern builder, a dense block mask or hand-made CSR tensors
    small = triton and max(seq_q, seq_kv) > 48
    blocks = [32, 64, 128] if small else [16, 32, 64, 128]
    q_block = pick(blocks)
    kv_block = pick(blocks)
    layout_batch = pick([1] + ([batch] if batch > 1 else []))
    layout_heads = pick(divisors(heads_q))
    builders = ["dense_mask", "dense_mask", "hand", "hand", "empty"]
    if seq_q == seq_kv and layout_batch == 1:
        builders += ["causal", "sliding_window", "global_tokens", "random_blocks"]
    if api == "varlen":
        builders += ["causal_documents"]
    layout = dict(
        builder=pick(builders), q_block=q_block, kv_block=kv_block,
        seq_q=seq_q, seq_kv=seq_kv, layout_batch=layout_batch, layout_heads=layout_heads,
        density=pick([0.2, 0.5, 0.8, 1.0]),
        views=pick(["contiguous", "col_view", "row_view", "both"]),
        width=integer(0, 130), pattern_causal=coin(),
        fault=pick(LAYOUT_FAULTS) if kind == "layout" else None,
    )  # fmt: skip
    if layout["fault"] == "modified" and not hasattr(BlockLayout, "check_unchanged"):
        layout["fault"] = None  # not detected yet
    if layout["fault"] in ("row_shape", "col_range", "offsets_dtype"):
        layout["builder"] = "hand"
    if layout["fault"] in ("seq_kv", "layout_batch") and layout["builder"] != "hand":
        layout["builder"] = "dense_mask"  # the pattern builders take one length, one batch
    if layout["fault"] is not None:
        faults.append("layout:" + layout["fault"])

    options = dict(
        causal=coin(),
        window_size=pick([(-1, -1), (-1, -1), "drawn", "drawn", "list", (2**70, 10**30)]),
        softmax_scale=pick([None, None, 1, 0.05, 0.25]) if coin() else rng.uniform(0.01, 4.0)
        / math.sqrt(head_dim),  # logits of std up to 4 (1 by default)
        dropout_p=pick([0.0, 0.0, 0.0, 0, 0.25]),
        return_lse=coin(),
        deterministic=pick([True] * 4 + [False]),
    )
    if options["window_size"] in ("drawn", "list"):
        window = (integer(-1, 140), integer(-1, 140))
        options["window_size"] = list(window) if options["window_size"] == "list" else window
    if kind == "option":
        name = pick(sorted(OPTION_FAULTS))
        options[name] = pick(OPTION_FAULTS[name])
        faults.append(f"{name}={options[name]!r}")

    documents = {}
    if api == "varlen":
        count = integer(1, 4)
        cuts = sorted(integer(0, seq_q) for _ in range(count - 1))
        cu = [0, *cuts, seq_q]
        longest = max(b - a for a, b in zip(cu[:-1], cu[1:], strict=True))
        fault = pick(CU_FAULTS) if kind == "documents" else None
        documents = dict(cu_seqlens=cu, max_seqlen=longest + pick([0, 0, 7]),
                         fault=fault)  # fmt: skip
        if documents["fault"] == "unsorted" and len(set(cu)) < 3:
            documents["fault"] = "start"  # nothing to swap
        if documents["fault"] == "max_small" and longest < 2:
            documents["fault"] = "max_negative"
        if documents["fault"] is not None:
            faults.append("cu_seqlens:" + documents["fault"])
    elif seq_q == seq_kv and (kind == "documents" or rng.random() < 0.2):
        fault = pick(DOCUMENT_FAULTS) if kind == "documents" else None
        documents = dict(document_ids=integer(0, 2**16), fault=fault)
        if fault is not None:
            faults.append("document_ids:" + fault)
    elif kind == "documents":
        documents = dict(document_ids=0, fault="seq_kv")  # document ids need S_q == S_kv
        faults.append("document_ids:seq_kv")

    return Case(
        api=api, backend=backend, dtype=dtype, batch=batch, seq_q=seq_q, seq_kv=seq_kv,
        heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, storage=storage,
        grad_storage=grad_storage, layout=layout, options=options, documents=documents,
        tensor_fault=tensor_fault, faults=tuple(faults),
        nan_input=rng.random() < 0.04, seed=integer(0, 2**16),
    )  # fmt: skip


def refused_by_backend(case: Case) -> bool:
    """Whether the registry must refuse a call with no fault (what a backend declares it does
    not take, on this CPU machine)."""
    chosen = "torch" if case.backend == "auto" else case.backend
    if chosen == "triton" and case.dtype in (torch.float64, torch.bfloat16):
        return True  # float64 is the torch backend's; the interpreter computes bf16 wrongly
    return False


# ---- building ------------------------------------------------------------------------------
def tensor_with_storage(storage, shape, dtype, generator, nan):
    """A leaf `base` and a view of it of `shape` [B, S, H, D] stored as `storage` says."""
    batch, seq, heads, dim = shape
    base_shape = {
        "contiguous": shape, "bhsd": (batch, heads, seq, dim),
        "step_s": (batch, 2 * seq, heads, dim),
        "step_d": (batch, seq, heads, 2 * dim), "expand_heads": (batch, seq, 1, dim),
        "expand_batch": (1, seq, heads, dim),
    }[storage]  # fmt: skip
    if dtype.is_floating_point:
        base = torch.randn(base_shape, generator=generator).to(dtype)
        if nan and base.numel():
            base.view(-1)[0] = float("nan")
    elif dtype == torch.bool:
        base = torch.rand(base_shape, generator=generator) < 0.5
    else:
        base = torch.randint(-3, 4, base_shape, generator=generator, dtype=dtype)

    def view(tensor):
        return {
            "contiguous": lambda t: t, "bhsd": lambda t: t.transpose(1, 2),
            "step_s": lambda t: t[:, ::2], "step_d": lambda t: t[..., ::2],
            "expand_heads": lambda t: t.expand(shape), "expand_batch": lambda t: t.expand(shape),
        }[storage](tensor)  # fmt: skip

    return base, view


def hand_layout(mask, spec, fault):
    """BlockLayout(row_offsets, col_indices) from a bool block mask [L, nq, nk], with the
    tensors stored as non-contiguous views when spec["views"] asks."""
    num_layouts, num_q_blocks, num_kv_blocks = mask.shape
    counts = mask.sum(-1).flatten()
    ends = torch.cumsum(counts, 0)
    flat = torch.cat([counts.new_zeros(1), ends])  # [L * nq + 1]
    rows = torch.arange(num_layouts)[:, None] * num_q_blocks + torch.arange(num_q_blocks + 1)
    row_offsets = flat[rows].int()  # [L, nq + 1]
    col_indices = mask.nonzero()[:, 2].int()
    if fault == "col_range":  # the last entry past the last kv block
        if col_indices.numel() == 0:
            col_indices = col_indices.new_zeros(1)
            row_offsets[-1, -1] = 1
        col_indices[-1] = num_kv_blocks
    if fault == "row_shape":
        row_offsets = row_offsets[:, :-1]
    if fault == "offsets_dtype":
        row_offsets = row_offsets.long()
    if spec["views"] in ("col_view", "both"):
        col_indices = torch.stack([col_indices, torch.zeros_like(col_indices)], 1)[:, 0]
    if spec["views"] in ("row_view", "both"):
        row_offsets = row_offsets.t().contiguous().t()  # column-major storage
    return BlockLayout(
        row_offsets, col_indices, seq_len_q=spec["seq_q"], seq_len_kv=spec["seq_kv"],
        q_block=spec["q_block"], kv_block=spec["kv_block"], layout_batch=spec["layout_batch"],
        layout_heads=spec["layout_heads"],
    )  # fmt: skip


def build_layout(case: Case, cu_seqlens) -> tuple[object, bool]:
    """The layout the call receives, and whether its fault took effect (an empty layout has
    no entry to modify in place)."""
    spec = dict(case.layout)
    fault = spec["fault"]
    if fault == "seq_q":
        spec["seq_q"] = spec["seq_q"] + 17 if spec["seq_q"] < 60 else spec["seq_q"] - 9
    if fault == "seq_kv":
        spec["seq_kv"] = spec["seq_kv"] + 5 if spec["seq_kv"] < 60 else spec["seq_kv"] - 33
    if fault == "layout_batch":
        spec["layout_batch"] = case.batch + 1 if case.batch > 0 else 2
    if fault == "layout_heads":
        spec["layout_heads"] = case.heads_q + 1
    builder, blocks = spec["builder"], dict(q_block=spec["q_block"], kv_block=spec["kv_block"])
    num_q_blocks = -(-spec["seq_q"] // spec["q_block"])
    num_kv_blocks = -(-spec["seq_kv"] // spec["kv_block"])
    generator = torch.Generator().manual_seed(case.seed + 1)
    if builder in ("causal", "sliding_window", "global_tokens", "random_blocks"):
        seq, width, causal = spec["seq_q"], spec["width"], spec["pattern_causal"]
        make = {
            "causal": lambda h: patterns.causal(seq, **blocks),
            "sliding_window": lambda h: patterns.sliding_window(
                seq, min(width + h, seq), causal=causal, **blocks
            ),
            "global_tokens": lambda h: patterns.global_tokens(
                seq, min(width + h, seq), causal=causal, **blocks
            ),
            "random_blocks": lambda h: patterns.random_blocks(
                seq, width % 4, seed=case.seed + h, causal=causal, **blocks
            ),
        }[builder]
        heads = [make(h) for h in range(spec["layout_heads"])]
        layout = heads[0] if len(heads) == 1 else patterns.stack(heads)
    elif builder == "causal_documents":
        layout = patterns.causal(spec["seq_q"], **blocks, cu_seqlens=cu_seqlens)
        if spec["layout_heads"] > 1:
            layout = layout.expand(1, spec["layout_heads"])
    else:
        shape = (spec["layout_batch"], spec["layout_heads"], num_q_blocks, num_kv_blocks)
        mask = torch.rand(shape, generator=generator) < spec["density"]
        if builder == "empty":
            mask = torch.zeros(shape, dtype=torch.bool)
        if builder == "hand":
            layout = hand_layout(mask.flatten(0, 1), spec, fault)
        else:
            layout = patterns.from_dense_mask(
                mask, seq_len_q=spec["seq_q"], seq_len_kv=spec["seq_kv"], **blocks
            )
    if fault == "not_layout":
        return [layout.to_dense(), "causal", None][case.seed % 3], True
    if fault == "device":
        return layout.to("meta"), True
    if fault == "modified":
        if layout.nnz == 0 or num_kv_blocks == 1:
            return layout, False
        layout.col_indices[-1] = (layout.col_indices[-1] + 1) % num_kv_blocks
    return layout, True


def build_tensors(case: Case):
    """(bases, views, shapes): the leaf tensors, the view of each handed to the call."""
    generator = torch.Generator().manual_seed(case.seed)
    batch = case.batch
    seq_q, seq_kv, heads_q, heads_kv, dim = (case.seq_q, case.seq_kv, case.heads_q,
                                             case.heads_kv, case.head_dim)  # fmt: skip
    shape_q = [batch, seq_q, heads_q, dim]
    shape_k = [batch, seq_kv, heads_kv, dim]
    shape_v = list(shape_k)
    fault = case.tensor_fault
    if fault == "batch":
        shape_k[0] = shape_v[0] = batch + 1
    if fault == "tokens":
        shape_k[1] = shape_v[1] = seq_kv + 3
    if fault == "heads":
        shape_k[2] = shape_v[2] = heads_q + 1
    if fault == "head_dim":
        shape_q[3] = dim + 8
    if fault == "kv_shape":
        shape_v[3] = dim + 1
    if fault == "zero_heads":
        shape_q[2] = 0
    if fault == "zero_head_dim":
        shape_q[3] = shape_k[3] = shape_v[3] = 0
    if fault == "zero_seq":
        shape_q[1] = 0
    bases, views = [], []
    for name, shape, storage in zip("qkv", (shape_q, shape_k, shape_v), case.storage,
                                    strict=True):  # fmt: skip
        dtype = case.dtype
        if fault == "dtype_mix" and name == "v":
            dtype = torch.float16 if case.dtype != torch.float16 else torch.float32
        base, view = tensor_with_storage(storage, shape, dtype, generator,
                                         case.nan_input and name == "q")  # fmt: skip
        if fault == "meta" or (fault == "device_mix" and name == "k"):
            base = base.to("meta")
        bases.append(base)
        views.append(view)
    return bases, views


def build_documents(case: Case):
    """document_ids (dense) or (cu_seqlens, max_seqlen) (varlen), as the call receives them,
    and the int [B, S] document ids of the reference."""
    spec = case.documents
    fault = spec.get("fault")
    if case.api == "varlen":
        cu = list(spec["cu_seqlens"])
        max_seqlen = spec["max_seqlen"]
        exact = torch.tensor(cu, dtype=torch.int32)
        if fault == "unsorted":
            inner = [i for i in range(1, len(cu)) if cu[i] != cu[i - 1]]
            i = inner[0]
            cu[i - 1], cu[i] = cu[i], cu[i - 1]
        if fault == "end":
            cu[-1] += 1 if case.seed % 2 else -1
        if fault == "start":
            cu[0] = 1
        if fault == "short":
            cu = cu[:1]
        cu_seqlens = torch.tensor(cu, dtype=torch.int32)
        if case.seed % 3 == 0:  # a strided view
            cu_seqlens = torch.stack([cu_seqlens, cu_seqlens * 0], 1)[:, 0]
        cu_seqlens = {
            "int64": lambda t: t.long(), "float": lambda t: t.float(),
            "two_d": lambda t: t[None], "list": lambda t: t.tolist(),
            "meta": lambda t: t.to("meta"),
        }.get(fault, lambda t: t)(cu_seqlens)  # fmt: skip
        max_seqlen = {
            "max_small": int(torch.diff(exact).max()) - 1, "max_bool": True,
            "max_float": float(max_seqlen), "max_negative": -1,
        }.get(fault, max_seqlen)  # fmt: skip
        return (cu_seqlens, max_seqlen), document_ids_of(exact)[None], exact
    if not spec:
        return None, None, None
    generator = torch.Generator().manual_seed(spec["document_ids"])
    steps = torch.rand(case.batch, case.seq_q, generator=generator) < 0.08
    ids = torch.cumsum(steps, 1).int()
    given = ids.long() if case.seed % 2 else ids  # int32 and int64 are both taken
    if case.seed % 3 == 0:  # a strided view
        given = torch.stack([given, given * 0], -1)[..., 0]
    if fault == "decreasing":
        given = given.clone()
        given[:, 0] = given[:, -1] + 1
        if case.seq_q == 1 or case.batch == 0:
            given = given[None]  # nothing to reverse: a wrong shape instead
    if fault == "float":
        given = ids.float()
    if fault == "shape":
        given = ids[:, :-1] if case.seq_q > 1 else ids[None]
    if fault == "meta":
        given = ids.to("meta")
    return given, ids, None


def call(case: Case, q, k, v, layout, documents):
    options = dict(case.options, backend=case.backend)
    if case.api == "varlen":
        cu_seqlens, max_seqlen = documents
        return block_sparse_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, layout, **options)
    if documents is not None:
        options["document_ids"] = documents
    return block_sparse_attn_func(q, k, v, layout, **options)


def shaped_for_call(case: Case, views):
    """The tensors as the call receives them: varlen drops the batch dim of one; then the
    faults that change what is passed rather than its sizes."""
    q, k, v = (t[0] for t in views) if case.api == "varlen" else views
    fault = case.tensor_fault
    if fault == "not_tensor":
        q = q.tolist()
    if fault == "rank_q":
        q = q.flatten(0, 1) if case.api == "dense" else q[None]  # 3-D, varlen 4-D
    if fault == "rank_k":
        k = k[None]
    return q, k, v


# ---- checking ------------------------------------------------------------------------------
def assert_close(name, actual, exact, baseline, dtype):
    """actual against float64 `exact`: fp16 / bf16 within twice the error of `baseline`
    (PyTorch in that dtype) plus one unit of rounding; fp32 within 1e-4 relative, or twice
    PyTorch's fp32 error where that is larger (gradients of a saturated softmax cancel: no
    fp32 computation gets them to 1e-4); fp64 within 1e-9."""
    assert not torch.isnan(actual).any(), f"{name} has NaN"
    actual, exact = actual.detach().double(), exact.detach().double()
    finite = torch.isfinite(exact)
    assert torch.equal(actual[~finite], exact[~finite]), f"{name}: infinities differ"
    if not exact[finite].any():  # all zero (empty layout, dq of one visible key, ...)
        worst = float(actual[finite].abs().max()) if finite.any() else 0.0
        assert worst < 1e-5 if dtype in TOLERANCE else worst < 1e-3, f"{name}: {worst:.3g}"
        return
    error = relative_error(actual, exact)
    if dtype == torch.float64:
        bound = TOLERANCE[dtype]
    elif dtype == torch.float32:
        bound = max(TOLERANCE[dtype], 2 * relative_error(baseline, exact))
    else:
        bound = 2 * relative_error(baseline, exact) + torch.finfo(dtype).eps
    assert error <= bound, f"{name}: relative error {error:.3g} > {bound:.3g}"


def reference(case: Case, bases, views, layout, ids, grad_out, dtype):
    """out, lse and base gradients of dense attention on the explicit mask, in `dtype`."""
    leaves = [b.detach().to(dtype).requires_grad_() for b in bases]
    q, k, v = (view(leaf) for view, leaf in zip(views, leaves, strict=True))
    window = tuple(min(w, 10**6) for w in case.options["window_size"])  # same, no overflow
    mask = layout_mask(layout, case.batch, case.heads_q, causal=case.options["causal"],
                       window_size=window, document_ids=ids)
    scale = case.options["softmax_scale"]
    out, lse = attention_reference(q, k, v, mask, None if scale is None else float(scale))
    if case.batch and out.numel():
        out.backward(grad_out.to(dtype))
    grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
    return out, lse, grads


def run(case: Case) -> None:
    must_raise = bool(case.faults) or refused_by_backend(case)
    try:
        bases, views = build_tensors(case)
        documents, ids, cu_exact = build_documents(case)
        layout, modified = build_layout(case, cu_exact)
        if not modified:
            must_raise = bool(set(case.faults) - {"layout:modified"}) or refused_by_backend(case)
        floating = case.dtype.is_floating_point and bases[0].device.type == "cpu"
        leaves = [b.requires_grad_() if floating and b.dtype.is_floating_point else b
                  for b in bases]  # fmt: skip
        inputs = [view(leaf) for view, leaf in zip(views, leaves, strict=True)]
        result = call(case, *shaped_for_call(case, inputs), layout, documents)
    except (ValueError, TypeError) as error:
        assert str(error), f"{type(error).__name__} without a message"
        assert must_raise, f"a valid call was refused: {type(error).__name__}: {error}"
        event("refused", f"{type(error).__name__} for {case.faults[:1] or 'backend'}")
        return
    assert not must_raise, f"accepted although it should be refused for {case.faults}"
    event("returned", str(case.dtype).removeprefix("torch."))
    out, lse = result if case.options["return_lse"] else (result, None)
    squeeze = case.api == "varlen"
    q = inputs[0][0] if squeeze else inputs[0]
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    if lse is not None:
        expected_shape = (case.heads_q, case.seq_q) if squeeze else (
            case.batch, case.heads_q, case.seq_q)  # fmt: skip
        assert tuple(lse.shape) == expected_shape and lse.dtype == lse_dtype(out.dtype)
    generator = torch.Generator().manual_seed(case.seed + 2)
    grad_out = torch.randn(out.shape, generator=generator).to(out.dtype)
    if case.grad_storage == "expand_seq" and out.shape[-3] > 0:
        grad_out = grad_out[..., :1, :, :].expand(out.shape)
    if case.grad_storage == "bhsd":
        grad_out = grad_out.transpose(-3, -2).contiguous().transpose(-3, -2)
    if out.numel():
        out.backward(grad_out)
    grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
    for name, grad, leaf in zip(("dq", "dk", "dv"), grads, leaves, strict=True):
        assert grad.shape == leaf.shape and grad.dtype == leaf.dtype, name
    if case.nan_input:
        return  # NaN in, anything finite or not out: no reference to compare with
    outputs = {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    if float(case.options["dropout_p"]) > 0:  # weights dropped at random: lse and finiteness
        for name, tensor in outputs.items():
            if tensor is not None and name != "lse":
                assert not torch.isnan(tensor).any(), f"{name} has NaN"
        outputs = {"lse": lse}
    full_grad_out = grad_out.contiguous()[None] if squeeze else grad_out.contiguous()
    exact = reference(case, bases, views, layout, ids, full_grad_out,
                      torch.float64)  # fmt: skip
    baseline = exact
    if case.dtype != torch.float64:
        baseline = reference(case, bases, views, layout, ids, full_grad_out,
                             case.dtype)  # fmt: skip
    expected = dict(zip(("out", "lse", "dq", "dk", "dv"),
                        (exact[0], exact[1], *exact[2]), strict=True))  # fmt: skip
    lowered = dict(zip(("out", "lse", "dq", "dk", "dv"),
                       (baseline[0], baseline[1], *baseline[2]), strict=True))  # fmt: skip
    for name, actual in outputs.items():
        if actual is None:
            continue
        want, low = expected[name], lowered[name]
        if squeeze and name in ("out", "lse"):
            want, low = want[0], low[0]
        assert_close(name, actual, want, low, case.dtype)


# ---- the properties ------------------------------------------------------------------------
@given(case=cases("dense", ("torch", "torch", "torch", "auto")))
@fuzz_settings(120)
def test_dense_calls_torch_backend(case):
    run(case)


@needs_interpreter
@given(case=cases("dense", ("triton",), valid=24))  # faults cost nothing: mostly valid
@fuzz_settings(60)
def test_dense_calls_triton_backend(case):
    run(case)


@needs_interpreter
@given(case=cases("varlen", ("torch", "torch", "triton", "auto")))
@fuzz_settings(80)
def test_varlen_calls(case):
    run(case)
