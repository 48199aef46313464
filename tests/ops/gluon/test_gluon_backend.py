"""The "gluon" backend through block_sparse_attn_func on an H100 / H200: its forward (Gluon,
masked where blocks are partial) and backward (Gluon dK/dV with the Triton dQ kernel; and the
Gluon backward's other dQ modes: the Gluon dQ kernel, and dQ added by TMA reduce-adds in kv
order or in any order)
against float64 by FlashAttention's rule, packed documents through the varlen call, bitwise
reproducible gradients, and "auto" choosing it for everything but dropout."""

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

from flash_msa import block_sparse_attn_func, block_sparse_attn_varlen_func, patterns
from flash_msa.layout import BlockLayout
from flash_msa.ops.gluon import backward
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.sequences import document_ids_of
from flash_msa.testing import random_qkv, relative_error


def on_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not on_hopper(), reason="needs an sm_90 GPU (H100, H200)")


class Case(NamedTuple):
    batch: int
    seq_len: int
    heads_q: int
    heads_kv: int
    head_dim: int
    layout: Callable[[int], BlockLayout]  # seq_len -> layout
    causal: bool = False
    window_size: tuple[int, int] = (-1, -1)
    documents: tuple[int, ...] = ()  # document lengths of each batch element (sum S)


CASES = {
    "bigbird-gqa-128": Case(1, 1024, 8, 2, 128, lambda s: patterns.bigbird(s, 256, 128, 2)),
    "per-head-mha-64": Case(2, 768, 4, 4, 64, lambda s: patterns.stack(
        [patterns.random_blocks(s, 2, seed=h, causal=False) for h in range(4)])),
    # a block a row per query head: a kv block's column is empty for some heads of its group
    "per-head-gqa-128": Case(1, 768, 8, 2, 128, lambda s: patterns.stack(
        [patterns.random_blocks(s, 1, seed=h, causal=False) for h in range(8)])),
    # 1000 = 7 * 128 + 104: the causal diagonal and both ragged tails
    "causal-ragged-gqa-128": Case(2, 1000, 8, 2, 128, patterns.causal, causal=True),
    "window-sinks-causal-64": Case(1, 1536, 4, 4, 64, lambda s: patterns.sliding_window(s, 512)
                                   | patterns.global_tokens(s, 128), causal=True),
    "window-both-per-head-128": Case(1, 900, 4, 4, 128, lambda s: patterns.stack(
        [patterns.sliding_window(s, 128 * (h + 1), causal=False) for h in range(4)]),
        window_size=(150, 50)),
    "documents-causal-ragged-128": Case(2, 777, 4, 2, 128, patterns.causal, causal=True,
                                        documents=(300, 1, 250, 226)),
    "dense-gqa-128": Case(1, 1024, 8, 2, 128, lambda s: patterns.from_dense_mask(
        torch.ones(s // 128, s // 128, dtype=torch.bool), seq_len_q=s)),
}  # fmt: skip


def grads_within_twice_torch_error(results, mine):
    """Each of out, lse, dq, dk, dv within 2x PyTorch's error in the inputs' dtype."""
    for index, (label, value) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), mine,
                                               strict=True)):  # fmt: skip
        error = relative_error(value, results["exact"][index])
        torch_error = relative_error(results["torch"][index], results["exact"][index])
        assert error <= 2 * torch_error + 1e-6, f"{label}: {error:.3g} vs torch {torch_error:.3g}"


