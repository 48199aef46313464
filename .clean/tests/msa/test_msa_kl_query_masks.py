"""proxy_kl_loss with per-token selections (query_masks): each token's KL is over exactly the
keys its main attention used, against a float64 eager KL from the definition on the element
mask the words describe."""

import math

import pytest
import torch

from flash_msa import block_sparse_attn_func, patterns
from flash_msa.msa import proxy_kl_loss
from flash_msa.reference import layout_mask
from flash_msa.sequences import document_ids_of
from flash_msa.testing import relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
BATCH, SEQ_LEN, HEADS_Q, HEADS_KV, HEADS_PROXY, HEADS_PROXY_KEYS = 2, 150, 4, 2, 2, 1
DIM, PROXY_DIM, Q_BLOCK, KV_BLOCK = 16, 8, 32, 32
SCALE, PROXY_SCALE = DIM**-0.5, 0.7


def random_words(nnz: int, seed: int) -> torch.Tensor:
    """int64 [nnz]: random query-row bits per entry (about 60% set), with some entries reading
    no row (0) and some every row (-1)."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.rand(nnz, Q_BLOCK, generator=generator) < 0.6  # [nnz, Q_BLOCK]
    words = (bits.long() << torch.arange(Q_BLOCK)).sum(1)
    kind = torch.randint(0, 5, (nnz,), generator=generator)
    words = torch.where(kind == 0, 0, torch.where(kind == 1, -1, words))
    return words.to(DEVICE)


def selected_keys(layout, words: torch.Tensor) -> torch.Tensor:
    """bool [L, S, S]: token i reads key j when the word of (i's block, j's block) has i's bit."""
    dense = torch.zeros(layout.num_layouts * layout.num_q_blocks * layout.num_kv_blocks,
                        dtype=torch.int64)  # fmt: skip
    dense[layout.keys().cpu()] = words.cpu()
    dense = dense.view(layout.num_layouts, layout.num_q_blocks, 1, layout.num_kv_blocks)
    bits = (dense >> torch.arange(Q_BLOCK)[:, None]) & 1  # [L, nq, Q_BLOCK, nk]
    rows = bits.flatten(1, 2).bool().repeat_interleave(KV_BLOCK, -1)
    return rows[:, :SEQ_LEN, :SEQ_LEN]


def inputs(seed: int, documents: bool):
    generator = torch.Generator().manual_seed(seed)
    shapes = {
        "q_proxy": (HEADS_PROXY, PROXY_DIM), "k_proxy": (HEADS_PROXY_KEYS, PROXY_DIM),
        "q": (HEADS_Q, DIM), "k": (HEADS_KV, DIM), "v": (HEADS_KV, DIM),
    }  # fmt: skip
    tensors = {
        name: torch.randn(BATCH, SEQ_LEN, *shape, generator=generator).to(DEVICE)
        for name, shape in shapes.items()
    }
    grid = (BATCH, HEADS_PROXY, math.ceil(SEQ_LEN / Q_BLOCK), math.ceil(SEQ_LEN / KV_BLOCK))
    scores = torch.rand(grid, generator=generator).to(DEVICE)
    layout = patterns.topk(scores, 3, seq_len_q=SEQ_LEN, q_block=Q_BLOCK, kv_block=KV_BLOCK,
                           fixed_counts=True)  # fmt: skip
    document_ids = None
    if documents:
        cu_seqlens = torch.tensor([0, 50, 110, SEQ_LEN], dtype=torch.int32, device=DEVICE)
        document_ids = document_ids_of(cu_seqlens)[None].expand(BATCH, -1).contiguous()
    return tensors, layout, document_ids


