"""Property-based fuzz of msa_func: valid and invalid inputs alike.

Hypothesis draws valid MSA calls (batch, length, the four head counts, top_k, q_block,
kv_block, granularity, warm-up, FP8 scores, packed documents). Each must return out and
kl_loss equal to the float64 msa_reference (1e-4 relative in fp32; with FP8 scores, whose
selection differs, finite values of the right shape) and gradients that match it. Each
fault (heads that do not divide, mismatched shapes or dtypes, bad options, cu_seqlens past
the tensors) put into drawn calls must raise ValueError or TypeError with a message.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_msa import _env
from flash_msa.msa import msa_func, msa_reference
from flash_msa.msa.fp8 import FP8
from flash_msa.testing import relative_error

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not _env.interpreting(), reason="CPU interpreter runs"
)

# (H_q, H_kv, H_p, H_pk): heads per proxy head 1 to 16; q_block 1 needs 16 (a 16-row tile)
HEADS = [(2, 1, 2, 1), (4, 2, 2, 1), (4, 1, 2, 2), (8, 2, 2, 2), (16, 1, 1, 1)]
FAULTS = [
    "heads", "proxy_dim", "int_dtype", "mixed_dtype", "bfloat16", "length", "rank",
    "top_k", "q_block", "kv_block", "q_block_above_kv_block", "granularity", "score_dtype",
    "warmup", "tile_rows", "cu_seqlens",
]  # fmt: skip


@dataclass(frozen=True)
class Case:
    batch: int
    seq_len: int
    heads: tuple[int, int, int, int]
    top_k: object
    q_block: object
    kv_block: object
    granularity: object
    warmup: object
    score_dtype: object
    documents: tuple[int, ...] | None  # lengths of packed documents (batch 1 then)
    fault: str | None
    dim: int = 16
    proxy_dims: tuple[int, int] = (16, 16)
    dtypes: tuple = (torch.float32,) * 5


def _with_fault(case: Case, fault: str) -> Case:
    """The case with one fault."""
    changes = {
        "heads": dict(heads=(3, 1, 2, 1)),
        "proxy_dim": dict(proxy_dims=(16, 8)),
        "int_dtype": dict(dtypes=(torch.float32,) * 2 + (torch.int32,) + (torch.float32,) * 2),
        "mixed_dtype": dict(dtypes=(torch.float32,) * 3 + (torch.float16,) * 2),
        "bfloat16": dict(dtypes=(torch.bfloat16,) * 5),
        "length": dict(seq_len=case.seq_len),  # k, v one token short: below
        "rank": {},  # q of the other rank: below
        "top_k": dict(top_k=0),
        "q_block": dict(q_block=12),
        "kv_block": dict(kv_block=48),
        "q_block_above_kv_block": dict(q_block=32, kv_block=16),
        "granularity": dict(granularity="tokens"),
        "score_dtype": dict(score_dtype=torch.float16),
        "warmup": dict(warmup=1),
        "tile_rows": dict(heads=(2, 1, 2, 1), q_block=1, granularity="token"),
        "cu_seqlens": dict(documents=(case.seq_len + 1,)),  # more tokens than the tensors
    }[fault]
    return replace(case, fault=fault, **changes)


@st.composite
def cases(draw) -> Case:
    heads = draw(st.sampled_from(HEADS))
    granularity = draw(st.sampled_from(["token", "block"]))
    q_blocks = [16, 32] if granularity == "block" else [1, 2, 4, 8, 16, 32]
    rows = heads[0] // heads[2]  # query heads a proxy head packs into a tile
    q_block = draw(st.sampled_from([b for b in q_blocks if b * rows >= 16]))
    kv_block = draw(st.sampled_from([b for b in (16, 32) if b >= q_block]))
    documents = None
    if draw(st.booleans()):
        documents = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
    seq_len = sum(documents) if documents else draw(st.integers(1, 80))
    case = Case(
        batch=1 if documents else draw(st.integers(1, 2)), seq_len=seq_len, heads=heads,
        top_k=draw(st.integers(1, 4)), q_block=q_block, kv_block=kv_block,
        granularity=granularity, warmup=draw(st.booleans()),
        score_dtype=draw(st.sampled_from([None, None, FP8])), documents=documents, fault=None,
    )  # fmt: skip
    return case


def _tensors(case: Case, seed: int) -> list[torch.Tensor]:
    """q_proxy, k_proxy, q, k, v: [B, S, H, D] ([T, H, D] with documents), requiring grad."""
    heads_q, heads_kv, heads_proxy, heads_proxy_keys = case.heads
    generator = torch.Generator().manual_seed(seed)
    specs = [(heads_proxy, case.proxy_dims[0]), (heads_proxy_keys, case.proxy_dims[1]),
             (heads_q, case.dim), (heads_kv, case.dim), (heads_kv, case.dim)]  # fmt: skip
    tensors = []
    for index, ((heads, dim), dtype) in enumerate(zip(specs, case.dtypes, strict=True)):
        length = case.seq_len - (case.fault == "length" and index >= 3)
        shape = (case.batch, length, heads, dim)
        if (case.documents is not None) != (index == 2 and case.fault == "rank"):
            shape = shape[1:]
        values = torch.randn(shape, generator=generator)
        tensor = values.to(dtype) if dtype.is_floating_point else values.mul(4).to(dtype)
        tensors.append(tensor.requires_grad_(dtype.is_floating_point))
    return tensors


def _options(case: Case) -> dict:
    options = dict(top_k=case.top_k, q_block=case.q_block, kv_block=case.kv_block,
                   granularity=case.granularity, warmup=case.warmup,
                   score_dtype=case.score_dtype)  # fmt: skip
    if case.documents is not None:
        options["cu_seqlens"] = torch.tensor([0, *case.documents], dtype=torch.int32).cumsum(
            0, dtype=torch.int32
        )
    return options


def _reference(case: Case, tensors):
    """float64 out, kl_loss and the leaves, each as msa_func shapes them."""
    exact = [t.detach().double().requires_grad_() for t in tensors]
    batched = [t[None] for t in exact] if case.documents is not None else exact
    document_ids = None
    if case.documents is not None:
        document_ids = torch.repeat_interleave(
            torch.arange(len(case.documents)), torch.tensor(case.documents)
        )[None].int()
    out, kl_loss, _ = msa_reference(
        *batched, top_k=case.top_k, q_block=case.q_block, kv_block=case.kv_block,
        warmup=case.warmup, granularity=case.granularity, document_ids=document_ids,
    )  # fmt: skip
    return out.reshape(tensors[2].shape), kl_loss, exact


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Within 1e-4 of expected's norm, plus 1e-6 per element (RMS): a gradient that vanishes
    in float64 (the proxies' when the student equals the teacher, as over one key) is fp32's
    rounding of s - t, not a relative error."""
    difference = torch.linalg.vector_norm(actual.double() - expected)
    return bool(difference <= 1e-4 * torch.linalg.vector_norm(expected)
                + 1e-6 * expected.numel() ** 0.5)  # fmt: skip


