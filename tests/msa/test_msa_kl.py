"""proxy_kl_loss (its three Triton kernels, a custom op) against a float64 eager KL over the
same layout."""

import math

import pytest
import torch

from flash_msa import block_sparse_attn_func, patterns
from flash_msa.msa import proxy_kl_loss
from flash_msa.reference import layout_mask
from flash_msa.sequences import document_ids_of
from flash_msa.testing import relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
BATCH, SEQ_LEN, HEADS_Q, HEADS_KV, HEADS_PROXY, HEADS_PROXY_KEYS = 2, 200, 4, 2, 2, 1
DIM, PROXY_DIM, Q_BLOCK, KV_BLOCK = 16, 8, 32, 64


def _inputs(seed: int):
    generator = torch.Generator().manual_seed(seed)
    shapes = {
        "q_proxy": (HEADS_PROXY, PROXY_DIM), "k_proxy": (HEADS_PROXY_KEYS, PROXY_DIM),
        "q": (HEADS_Q, DIM), "k": (HEADS_KV, DIM), "v": (HEADS_KV, DIM),
    }  # fmt: skip
    return {
        name: torch.randn(BATCH, SEQ_LEN, *shape, generator=generator).to(DEVICE)
        for name, shape in shapes.items()
    }


def _layout(seed: int, cu_seqlens=None):
    """Per (batch, proxy head) top-2 of random block scores, the diagonal always kept."""
    grid = (BATCH, HEADS_PROXY, math.ceil(SEQ_LEN / Q_BLOCK), math.ceil(SEQ_LEN / KV_BLOCK))
    scores = torch.rand(grid, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    layout = patterns.topk(scores, 2, seq_len_q=SEQ_LEN, q_block=Q_BLOCK, kv_block=KV_BLOCK,
                           fixed_counts=True)  # fmt: skip
    if cu_seqlens is not None:
        layout = layout & patterns.causal(SEQ_LEN, q_block=Q_BLOCK, kv_block=KV_BLOCK,
                                          device=DEVICE, cu_seqlens=cu_seqlens)  # fmt: skip
    return layout


def _expected_kl(tensors, layout, documents, scale, proxy_scale):
    """float64: mean over (batch, proxy head, token) of KL(teacher || student) over the keys
    the main attention sees (the layout's blocks, causal, one document)."""
    q_proxy, k_proxy, q, k = (tensors[name].cpu().double() for name in ("q_proxy", "k_proxy",
                                                                          "q", "k"))  # fmt: skip
    q_proxy.requires_grad_()
    k_proxy.requires_grad_()
    mask = layout_mask(layout.to("cpu"), BATCH, HEADS_PROXY, causal=True,
                       document_ids=None if documents is None else documents.cpu())  # fmt: skip
    group = HEADS_Q // HEADS_PROXY
    logits = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(HEADS_Q // HEADS_KV, 2))
    logits = (logits * scale).masked_fill(~mask.repeat_interleave(group, 1), -math.inf)
    teacher = logits.softmax(-1).view(BATCH, HEADS_PROXY, group, SEQ_LEN, SEQ_LEN).mean(2)
    keys = k_proxy.repeat_interleave(HEADS_PROXY // HEADS_PROXY_KEYS, 2)
    student = torch.einsum("bihd,bjhd->bhij", q_proxy, keys) * proxy_scale
    log_student = student.masked_fill(~mask, -math.inf).log_softmax(-1)
    terms = torch.where(teacher > 0, teacher * (teacher.log() - log_student), 0.0)
    loss = terms.sum(-1).mean()
    return loss, torch.autograd.grad(loss, (q_proxy, k_proxy))


@pytest.mark.parametrize("documents", [False, True])
def test_proxy_kl_loss_matches_float64(documents):
    tensors = _inputs(seed=int(documents))
    cu_seqlens = torch.tensor([0, 70, 150, SEQ_LEN], dtype=torch.int32, device=DEVICE)
    document_ids = None
    if documents:
        document_ids = document_ids_of(cu_seqlens)[None].expand(BATCH, -1).contiguous()
    layout = _layout(seed=3, cu_seqlens=cu_seqlens if documents else None)
    scale, proxy_scale = DIM**-0.5, 0.7
    _, lse = block_sparse_attn_func(
        tensors["q"], tensors["k"], tensors["v"], layout, causal=True, softmax_scale=scale,
        return_lse=True, document_ids=document_ids,
    )  # fmt: skip
    q_proxy = tensors["q_proxy"].requires_grad_()
    k_proxy = tensors["k_proxy"].requires_grad_()
    loss = proxy_kl_loss(
        q_proxy, k_proxy, tensors["q"], tensors["k"], lse, layout, softmax_scale=scale,
        proxy_softmax_scale=proxy_scale, document_ids=document_ids,
    )  # fmt: skip
    grads = torch.autograd.grad(loss, (q_proxy, k_proxy))
    expected, expected_grads = _expected_kl(tensors, layout, document_ids, scale, proxy_scale)
    assert relative_error(loss, expected) < 1e-5
    for name, grad, exact in zip(("q_proxy", "k_proxy"), grads, expected_grads, strict=True):
        assert relative_error(grad, exact) < 1e-4, name


def test_proxy_kl_loss_compiles_without_graph_breaks():
    torch._dynamo.reset()
    tensors = _inputs(seed=5)
    layout = _layout(seed=6)
    _, lse = block_sparse_attn_func(tensors["q"], tensors["k"], tensors["v"], layout, causal=True,
                                    return_lse=True)  # fmt: skip
    q_proxy = tensors["q_proxy"].requires_grad_()

    def loss(q_proxy):
        return proxy_kl_loss(
            q_proxy, tensors["k_proxy"], tensors["q"], tensors["k"], lse, layout,
            softmax_scale=DIM**-0.5, proxy_softmax_scale=PROXY_DIM**-0.5,
        )  # fmt: skip

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")(q_proxy)
    eager = loss(q_proxy)
    assert torch.equal(compiled, eager)
    assert torch.equal(torch.autograd.grad(compiled, q_proxy)[0],
                       torch.autograd.grad(eager, q_proxy)[0])  # fmt: skip