def references(q, k, v, mask, grad_out, dtype) -> dict:
    """out, lse, dq, dk, dv of the masked reference in float64 ("exact") and in dtype."""
    results = {}
    for label, precision in (("exact", torch.float64), ("torch", dtype)):
        inputs = [t.detach().to(precision).requires_grad_() for t in (q, k, v)]
        expected, expected_lse = attention_reference(*inputs, mask)
        expected_grads = torch.autograd.grad(expected, inputs, grad_out.to(precision))
        results[label] = (expected, expected_lse, *expected_grads)
    return results


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("grad_q", ["op", "op-nondeterministic", "gluon", "ordered", "atomic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_gluon_backend_within_twice_torch_error(name, dtype, grad_q, poisoned_allocations,
                                                monkeypatch):  # fmt: skip
    """The op's backward (deterministic, and deterministic=False: its first call times the
    atomic mode and the Triton dQ kernel, both run, the last returned) and each grad_q mode
    called directly."""
    from flash_msa.ops import gluon
    from flash_msa.ops.fastest import FastestPath

    choice = FastestPath(("atomic", "triton"))
    monkeypatch.setattr(gluon, "_NONDETERMINISTIC_DQ", choice)
    case = CASES[name]
    layout = case.layout(case.seq_len).to("cuda")
    q, k, v = random_qkv(case.batch, case.seq_len, case.heads_q, case.head_dim,
                         heads_kv=case.heads_kv, dtype=dtype, device="cuda", seed=3,
                         requires_grad=True)  # fmt: skip
    documents = None
    if case.documents:
        lengths = torch.tensor((0, *case.documents)).cumsum(0).int()
        documents = document_ids_of(lengths).cuda()[None].expand(case.batch, -1).contiguous()
    grad_out = torch.randn_like(q)
    out, lse = block_sparse_attn_func(
        q, k, v, layout, causal=case.causal, window_size=case.window_size,
        document_ids=documents, backend="gluon", return_lse=True,
        deterministic=grad_q != "op-nondeterministic",
    )  # fmt: skip
    if not grad_q.startswith("op"):  # the kernel's grad_q mode called directly
        grads = backward.attention_backward(
            grad_out, q.detach(), k.detach(), v.detach(), out.detach(), lse, layout,
            causal=case.causal, window_size=case.window_size, softmax_scale=case.head_dim**-0.5,
            document_ids=documents, grad_q=grad_q,
        )  # fmt: skip
    else:
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
    mask = layout_mask(layout, case.batch, case.heads_q, causal=case.causal,
                       window_size=case.window_size, document_ids=documents)  # fmt: skip
    grads_within_twice_torch_error(references(q, k, v, mask, grad_out, dtype), (out, lse, *grads))
    if grad_q == "op-nondeterministic":
        assert [sorted(times) for times in choice.timings.values()] == [["atomic", "triton"]]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("grad_q", ["op", "gluon", "ordered"])
def test_deterministic_gradients_are_bitwise_equal(grad_q):
    """Two backward passes of a causal GQA call give the same bits: the op's default mode,
    the Gluon dQ kernel's, and dQ added in kv order (every query block of the causal layout
    gets adds from up to 32 kv blocks, racing across the GPU)."""
    layout = patterns.causal(4096, device="cuda")
    q, k, v = random_qkv(2, 4096, 8, 128, heads_kv=2, dtype=torch.bfloat16, device="cuda",
                         seed=7, requires_grad=True)  # fmt: skip
    grad_out = torch.randn_like(q)
    out, lse = block_sparse_attn_func(q, k, v, layout, causal=True, backend="gluon",
                                      return_lse=True)  # fmt: skip

    def grads():
        if grad_q == "op":
            return torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
        return backward.attention_backward(
            grad_out, q.detach(), k.detach(), v.detach(), out.detach(), lse, layout,
            causal=True, window_size=(-1, -1), softmax_scale=128**-0.5, grad_q=grad_q,
        )  # fmt: skip

    first = grads()
    for _ in range(3):
        for a, b in zip(first, grads(), strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
@needs_hopper
def test_gluon_varlen_within_twice_torch_error(poisoned_allocations):
    """Packed causal documents (one of a single token, ends inside blocks) through the varlen
    call: each document attends within itself."""
    cu_seqlens = torch.tensor([0, 300, 301, 751, 951], dtype=torch.int32, device="cuda")
    total, heads_q, heads_kv, head_dim = 951, 4, 2, 128
    layout = patterns.causal(total, device="cuda", cu_seqlens=cu_seqlens)
    q, k, v = (t[0] for t in random_qkv(1, total, heads_q, head_dim, heads_kv=heads_kv,
                                        dtype=torch.bfloat16, device="cuda", seed=5,
                                        requires_grad=True))  # fmt: skip
    grad_out = torch.randn_like(q)
    out, lse = block_sparse_attn_varlen_func(q, k, v, cu_seqlens, 450, layout, causal=True,
                                             backend="gluon", return_lse=True)  # fmt: skip
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    documents = document_ids_of(cu_seqlens)[None]
    mask = layout_mask(layout, 1, heads_q, causal=True, document_ids=documents)
    results = references(q[None], k[None], v[None], mask, grad_out[None], torch.bfloat16)
    grads_within_twice_torch_error(results, (out[None], lse[None], *(g[None] for g in grads)))


@pytest.mark.gpu
@needs_hopper
def test_auto_takes_gluon_for_all_but_dropout():
    layout = patterns.causal(1000, device="cuda")
    q, k, v = random_qkv(1, 1000, 4, 128, dtype=torch.bfloat16, device="cuda")
    for options in (dict(), dict(causal=True), dict(causal=True, window_size=(200, -1))):
        gluon = block_sparse_attn_func(q, k, v, layout, backend="gluon", **options)
        assert torch.equal(block_sparse_attn_func(q, k, v, layout, **options), gluon), options
    torch.manual_seed(0)
    triton = block_sparse_attn_func(q, k, v, layout, causal=True, dropout_p=0.1, backend="triton")
    torch.manual_seed(0)
    assert torch.equal(block_sparse_attn_func(q, k, v, layout, causal=True, dropout_p=0.1), triton)
