"""Layouts with rows of one token (q_block 1, per-token MSA) through the Triton forward and
the two-kernel backward, against the float64 dense reference (CPU: TRITON_INTERPRET=1): the
dK/dV kernel gathers several of a kv block's tokens into one tile, so its masks, dropout
and documents see arbitrary rows."""

from __future__ import annotations

import pytest
import torch

from flash_msa import BlockLayout
from flash_msa.ops.triton import attention_backward, attention_forward
from flash_msa.ops.triton.dropout import dropout_mask
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.testing import random_qkv, relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
SEQ_LEN, KV_BLOCK, HEADS_Q, HEADS_KV = 60, 16, 16, 1


def token_rows_layout(seed: int) -> BlockLayout:
    """Each token's own kv block plus random earlier ones (a third of the causal blocks)."""
    tokens = torch.arange(SEQ_LEN)
    num_kv_blocks = -(-SEQ_LEN // KV_BLOCK)
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.rand(1, SEQ_LEN, num_kv_blocks, generator=generator) < 0.35
    blocks[:, tokens, tokens // KV_BLOCK] = True
    blocks &= torch.arange(num_kv_blocks) <= (tokens // KV_BLOCK)[:, None]
    return BlockLayout.from_keys(
        blocks.flatten().nonzero().flatten().to(DEVICE), seq_len_q=SEQ_LEN, seq_len_kv=SEQ_LEN,
        q_block=1, kv_block=KV_BLOCK,
    )  # fmt: skip


@pytest.mark.parametrize(
    "name, options",
    [
        ("window-documents", dict(window_size=(24, -1), documents=True)),
        ("dropout", dict(window_size=(-1, -1), dropout_p=0.3, dropout_seed=77)),
    ],
)
def test_rows_of_one_token_match_reference(name, options, poisoned_allocations):
    layout = token_rows_layout(seed=len(name))
    document_ids = None
    if options.pop("documents", False):
        document_ids = (torch.arange(SEQ_LEN) >= 35).int()[None].contiguous()
        document_ids = document_ids.to(DEVICE)
    options = dict(causal=True, softmax_scale=0.3, document_ids=document_ids, **options)
    q, k, v = random_qkv(1, SEQ_LEN, HEADS_Q, 16, heads_kv=HEADS_KV, device=DEVICE, seed=3)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(q)
    out, lse = attention_forward(q, k, v, layout, **options)
    grads = attention_backward(grad_out, q, k, v, out, lse, layout, **options)

    documents = None if document_ids is None else document_ids.cpu()
    mask = layout_mask(layout.to("cpu"), 1, HEADS_Q, causal=True,
                       window_size=options["window_size"], document_ids=documents)  # fmt: skip
    dropout_p = options.get("dropout_p", 0.0)
    keep = None
    if dropout_p:
        keep = dropout_mask(options["dropout_seed"], dropout_p, 1, HEADS_Q, SEQ_LEN, SEQ_LEN,
                            DEVICE).cpu()  # fmt: skip
    exact = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    expected, _ = attention_reference(*exact, mask, 0.3, keep, dropout_p)
    assert relative_error(out, expected) < 1e-5
    expected_grads = torch.autograd.grad(expected, exact, grad_out.cpu().double())
    for label, got, want in zip("qkv", grads, expected_grads, strict=True):
        assert relative_error(got, want) < 1e-5, f"d{label}"
