"""Packed documents (cu_seqlens, document_ids) on both backends against float64."""

import pytest
import torch

from flash_msa import block_sparse_attn_func, block_sparse_attn_varlen_func, patterns
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.sequences import document_ids_of
from flash_msa.testing import random_qkv, relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch", "triton"]  # triton runs through the interpreter on the CPU
CU_SEQLENS = [0, 50, 50, 51, 130, 200]  # an empty and a one-token document


def check(out, lse, grads, inputs, mask, grad_out, squeeze):
    exact = [t.detach().cpu().double().requires_grad_() for t in inputs]
    expected, expected_lse = attention_reference(*exact, mask.cpu())
    expected.backward(grad_out.cpu().double())
    if squeeze:
        expected, expected_lse = expected[0], expected_lse[0]
        exact_grads = [t.grad[0] for t in exact]
    else:
        exact_grads = [t.grad for t in exact]
    errors = [relative_error(out, expected), relative_error(lse, expected_lse)]
    errors += [relative_error(g, e) for g, e in zip(grads, exact_grads, strict=True)]
    assert max(errors) < 1e-4, errors


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "causal, window_size, pattern",
    [
        (True, (-1, -1), "causal"),
        (False, (-1, -1), "documents"),
        (True, (40, 0), "window"),
        (True, (-1, -1), "full"),  # blocks across documents: the element mask still holds
    ],
)
def test_varlen_matches_reference(backend, causal, window_size, pattern):
    cu = torch.tensor(CU_SEQLENS, dtype=torch.int32, device=DEVICE)
    total = CU_SEQLENS[-1]
    layout = {
        "causal": patterns.causal(total, block_size=32, device=DEVICE, cu_seqlens=cu),
        "documents": patterns.documents(cu, block_size=32),
        "window": patterns.sliding_window(total, 40, block_size=32, device=DEVICE, cu_seqlens=cu),
        "full": patterns.from_dense_mask(
            torch.ones(7, 7, dtype=torch.bool), seq_len_q=total, block_size=32, device=DEVICE
        ),
    }[pattern]
    q, k, v = random_qkv(1, total, 4, 16, heads_kv=2, device=DEVICE, seed=3)
    q, k, v = (t[0].requires_grad_() for t in (q, k, v))  # [T, H, D]
    out, lse = block_sparse_attn_varlen_func(
        q, k, v, cu, 79, layout, causal=causal, window_size=window_size, return_lse=True,
        backend=backend, deterministic=False,  # torch's CUDA backward does not repeat its bits
    )  # fmt: skip
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    mask = layout_mask(
        layout, 1, 4, causal=causal, window_size=window_size, document_ids=document_ids_of(cu)[None]
    )
    inputs = [t.detach()[None] for t in (q, k, v)]
    check(out, lse, [q.grad, k.grad, v.grad], inputs, mask, grad_out[None], squeeze=True)
    empty_rows = out[50:51]  # the one-token document sees itself only: never zero
    assert torch.isfinite(empty_rows).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_document_ids_per_batch_row(backend):
    document_ids = torch.tensor([[0] * 40 + [1] * 60 + [2] * 60, [0] * 5 + [3] * 155])
    document_ids = document_ids.to(DEVICE)
    layout = patterns.causal(160, block_size=32, device=DEVICE)
    q, k, v = random_qkv(2, 160, 2, 16, device=DEVICE, seed=4, requires_grad=True)
    out, lse = block_sparse_attn_func(
        q, k, v, layout, causal=True, return_lse=True, backend=backend, document_ids=document_ids,
        deterministic=False,
    )
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    mask = layout_mask(layout, 2, 2, causal=True, document_ids=document_ids)
    check(out, lse, [q.grad, k.grad, v.grad], [q, k, v], mask, grad_out, squeeze=False)


def test_varlen_validation():
    q, k, v = (t[0] for t in random_qkv(1, 100, 2, 16))
    layout = patterns.causal(100, block_size=32)
    cu = torch.tensor([0, 60, 100], dtype=torch.int32)
    cases = [
        (dict(q=q[None]), ValueError, r"q must be 3-D \[total_tokens, heads, head_dim\]"),
        (dict(cu_seqlens=cu.long()), TypeError, "cu_seqlens must be int32"),
        (dict(cu_seqlens=torch.tensor([0, 60, 90], dtype=torch.int32)), ValueError,
         "must end at the number of packed tokens 100, got 90"),
        (dict(cu_seqlens=torch.tensor([0, 60, 50, 100], dtype=torch.int32)), ValueError,
         "non-decreasing: document 1 has length -10"),
        (dict(cu_seqlens=torch.tensor([[0, 100]], dtype=torch.int32)), ValueError, "1-D"),
        (dict(max_seqlen=50), ValueError, r"max_seqlen 50 is shorter than the longest document"),
        (dict(max_seqlen=-1), ValueError, "max_seqlen must be a non-negative int"),
        (dict(k=k[:90], v=v[:90]), ValueError, "q has 100 tokens but k, v have 90"),
        (dict(layout=patterns.causal(64, block_size=32)), ValueError, "layout is for seq_len_q=64"),
    ]  # fmt: skip
    for changes, error, match in cases:
        args = {**dict(q=q, k=k, v=v, cu_seqlens=cu, max_seqlen=60, layout=layout), **changes}
        with pytest.raises(error, match=match):
            block_sparse_attn_varlen_func(**args)


def test_document_ids_validation():
    q, k, v = random_qkv(2, 64, 2, 16)
    layout = patterns.causal(64, block_size=32)
    good = torch.zeros(2, 64, dtype=torch.int32)
    cases = [
        (good[:1], ValueError, r"document_ids must be \[batch, seq_len\] = \[2, 64\]"),
        (good.float(), TypeError, "document_ids must be int32 or int64"),
        (torch.arange(64).flip(0).expand(2, 64), ValueError, "must be non-decreasing"),
        ([0] * 64, TypeError, "document_ids must be a torch.Tensor, got list"),
    ]
    for document_ids, error, match in cases:
        with pytest.raises(error, match=match):
            block_sparse_attn_func(q, k, v, layout, document_ids=document_ids)
    k_short, v_short = k[:, :32], v[:, :32]
    with pytest.raises(ValueError, match="document_ids needs self-attention lengths"):
        block_sparse_attn_func(
            q, k_short, v_short, patterns.from_dense_mask(
                torch.ones(2, 1, dtype=torch.bool), seq_len_q=64, seq_len_kv=32, block_size=32
            ), document_ids=good,
        )  # fmt: skip


def test_document_ids_of_cu_seqlens():
    cu = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    ids = document_ids_of(cu)
    assert ids.tolist() == [0] * 50 + [2] + [3] * 79 + [4] * 70
