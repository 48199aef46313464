"""proxy_kl_loss's Gluon rows kernel (sm_90): its loss and gradients against a float64 eager
KL, no less exact than the Triton kernel on the same inputs; on the CPU, the refusal and the
sm_90 compile."""

import math

import pytest
import torch

from flash_msa import block_sparse_attn_func, patterns
from flash_msa.msa import kl, kl_gluon, proxy_kl_loss
from flash_msa.reference import layout_mask
from flash_msa.testing import relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_BLOCK = kl_gluon.KV_BLOCK


def kl_inputs(geometry, dtype, masks: bool, seed: int, q_block: int = kl_gluon.TOKENS):
    """Random q / k / proxies, a top-3 layout of q_block x 128 blocks, random query-mask words
    (some entries reading no row, some every row) or None, and the main attention's lse."""
    batch, seq_len, heads_q, heads_kv, heads_proxy, heads_keys, dim, proxy_dim = geometry
    generator = torch.Generator().manual_seed(seed)
    shapes = dict(q_proxy=(heads_proxy, proxy_dim), k_proxy=(heads_keys, proxy_dim),
                  q=(heads_q, dim), k=(heads_kv, dim), v=(heads_kv, dim))  # fmt: skip
    tensors = {name: torch.randn(batch, seq_len, *shape, generator=generator).to(DEVICE, dtype)
               for name, shape in shapes.items()}  # fmt: skip
    grid = (batch, heads_proxy, math.ceil(seq_len / q_block), math.ceil(seq_len / KV_BLOCK))
    scores = torch.rand(grid, generator=generator).to(DEVICE)
    layout = patterns.topk(scores, 3, seq_len_q=seq_len, q_block=q_block, kv_block=KV_BLOCK,
                           fixed_counts=True)  # fmt: skip
    words = None
    if masks:
        bits = torch.rand(layout.nnz, q_block, generator=generator) < 0.6
        words = (bits.long() << torch.arange(q_block)).sum(1)
        kind = torch.randint(0, 5, (layout.nnz,), generator=generator)
        words = torch.where(kind == 0, 0, torch.where(kind == 1, -1, words)).to(DEVICE)
    _, lse = block_sparse_attn_func(tensors["q"], tensors["k"], tensors["v"], layout,
                                    causal=True, return_lse=True, query_masks=words)  # fmt: skip
    return tensors, layout, words, lse


def kl_and_grads(tensors, layout, words, lse):
    q_proxy, k_proxy = (tensors[name].detach().requires_grad_() for name in ("q_proxy", "k_proxy"))
    scale, proxy_scale = tensors["q"].shape[-1] ** -0.5, 0.7 * q_proxy.shape[-1] ** -0.5
    loss = proxy_kl_loss(q_proxy, k_proxy, tensors["q"], tensors["k"], lse, layout,
                         softmax_scale=scale, proxy_softmax_scale=proxy_scale,
                         query_masks=words)  # fmt: skip
    return (loss, *torch.autograd.grad(loss, (q_proxy, k_proxy)))


