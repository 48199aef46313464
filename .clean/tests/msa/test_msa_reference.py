"""The eager MSA reference: selection, main attention and the KL, checked independently."""

import math

import pytest
import torch

from flash_msa.msa import block_scores_reference, msa_reference, select_blocks_reference
from flash_msa.msa.reference import _blocks_to_elements
from flash_msa.reference import attention_reference


def _inputs(seq_len, heads_q, heads_kv, heads_proxy, heads_proxy_keys, dim, proxy_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [
        (heads_proxy, proxy_dim),
        (heads_proxy_keys, proxy_dim),
        (heads_q, dim),
        (heads_kv, dim),
        (heads_kv, dim),
    ]
    return [
        torch.randn(
            2, seq_len, heads, size, generator=generator, dtype=torch.float64
        ).requires_grad_()
        for heads, size in shapes
    ]


def _token_mask_brute_force(q_proxy, k_proxy, top_k, kv_block):
    """bool [B, H_p, S, S]: per (token i, proxy head p) its own block plus the top_k - 1 other
    blocks with the largest causal proxy logit, ties to the lower block, causal inside."""
    batch, seq_len, heads_proxy, proxy_dim = q_proxy.shape
    group = heads_proxy // k_proxy.shape[2]
    mask = torch.zeros(batch, heads_proxy, seq_len, seq_len, dtype=torch.bool)
    for b in range(batch):
        for p in range(heads_proxy):
            logits = q_proxy[b, :, p] @ k_proxy[b, :, p // group].T  # [S, S]
            for i in range(seq_len):
                own = i // kv_block
                scores = {c: logits[i, c * kv_block : (c + 1) * kv_block].max() for c in range(own)}
                others = sorted(scores, key=lambda c: (-scores[c], c))[: top_k - 1]
                for c in [own, *others]:
                    mask[b, p, i, c * kv_block : min((c + 1) * kv_block, i + 1)] = True
    return mask


def _brute_force(q_proxy, k_proxy, q, k, v, mask):
    """out and kl_loss row by row from the definitions over the element mask [B, H_p, S, S]."""
    batch, seq_len, heads_q, dim = q.shape
    heads_proxy, proxy_dim = q_proxy.shape[2:]
    group, kv_group = heads_q // heads_proxy, heads_q // k.shape[2]
    proxy_group = heads_proxy // k_proxy.shape[2]
    out = torch.zeros_like(q)
    kl_terms = []
    for b in range(batch):
        for i in range(seq_len):
            for p in range(heads_proxy):
                keys = [j for j in range(i + 1) if mask[b, p, i, j]]
                teacher = 0
                for h in range(p * group, (p + 1) * group):
                    logits = torch.stack([q[b, i, h] @ k[b, j, h // kv_group] for j in keys])
                    probs = torch.softmax(logits / math.sqrt(dim), 0)
                    out[b, i, h] = probs @ v[b, keys, h // kv_group]
                    teacher = teacher + probs.detach() / group
                proxy = torch.stack(
                    [q_proxy[b, i, p] @ k_proxy[b, j, p // proxy_group] for j in keys]
                )
                student = torch.log_softmax(proxy / math.sqrt(proxy_dim), 0)
                kl_terms.append((teacher * (teacher.log() - student)).sum())
    return out, torch.stack(kl_terms).mean()


@pytest.mark.parametrize("granularity", ["token", "block"])
@pytest.mark.parametrize(
    "heads, top_k, blocks",
    [((4, 2, 2, 1), 2, (16, 32)), ((2, 1, 2, 2), 1, (16, 16)), ((4, 1, 1, 1), 3, (16, 16))],
    ids=str,
)
def test_msa_reference_matches_brute_force(heads, top_k, blocks, granularity):
    q_block, kv_block = blocks
    tensors = _inputs(50, *heads, 8, 4, seed=top_k)
    out, kl_loss, mask = msa_reference(
        *tensors, top_k=top_k, q_block=q_block, kv_block=kv_block, granularity=granularity
    )
    q_proxy, k_proxy = tensors[0].detach(), tensors[1].detach()
    if granularity == "token":
        expected_mask = _token_mask_brute_force(q_proxy, k_proxy, top_k, kv_block)
    else:
        scores = block_scores_reference(q_proxy, k_proxy, q_block, kv_block)
        blocks = select_blocks_reference(scores, top_k)
        expected_mask = (
            _blocks_to_elements(blocks, 50, q_block, kv_block)
            & torch.ones(50, 50, dtype=torch.bool).tril()
        )
    assert torch.equal(mask, expected_mask)
    expected_out, expected_kl = _brute_force(*tensors, mask)
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl_loss, expected_kl, rtol=1e-12, atol=1e-12)
    assert kl_loss.dim() == 0 and kl_loss.item() > 0

    # kl_loss trains the proxy only; out never depends on the proxy.
    grads = torch.autograd.grad(kl_loss, tensors, allow_unused=True)
    expected_grads = torch.autograd.grad(expected_kl, tensors[:2])
    assert all(grad is None for grad in grads[2:])
    for grad, expected in zip(grads[:2], expected_grads, strict=True):
        torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    out_grads = torch.autograd.grad(out.sum(), tensors, allow_unused=True)
    assert out_grads[0] is None and out_grads[1] is None


def test_msa_reference_warmup_is_dense_causal():
    tensors = _inputs(40, 4, 2, 2, 1, 8, 4, seed=3)
    out, kl_loss, mask = msa_reference(*tensors, top_k=1, q_block=16, kv_block=32)
    warm_out, warm_kl, warm_mask = msa_reference(
        *tensors, top_k=1, q_block=16, kv_block=32, warmup=True
    )
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    dense, _ = attention_reference(*tensors[2:], causal)
    torch.testing.assert_close(warm_out, dense, rtol=1e-12, atol=1e-12)
    assert torch.equal(warm_mask, causal.expand(2, 2, 40, 40))
    _, expected_kl = _brute_force(*tensors, warm_mask)
    torch.testing.assert_close(warm_kl, expected_kl, rtol=1e-12, atol=1e-12)
    assert not torch.equal(out, warm_out) and mask.sum() < warm_mask.sum()


@pytest.mark.parametrize("warmup", [False, True])
def test_kl_vanishes_when_the_proxy_is_the_attention(warmup):
    """One query head per proxy head and the same logits: teacher == student."""
    q_proxy, k_proxy, q, k, v = _inputs(64, 2, 1, 2, 1, 8, 8, seed=4)
    _, kl_loss, _ = msa_reference(
        q, k, q, k, v, top_k=2, q_block=16, kv_block=16, proxy_softmax_scale=0.5,
        softmax_scale=0.5, warmup=warmup,
    )  # fmt: skip
    assert abs(kl_loss.item()) < 1e-14


def test_kl_gradcheck():
    tensors = [t.detach() for t in _inputs(20, 2, 1, 2, 1, 4, 4, seed=5)]
    q_proxy, k_proxy = (t.clone().requires_grad_() for t in tensors[:2])

    def kl(q_proxy, k_proxy):
        return msa_reference(q_proxy, k_proxy, *tensors[2:], top_k=1, q_block=16, kv_block=16)[1]

    assert torch.autograd.gradcheck(kl, (q_proxy, k_proxy), fast_mode=True)


def test_msa_reference_rejects_bad_geometry():
    tensors = _inputs(32, 4, 2, 2, 1, 8, 4)
    with pytest.raises(ValueError, match=r"q_block \(32\) must be <= kv_block \(16\)"):
        msa_reference(*tensors, top_k=1, q_block=32, kv_block=16)
    bad_heads = _inputs(32, 3, 1, 2, 1, 8, 4)
    with pytest.raises(ValueError, match=r"H_q \(3\) a multiple of H_p \(2\)"):
        msa_reference(*bad_heads, top_k=1, q_block=16, kv_block=16)