@pytest.mark.parametrize("fault", FAULTS)
@settings(max_examples=4, deadline=None, derandomize=True)
@given(case=cases(), seed=st.integers(0, 2**16))
def test_msa_func_names_each_fault(fault, case, seed):
    case = _with_fault(case, fault)
    with pytest.raises((ValueError, TypeError)) as raised:
        msa_func(*_tensors(case, seed), **_options(case))
    assert str(raised.value), f"{fault}: an error without a message"


@settings(max_examples=30, deadline=None, derandomize=True)
@given(case=cases(), seed=st.integers(0, 2**16))
def test_msa_func_matches_the_reference(case, seed):
    tensors = _tensors(case, seed)
    out, kl_loss = msa_func(*tensors, **_options(case))
    assert out.shape == tensors[2].shape and kl_loss.shape == ()
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    leaves = [t for t in tensors if t.requires_grad]
    grads = torch.autograd.grad([out, kl_loss], leaves, [grad_out, torch.ones_like(kl_loss)])
    if case.score_dtype == FP8:  # another selection than the reference's exact scores
        assert all(bool(torch.isfinite(value).all()) for value in (out, kl_loss, *grads))
        return
    expected, expected_kl, exact = _reference(case, tensors)
    assert relative_error(out, expected) < 1e-4
    assert abs(kl_loss.item() - expected_kl.item()) < 1e-4 * max(1.0, expected_kl.item())
    expected_grads = torch.autograd.grad(
        [expected, expected_kl], exact, [grad_out.double(), torch.ones_like(expected_kl)]
    )
    for got, want in zip(grads, expected_grads, strict=True):
        assert _close(got, want), f"gradient: relative error {relative_error(got, want):.2e}"