def expected_kl(tensors, layout, words):
    """float64: the mean over (batch, proxy head, token) of KL(teacher || student) over the
    keys each token's main attention reads (its bits' blocks, causal); tokens that read
    nothing add 0."""
    q_proxy, k_proxy, q, k = (tensors[name].double().requires_grad_(name.endswith("proxy"))
                              for name in ("q_proxy", "k_proxy", "q", "k"))  # fmt: skip
    batch, seq_len, heads_q, dim = q.shape
    heads_proxy, proxy_dim = q_proxy.shape[2:]
    mask = layout_mask(layout, batch, heads_proxy, causal=True)  # [B, H_p, S, S]
    if words is not None:
        dense = torch.zeros(layout.num_layouts * layout.num_q_blocks * layout.num_kv_blocks,
                            dtype=torch.int64, device=DEVICE)  # fmt: skip
        dense[layout.keys()] = words
        dense = dense.view(layout.num_layouts, layout.num_q_blocks, 1, layout.num_kv_blocks)
        bits = (dense >> torch.arange(layout.q_block, device=DEVICE)[:, None]) & 1
        selected = bits.flatten(1, 2).bool().repeat_interleave(KV_BLOCK, -1)
        mask = mask & selected[:, :seq_len, :seq_len].view(mask.shape)
    empty = ~mask.any(-1, keepdim=True)
    mask = mask | empty
    group = heads_q // heads_proxy
    keys = k.repeat_interleave(heads_q // k.shape[2], 2)
    logits = torch.einsum("bihd,bjhd->bhij", q, keys) * dim**-0.5
    logits = logits.masked_fill(~mask.repeat_interleave(group, 1), -math.inf)
    teacher = logits.softmax(-1).view(batch, heads_proxy, group, seq_len, seq_len).mean(2)
    proxy_keys = k_proxy.repeat_interleave(heads_proxy // k_proxy.shape[2], 2)
    student = torch.einsum("bihd,bjhd->bhij", q_proxy, proxy_keys) * 0.7 * proxy_dim**-0.5
    log_student = student.masked_fill(~mask, -math.inf).log_softmax(-1)
    terms = torch.where(teacher > 0, teacher * (teacher.log() - log_student), 0.0)
    loss = terms.masked_fill(empty, 0.0).sum(-1).mean()
    return (loss, *torch.autograd.grad(loss, (q_proxy, k_proxy)))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, chunked, q_block",
    [pytest.param(dtype, chunked, q_block,
                  id=f"{dtype}-{'chunks of 64 KiB' if chunked else 'one chunk'}-qblock{q_block}")
     for dtype, chunked, q_block in [(torch.bfloat16, False, 16), (torch.float16, False, 16),
                                     (torch.bfloat16, True, 16), (torch.bfloat16, False, 64),
                                     (torch.bfloat16, True, 64)]],
)  # fmt: skip
@pytest.mark.parametrize("masks", [True, False], ids=["query masks", "whole blocks"])
@pytest.mark.parametrize(
    "geometry",
    [(2, 1000, 32, 2, 2, 1, 128, 128), (1, 2100, 16, 2, 2, 2, 64, 64),
     (1, 777, 64, 4, 4, 1, 128, 64), (1, 130, 16, 1, 1, 1, 128, 128),
     (1, 1500, 8, 2, 2, 1, 64, 64), (2, 600, 16, 4, 4, 2, 128, 128)],
    ids=str,
)  # fmt: skip
def test_gluon_kl_matches_float64(geometry, masks, dtype, chunked, q_block, monkeypatch):
    """On sm_90 the rows kernel is the Gluon one (it writes the gradient tiles dk_proxy
    reads by TMA stores): the loss and both gradients are within 2x the Triton kernels'
    error of the float64 KL on the same inputs, for 4, 8 and 16 query heads a proxy head, D
    and D_p 64 and 128, ragged lengths, a layout head per proxy head or one for all; chunked
    (bf16): the tiles of 64 KiB of entries at a time (rows split across launches); q_block
    64 (bf16): four programs a query block, each writing its 16 columns of the tiles."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon KL runs on sm_90")
    if chunked:
        monkeypatch.setattr(kl, "GRAD_TILE_BYTES", 1 << 16)
    tensors, layout, words, lse = kl_inputs(geometry, dtype, masks, seed=geometry[1],
                                            q_block=q_block)  # fmt: skip
    assert kl_gluon.supports(tensors["q"], tensors["q_proxy"], q_block, KV_BLOCK, False, False)
    expected = expected_kl(tensors, layout, words)
    gluon = kl_and_grads(tensors, layout, words, lse)
    monkeypatch.setattr(kl_gluon, "supports", lambda *args: False)
    portable = kl_and_grads(tensors, layout, words, lse)
    for name, fast, slow, exact in zip(("loss", "q_proxy", "k_proxy"), gluon, portable, expected,
                                       strict=True):  # fmt: skip
        error, bound = relative_error(fast, exact), relative_error(slow, exact)
        assert error <= 2 * bound + 1e-6, (name, error, bound)


def test_gluon_kl_is_refused_off_sm90():
    """Without an sm_90 GPU (here: the CPU) the KL takes the Triton kernel."""
    q, q_proxy = torch.zeros(1, 256, 64, 128), torch.zeros(1, 256, 4, 128)
    assert not kl_gluon.supports(q.bfloat16(), q_proxy.bfloat16(), kl_gluon.TOKENS, KV_BLOCK,
                                 False, False)  # fmt: skip


GLUON_SM90_COMPILE = """
import json, sys
from flash_msa.msa import kl_gluon
CASES = (("bf16", 128, 128, True, 16, 16), ("bf16", 128, 128, False, 16, 16),
         ("fp16", 64, 64, True, 8, 16), ("bf16", 64, 64, True, 4, 16),
         ("bf16", 128, 128, True, 16, 64))
for dtype, dim, proxy_dim, grad, group, q_block in CASES:
    report = kl_gluon.compile_for_sm90(sys.argv[1], dtype, dim, proxy_dim, grad, group, q_block)
    name = f"{dtype} D {dim} D_p {proxy_dim} grad {grad} G {group} q_block {q_block}"
    print(json.dumps(dict(report, name=name)))
"""


def test_gluon_kl_compiles_for_hopper(sm90):
    """The Gluon rows kernel for sm_90 (no GPU needed): warp-specialised, on warpgroup MMAs,
    without spills, and exponentials between a teacher product's issue and its wait."""
    reports = sm90(GLUON_SM90_COMPILE)
    assert len(reports) == 5
    for report in reports:
        assert report["wgmma"] and report["spills"] == 0, report
        assert report["setmaxnreg"] and report["exponentials_under_products"] >= 32, report