def expected_kl(tensors, layout, words, document_ids):
    """float64 mean over (batch, proxy head, token) of KL(teacher || student) over the keys
    token i's main attention sees: its selected blocks, causal, one document. The teacher is
    the main softmax averaged over the proxy head's query heads; a token that sees nothing
    adds 0 (its rows run over every key, then drop out)."""
    q_proxy, k_proxy, q, k = (tensors[name].cpu().double() for name in ("q_proxy", "k_proxy",
                                                                          "q", "k"))  # fmt: skip
    q_proxy.requires_grad_()
    k_proxy.requires_grad_()
    documents = None if document_ids is None else document_ids.cpu()
    mask = layout_mask(layout.to("cpu"), BATCH, HEADS_PROXY, causal=True, document_ids=documents)
    mask = mask & selected_keys(layout, words).view(BATCH, HEADS_PROXY, SEQ_LEN, SEQ_LEN)
    empty = ~mask.any(-1, keepdim=True)  # [B, H_p, S, 1]
    mask = mask | empty
    group = HEADS_Q // HEADS_PROXY
    logits = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(HEADS_Q // HEADS_KV, 2))
    logits = (logits * SCALE).masked_fill(~mask.repeat_interleave(group, 1), -math.inf)
    teacher = logits.softmax(-1).view(BATCH, HEADS_PROXY, group, SEQ_LEN, SEQ_LEN).mean(2)
    keys = k_proxy.repeat_interleave(HEADS_PROXY // HEADS_PROXY_KEYS, 2)
    student = torch.einsum("bihd,bjhd->bhij", q_proxy, keys) * PROXY_SCALE
    log_student = student.masked_fill(~mask, -math.inf).log_softmax(-1)
    terms = torch.where(teacher > 0, teacher * (teacher.log() - log_student), 0.0)
    loss = terms.masked_fill(empty, 0.0).sum(-1).mean()
    return loss, torch.autograd.grad(loss, (q_proxy, k_proxy)), empty


def kl_with_masks(tensors, layout, words, document_ids):
    """The main attention's lse under the words, then the loss and its gradients."""
    _, lse = block_sparse_attn_func(
        tensors["q"], tensors["k"], tensors["v"], layout, causal=True, softmax_scale=SCALE,
        return_lse=True, document_ids=document_ids, query_masks=words,
    )  # fmt: skip
    q_proxy, k_proxy = (tensors[name].detach().requires_grad_() for name in ("q_proxy", "k_proxy"))
    loss = proxy_kl_loss(
        q_proxy, k_proxy, tensors["q"], tensors["k"], lse, layout, softmax_scale=SCALE,
        proxy_softmax_scale=PROXY_SCALE, document_ids=document_ids, query_masks=words,
    )  # fmt: skip
    return loss, torch.autograd.grad(loss, (q_proxy, k_proxy))


@pytest.mark.parametrize("documents", [False, True])
def test_kl_is_over_the_keys_each_token_selected(documents, poisoned_allocations):
    tensors, layout, document_ids = inputs(seed=int(documents), documents=documents)
    words = random_words(layout.nnz, seed=2 + int(documents))
    loss, grads = kl_with_masks(tensors, layout, words, document_ids)
    expected, expected_grads, empty = expected_kl(tensors, layout, words, document_ids)
    assert bool(empty.any()), "a case needs tokens that see nothing"
    assert relative_error(loss, expected) < 1e-5
    for name, grad, exact in zip(("q_proxy", "k_proxy"), grads, expected_grads, strict=True):
        assert relative_error(grad, exact) < 1e-5, name
    rows = empty[..., 0].transpose(1, 2)  # [B, S, H_p]: tokens without keys get no gradient
    assert bool((grads[0].cpu()[rows] == 0).all())


def test_all_ones_words_equal_no_masks(poisoned_allocations):
    """Equal up to fp32 rounding: the two compiled variants may contract differently."""
    tensors, layout, _ = inputs(seed=4, documents=False)
    ones = torch.full((layout.nnz,), -1, dtype=torch.int64, device=DEVICE)
    with_masks = kl_with_masks(tensors, layout, ones, None)
    without = kl_with_masks(tensors, layout, None, None)
    assert relative_error(with_masks[0], without[0]) < 1e-6
    for grad, exact in zip(with_masks[1], without[1], strict=True):
        assert relative_error(grad, exact) < 1e-6


def test_bad_query_masks():
    tensors, layout, _ = inputs(seed=5, documents=False)
    lse = torch.zeros(BATCH, HEADS_Q, SEQ_LEN, device=DEVICE)

    def loss(query_masks):
        return proxy_kl_loss(
            tensors["q_proxy"], tensors["k_proxy"], tensors["q"], tensors["k"], lse, layout,
            softmax_scale=SCALE, proxy_softmax_scale=PROXY_SCALE, query_masks=query_masks,
        )  # fmt: skip

    words = random_words(layout.nnz, seed=5)
    with pytest.raises(TypeError, match="must be int64"):
        loss(words.int())
    with pytest.raises(ValueError, match=r"shape \[layout.nnz\]"):
        loss(words[1:])
