"""The one-kernel backward with atomic dQ (backward_atomic.py) against the float64 dense
reference (CPU: through TRITON_INTERPRET=1), its wiring behind ATOMIC_BACKWARD and
`deterministic`, and its sm_90 code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import flash_msa.ops.triton as triton_backend
from flash_msa import BlockLayout, BlockPositions, block_sparse_attn_func, patterns
from flash_msa.ops.registry import QueryMasks
from flash_msa.ops.triton import attention_backward, attention_backward_atomic, attention_forward
from flash_msa.ops.triton.dropout import dropout_mask
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.testing import PTXAS, random_qkv, relative_error

TOLERANCE_FP32 = 1e-4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


def block_mask_layout(blocks: torch.Tensor, seq_len_q: int, seq_len_kv: int, q_block: int,
                      kv_block: int) -> BlockLayout:  # fmt: skip
    """The layout of a bool block mask [layout_heads, num_q_blocks, num_kv_blocks]."""
    return BlockLayout.from_keys(
        blocks.flatten().nonzero().flatten().to(DEVICE), seq_len_q=seq_len_q,
        seq_len_kv=seq_len_kv, q_block=q_block, kv_block=kv_block, layout_batch=1,
        layout_heads=blocks.shape[0],
    )  # fmt: skip


def expected_grads(q, k, v, mask, grad_out, softmax_scale, keep=None, dropout_p=0.0):
    """float64 dq, dk, dv of attention on an explicit bool mask [B, H_q, S_q, S_kv]."""
    exact = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    out, _ = attention_reference(*exact, mask.cpu(), softmax_scale, keep, dropout_p)
    return torch.autograd.grad(out, exact, grad_out.cpu().double())


def atomic_grads(q, k, v, layout, grad_out, **options):
    out, lse = attention_forward(q, k, v, layout, **options)
    return attention_backward_atomic(grad_out, q, k, v, out, lse, layout, **options)


def assert_close(grads, expected, tensors, tolerance=TOLERANCE_FP32):
    for name, got, exact, like in zip("qkv", grads, expected, tensors, strict=True):
        assert got.shape == like.shape and got.dtype == like.dtype, name
        error = relative_error(got, exact)
        assert error < tolerance, f"d{name}: relative error {error:.3g}"


def random_grad_out(q, seed=7):
    return torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q)


def token_rows_layout() -> BlockLayout:
    """Rows of one token (q_block 1, per-token MSA): each token's own kv block of 32 plus
    random earlier ones."""
    tokens = torch.arange(40)
    blocks = torch.rand(1, 40, 2, generator=torch.Generator().manual_seed(5)) < 0.6
    blocks[:, tokens, tokens // 32] = True
    return block_mask_layout(blocks & (torch.arange(2) <= (tokens // 32)[:, None]), 40, 40, 1, 32)


# (layout, heads_q, heads_kv, causal): a causal dense layout, random blocks under GQA
# with GQA-packed query tiles (q_block 16: two heads a tile) and sub-block steps, a layout
# per kv head, rows of one token (tiles of 16 heads of one position).
CASES = {
    "causal-dense": (lambda: patterns.causal(100, block_size=32, device=DEVICE), 2, 2,
                     True),
    "random-blocks-gqa": (
        lambda: patterns.random_blocks(130, 3, causal=True, q_block=16, kv_block=64, seed=3,
                                       device=DEVICE), 4, 2, True),
    "random-blocks-gqa-per-kv-head-bidirectional": (
        lambda: block_mask_layout(torch.rand(2, 3, 3, generator=torch.Generator().manual_seed(4))
                                  < 0.6, 96, 96, 32, 32), 4, 2, False),
    "token-rows-gqa16": (token_rows_layout, 16, 1, True),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, poisoned_allocations):
    build, heads_q, heads_kv, causal = CASES[name]
    layout = build()
    options = dict(causal=causal, window_size=(-1, -1), softmax_scale=0.3)
    tensors = random_qkv(2, layout.seq_len_q, heads_q, 16, heads_kv=heads_kv, device=DEVICE,
                         seed=1)  # fmt: skip
    grad_out = random_grad_out(tensors[0])
    grads = atomic_grads(*tensors, layout, grad_out, **options)
    mask = layout_mask(layout, 2, heads_q, causal=options["causal"])
    assert_close(grads, expected_grads(*tensors, mask, grad_out, 0.3), tensors)


def test_window_and_documents(poisoned_allocations):
    seq_len = 150
    layout = patterns.sliding_window(seq_len, 40, q_block=32, kv_block=32, device=DEVICE)
    document_ids = torch.tensor([[0] * 50 + [1] * 70 + [2] * 30, [0] * 20 + [1] * 100 + [2] * 30],
                                device=DEVICE)  # fmt: skip
    options = dict(causal=True, window_size=(40, -1), softmax_scale=0.25,
                   document_ids=document_ids.int())  # fmt: skip
    tensors = random_qkv(2, seq_len, 4, 16, heads_kv=1, device=DEVICE, seed=2)
    grad_out = random_grad_out(tensors[0])
    grads = atomic_grads(*tensors, layout, grad_out, **options)
    mask = layout_mask(layout, 2, 4, causal=True, window_size=(40, -1),
                       document_ids=document_ids)  # fmt: skip
    assert_close(grads, expected_grads(*tensors, mask, grad_out, 0.25), tensors)


def test_dropout(poisoned_allocations):
    seed, p, seq_len = 1234, 0.3, 100
    layout = patterns.random_blocks(seq_len, 2, causal=True, block_size=32, device=DEVICE)
    options = dict(causal=True, window_size=(-1, -1), softmax_scale=0.25, dropout_p=p,
                   dropout_seed=seed)  # fmt: skip
    tensors = random_qkv(2, seq_len, 4, 16, heads_kv=2, device=DEVICE, seed=5)
    grad_out = random_grad_out(tensors[0])
    grads = atomic_grads(*tensors, layout, grad_out, **options)
    keep = dropout_mask(seed, p, 2, 4, seq_len, seq_len, DEVICE).cpu()
    mask = layout_mask(layout, 2, 4, causal=True)
    assert_close(grads, expected_grads(*tensors, mask, grad_out, 0.25, keep, p), tensors)


def test_query_masks(poisoned_allocations):
    """Per-token selections (MSA's): random row bits per active pair, read in the transposed
    layout's order; some rows read nothing."""
    seq_len, q_block, kv_block = 112, 16, 32
    layout = patterns.random_blocks(seq_len, 3, causal=True, q_block=q_block, kv_block=kv_block,
                                    seed=8, device=DEVICE)  # fmt: skip
    generator = torch.Generator().manual_seed(8)
    words = torch.randint(-(2**62), 2**62, (layout.nnz,), generator=generator).to(DEVICE)
    words[::5] = 0  # entries no row reads
    dense = torch.zeros(layout.num_q_blocks, layout.num_kv_blocks, dtype=torch.int64)
    dense.view(-1)[layout.keys().cpu()] = words.cpu()
    rows = torch.arange(seq_len)
    per_token = (dense[rows // q_block] >> (rows % q_block)[:, None]) & 1  # [S, num_kv_blocks]
    selected = per_token.bool().repeat_interleave(kv_block, 1)[:, :seq_len]  # [S, S]
    options = dict(causal=True, window_size=(-1, -1), softmax_scale=0.25,
                   query_masks=QueryMasks(words, words[layout.transpose_entries()]))  # fmt: skip
    tensors = random_qkv(1, seq_len, 2, 16, heads_kv=1, device=DEVICE, seed=6)
    grad_out = random_grad_out(tensors[0])
    grads = atomic_grads(*tensors, layout, grad_out, **options)
    mask = layout_mask(layout, 1, 2, causal=True) & selected.to(DEVICE)
    assert_close(grads, expected_grads(*tensors, mask, grad_out, 0.25), tensors)


def test_block_positions(poisoned_allocations):
    """q's blocks and the K/V buffer's slots in shuffled orders (context parallelism's local
    problem over the whole sequence): dQ lands on the local rows, dK and dV on the slots; the
    slot of the ragged last kv block holds NaN padding rows, whose gradients are 0."""
    seq_len, q_block, kv_block = 88, 16, 32
    layout = patterns.causal(seq_len, q_block=q_block, kv_block=kv_block, device=DEVICE)
    q_order = torch.tensor([3, 0, 4, 1, 2, 5])  # the ragged last q block stays last
    slots = torch.tensor([2, 0, 1])  # slot s holds global kv block slots[s]
    local = block_mask_layout(layout.to_dense().cpu()[:, q_order][:, :, slots], seq_len,
                              slots.numel() * kv_block, q_block, kv_block)  # fmt: skip
    positions = BlockPositions(q_order.int().to(DEVICE), slots.int().to(DEVICE), seq_len)
    q_rows = (q_order[:, None] * q_block + torch.arange(q_block)).flatten()
    q_rows = q_rows[q_rows < seq_len]  # [S]: local row -> global row
    slot_rows = (slots[:, None] * kv_block + torch.arange(kv_block)).flatten()  # [slots * 32]
    real = slot_rows < seq_len
    q, k, v = random_qkv(1, seq_len, 2, 16, device=DEVICE, seed=9)
    k_buffer, v_buffer = (torch.full((1, slot_rows.numel(), 2, 16), float("nan"), device=DEVICE)
                          for _ in range(2))  # fmt: skip
    k_buffer[:, real], v_buffer[:, real] = k[:, slot_rows[real]], v[:, slot_rows[real]]
    grad_out = random_grad_out(q)
    options = dict(causal=True, window_size=(-1, -1), softmax_scale=0.25, positions=positions)
    dq, dk, dv = atomic_grads(q[:, q_rows], k_buffer, v_buffer, local, grad_out[:, q_rows],
                              **options)  # fmt: skip
    expected = expected_grads(q, k, v, layout_mask(layout, 1, 2, causal=True), grad_out, 0.25)
    assert relative_error(dq, expected[0][:, q_rows]) < TOLERANCE_FP32
    for got, exact in zip((dk, dv), expected[1:], strict=True):
        assert relative_error(got[:, real], exact[:, slot_rows[real]]) < TOLERANCE_FP32
        assert torch.equal(got[:, ~real], torch.zeros_like(got[:, ~real]))


# ---- the switch and the deterministic flag ---------------------------------------------------
def interface_grads(layout, tensors, grad_out, **options):
    out = block_sparse_attn_func(*tensors, layout, causal=True, backend="triton", **options)
    return torch.autograd.grad(out, tensors, grad_out)


@pytest.fixture
def wiring():
    layout = patterns.causal(96, block_size=32, device=DEVICE)
    tensors = random_qkv(1, 96, 4, 16, heads_kv=2, device=DEVICE, seed=3, requires_grad=True)
    return layout, tensors, random_grad_out(tensors[0])


def test_switch_off_keeps_the_two_kernel_backward(wiring):
    assert triton_backend.ATOMIC_BACKWARD is False  # the default until GPU timings decide
    layout, tensors, grad_out = wiring
    q, k, v = (t.detach() for t in tensors)
    scale = 0.25
    out, lse = attention_forward(q, k, v, layout, causal=True, window_size=(-1, -1),
                                 softmax_scale=scale)  # fmt: skip
    two_kernel = attention_backward(grad_out, q, k, v, out, lse, layout, causal=True,
                                    window_size=(-1, -1), softmax_scale=scale)  # fmt: skip
    for deterministic in (False, True):
        grads = interface_grads(layout, tensors, grad_out, softmax_scale=scale,
                                deterministic=deterministic)  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(grads, two_kernel, strict=True))


def test_switch_on_takes_the_atomic_backward_unless_deterministic(wiring, monkeypatch):
    layout, tensors, grad_out = wiring
    calls = []

    def recorded(*arguments, **options):
        calls.append(options["causal"])
        return attention_backward_atomic(*arguments, **options)

    monkeypatch.setattr(triton_backend, "ATOMIC_BACKWARD", True)
    monkeypatch.setattr(triton_backend, "attention_backward_atomic", recorded)
    atomic = interface_grads(layout, tensors, grad_out)
    assert calls == [True]
    mask = layout_mask(layout, 1, 4, causal=True)
    assert_close(atomic, expected_grads(*tensors, mask, grad_out, 16**-0.5), tensors)
    interface_grads(layout, tensors, grad_out, deterministic=True)
    assert calls == [True]  # deterministic=True: the two-kernel backward


# ---- half precision on a GPU: FlashAttention's rule ------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_half_precision_within_twice_torch_error(head_dim):
    layout = patterns.random_blocks(1000, 4, causal=True, block_size=128, device="cuda")
    tensors = random_qkv(
        2, 1000, 8, head_dim, heads_kv=2, dtype=torch.bfloat16, device="cuda", seed=4
    )
    grad_out = torch.randn_like(tensors[0])
    options = dict(causal=True, window_size=(-1, -1), softmax_scale=head_dim**-0.5)
    grads = atomic_grads(*tensors, layout, grad_out, **options)
    mask = layout_mask(layout, 2, 8, causal=True)
    exact = expected_grads(*tensors, mask, grad_out, head_dim**-0.5)
    half = [t.detach().clone().requires_grad_() for t in tensors]
    out, _ = attention_reference(*half, mask, head_dim**-0.5)
    theirs = torch.autograd.grad(out, half, grad_out)
    for name, mine, torch_value, truth in zip("qkv", grads, theirs, exact, strict=True):
        error, torch_error = relative_error(mine, truth), relative_error(torch_value, truth)
        assert error <= 2 * torch_error + 1e-6, f"d{name}: {error:.3g} vs torch {torch_error:.3g}"


# ---- sm_90 code without a GPU ----------------------------------------------------------------
# Compiles the fused kernel (bf16, causal + left window, unpacked tiles through tensor
# descriptors, the first autotune config) at the head dim on argv[2]; prints its report.
SCRIPT = """
import json, sys
from flash_msa.ops.triton import backward_atomic, configs
from flash_msa.testing import compile_for_sm90

D, Q_BLOCK, KV_BLOCK = int(sys.argv[2]), 64, 128
tile = configs.row_tile(Q_BLOCK, configs.max_query_rows(D, "dkdv"), 1)
block_n = configs.dkdv_kv_rows(D, KV_BLOCK)
launch = configs.Launch(D, tile.rows * tile.pack, 2, True, 232_448)
config = configs.dkdv_configs(launch, block_n)[0]
types = {name: "*bf16" for name in ("q", "k", "v", "grad_out", "grad_k", "grad_v")}
types.update(grad_q_sum="*fp32", lse="*fp32", delta="*fp32", row_offsets="*i32",
             row_indices="*i32", documents="*i32", q_block_positions="*i32",
             kv_block_positions="*i32", query_masks="*i64", qk_scale="fp32",
             softmax_scale="fp32", dropout_p="fp32")
constexprs = dict(HEAD_DIM=D, HEAD_DIM_PAD=D, Q_BLOCK=Q_BLOCK, KV_BLOCK=KV_BLOCK, ROWS=tile.rows,
                  PACK=tile.pack, HAS_LEFT=True, HAS_RIGHT=True, HAS_DOCUMENTS=False,
                  HAS_DROPOUT=False, HAS_POSITIONS=False, HAS_QUERY_MASKS=False,
                  DOT_PRECISION="tf32", TMA=True, BLOCK_N=block_n)
report = compile_for_sm90(backward_atomic._fused_kernel, constexprs, types, config.num_warps,
                          config.num_stages, sys.argv[1])
print(json.dumps(report))
"""


@pytest.mark.parametrize("head_dim, spill_limit", [(64, 0), (128, 1024)])
def test_fused_kernel_compiles_for_hopper(tmp_path, head_dim, spill_limit):
    """Tensor cores (wgmma), shared memory within Hopper's 227 KiB, and spills bounded: at
    D = 128 the tile of 128 keys x 64 queries holds K, V, dK and dV (fp32) beside dQ's
    [64, 128] partial and spills under 1 KiB (the dK/dV kernel's tile spills about as much
    and measured faster than the spill-free 64 x 64 one)."""
    if not os.path.exists(PTXAS):
        pytest.skip("this Triton build bundles no ptxas")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(head_dim)],
                            env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["wgmma"], "the fused kernel does not use Hopper tensor cores (wgmma)"
    assert report["shared"] <= 232_448, report
    assert report["spills"] <= spill_limit, f"spills {report['spills']} bytes of registers"
