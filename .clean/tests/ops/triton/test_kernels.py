"""Triton kernels against the float64 dense reference (CPU: through TRITON_INTERPRET=1)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_msa.layout import BlockLayout
from flash_msa.ops.triton import attention_backward, attention_forward, configs
from flash_msa.ops.triton.common import use_tma
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.testing import random_qkv, relative_error

TOLERANCE_FP32 = 1e-4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: through the interpreter


def layout_from_block_mask(
    mask: torch.Tensor,
    seq_len_q: int,
    seq_len_kv: int,
    q_block: int,
    kv_block: int,
    layout_batch: int,
    layout_heads: int,
) -> BlockLayout:
    """BlockLayout of a dense bool block mask [L, num_q_blocks, num_kv_blocks]."""
    return BlockLayout.from_keys(
        mask.flatten().nonzero().flatten(),
        seq_len_q=seq_len_q,
        seq_len_kv=seq_len_kv,
        q_block=q_block,
        kv_block=kv_block,
        layout_batch=layout_batch,
        layout_heads=layout_heads,
    )


@dataclass
class Case:
    """One attention problem: shapes, layout broadcasting, element masks."""

    batch: int = 1
    seq_len_q: int = 64
    seq_len_kv: int | None = None
    heads_q: int = 2
    heads_kv: int = 2
    head_dim: int = 32
    q_block: int = 32
    kv_block: int = 32
    layout_batch: int = 1
    layout_heads: str = "1"  # "1", "kv", "q" or a number of layout heads dividing heads_q
    causal: bool = False
    window_size: tuple[int, int] = (-1, -1)
    density: float = 0.7
    empty_rows: bool = False  # row 0 without blocks, row 1 with only blocks causal hides
    strided: bool = False  # q/k/v as views of [B, H, S, D] storage
    seed: int = 0
    kv_len: int = field(init=False)

    def __post_init__(self):
        self.kv_len = self.seq_len_q if self.seq_len_kv is None else self.seq_len_kv

    def layout(self) -> BlockLayout:
        heads = {"kv": self.heads_kv, "q": self.heads_q}.get(self.layout_heads)
        heads = heads or int(self.layout_heads)
        num_q_blocks = math.ceil(self.seq_len_q / self.q_block)
        num_kv_blocks = math.ceil(self.kv_len / self.kv_block)
        generator = torch.Generator().manual_seed(self.seed + 1)
        shape = (self.layout_batch * heads, num_q_blocks, num_kv_blocks)
        mask = torch.rand(shape, generator=generator) < self.density
        if self.empty_rows:
            mask[:, 0] = False
            mask[:, 1] = False
            mask[:, 1, -1] = True  # above the diagonal of q block 1: causal hides it all
        return layout_from_block_mask(
            mask, self.seq_len_q, self.kv_len, self.q_block, self.kv_block, self.layout_batch, heads
        )

    def inputs(self, dtype=torch.float32, device="cpu"):
        q, k, v = random_qkv(
            self.batch,
            self.seq_len_q,
            self.heads_q,
            self.head_dim,
            seq_len_kv=self.kv_len,
            heads_kv=self.heads_kv,
            dtype=dtype,
            device=device,
            seed=self.seed,
        )
        if self.strided:  # [B, S, H, D] views of [B, H, S, D] storage
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        return q, k, v

    def options(self) -> dict:
        return dict(
            causal=self.causal,
            window_size=self.window_size,
            softmax_scale=1.0 / math.sqrt(self.head_dim),
        )


CASES = {
    "layout-heads-between-kv-and-q": Case(
        seq_len_q=70, heads_q=8, heads_kv=2, head_dim=16, q_block=16, kv_block=32,
        layout_heads="4", causal=True, density=0.6,
    ),
    "layout-heads-across-kv-groups": Case(
        seq_len_q=64, heads_q=8, heads_kv=4, head_dim=16, q_block=16, kv_block=16,
        layout_heads="2", density=0.6,
    ),
    "dense-mha": Case(batch=2, seq_len_q=128, density=1.0),
    "causal-gqa2-ragged-layout-per-batch-kvhead": Case(
        batch=2, seq_len_q=100, heads_q=4, heads_kv=2, q_block=32, kv_block=16,
        layout_batch=2, layout_heads="kv", causal=True,
    ),
    "window-left-gqa4-packed-sq<skv": Case(
        seq_len_q=96, seq_len_kv=150, heads_q=8, heads_kv=2, head_dim=16, q_block=16,
        kv_block=32, window_size=(40, -1), density=0.8,
    ),
    "window-both-gqa8-layout-per-qhead": Case(
        batch=1, seq_len_q=80, heads_q=8, heads_kv=1, head_dim=64, q_block=16, kv_block=16,
        layout_heads="q", window_size=(24, 8), density=0.8,
    ),
    "causal-window-sq>skv": Case(
        seq_len_q=150, seq_len_kv=70, heads_q=2, heads_kv=1, q_block=32, kv_block=64,
        layout_heads="kv", causal=True, window_size=(33, -1), density=0.9,
    ),
    "qblock128-subtiles-causal": Case(
        seq_len_q=200, heads_q=2, heads_kv=2, head_dim=16, q_block=128, kv_block=64,
        causal=True, density=0.9,
    ),
    "kvblock128-subtiles-gqa2-layout-per-batch": Case(
        batch=2, seq_len_q=160, seq_len_kv=200, heads_q=2, heads_kv=1, head_dim=16,
        q_block=64, kv_block=128, layout_batch=2, density=0.8,
    ),
    "head-dim-48": Case(
        seq_len_q=40, seq_len_kv=56, head_dim=48, q_block=16, kv_block=32, causal=True,
        density=0.9,
    ),
    "empty-rows-causal-gqa2": Case(
        batch=2, seq_len_q=128, heads_q=4, heads_kv=2, q_block=16, kv_block=32,
        layout_heads="kv", causal=True, empty_rows=True,
    ),
    "strided-inputs-window-right": Case(
        seq_len_q=72, heads_q=4, heads_kv=4, head_dim=32, q_block=16, kv_block=16,
        layout_heads="q", window_size=(-1, 20), strided=True,
    ),
}  # fmt: skip


def reference(case: Case, q, k, v, grad_out=None):
    """float64 out, lse and (with grad_out) dq, dk, dv on the layout's dense mask."""
    layout = case.layout()
    mask = layout_mask(
        layout, case.batch, case.heads_q, causal=case.causal, window_size=case.window_size
    )
    q, k, v = (t.detach().cpu().double().requires_grad_(grad_out is not None) for t in (q, k, v))
    out, lse = attention_reference(q, k, v, mask, case.options()["softmax_scale"])
    if grad_out is None:
        return out, lse
    grads = torch.autograd.grad(out, (q, k, v), grad_out.cpu().double())
    return (out, lse, *grads)


def check(name: str, actual: torch.Tensor, expected: torch.Tensor, like: torch.Tensor):
    assert actual.shape == like.shape and actual.dtype == like.dtype, name
    error = relative_error(actual, expected)
    assert error < TOLERANCE_FP32, f"{name}: relative error {error:.3g}"


@pytest.fixture(params=["tma", "pointers"])
def loads(request) -> dict:
    """The launchers' load option: tiles through tensor descriptors (where use_tma allows
    them: on Hopper, and here under the interpreter for fp32), then through pointers (other
    GPUs, and tensors TMA cannot address)."""
    return {"tma": None if request.param == "tma" else False}


def test_tma_needs_16_byte_alignment():
    if DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or newer")
    rows = torch.zeros(2, 64, 4, 32, device=DEVICE)  # [B, S, H, D] fp32
    assert use_tma(rows)
    assert not use_tma(rows[..., 1:])  # base 4 bytes past an aligned one
    assert not use_tma(torch.zeros(2, 64, 3, 3, device=DEVICE))  # 36-byte rows
    assert not use_tma(rows[:, :1].expand(2, 64, 4, 32))  # broadcast positions
    assert use_tma(rows[:1])  # a batch of one: its stride is never used


@pytest.mark.parametrize("name", list(CASES))
def test_forward_backward_match_reference(name, loads, poisoned_allocations):
    case = CASES[name]
    layout = case.layout().to(DEVICE)
    q, k, v = case.inputs(device=DEVICE)
    out, lse = attention_forward(q, k, v, layout, **case.options(), **loads)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference(case, q, k, v, grad_out)
    check("out", out, ref_out, q)
    check("lse", lse, ref_lse, ref_lse.float())
    dq, dk, dv = attention_backward(
        grad_out, q, k, v, out, lse, layout, **case.options(), **loads
    )
    check("dq", dq, ref_dq, q)
    check("dk", dk, ref_dk, k)
    check("dv", dv, ref_dv, v)


@st.composite
def cases(draw) -> Case:
    """Small random problems: ragged lengths, odd head dims (some rows too narrow for TMA),
    GQA groups, layouts shared or per head, causal and windows, sparse to dense."""
    heads_kv = draw(st.sampled_from([1, 2]))
    window = st.sampled_from([-1, 0, 5, 40])
    return Case(
        batch=draw(st.sampled_from([1, 2])),
        seq_len_q=draw(st.integers(1, 130)),
        seq_len_kv=draw(st.integers(1, 130)),
        heads_q=heads_kv * draw(st.sampled_from([1, 2, 4])),
        heads_kv=heads_kv,
        head_dim=draw(st.sampled_from([8, 10, 16, 24, 40, 64])),
        q_block=draw(st.sampled_from([16, 32, 64])),
        kv_block=draw(st.sampled_from([16, 32, 64])),
        layout_heads=draw(st.sampled_from(["1", "kv", "q"])),
        causal=draw(st.booleans()),
        window_size=(draw(window), draw(window)),
        density=draw(st.sampled_from([0.3, 0.7, 1.0])),
        seed=draw(st.integers(0, 2**16)),
    )


@given(case=cases())
@settings(max_examples=16, deadline=None, derandomize=True)
def test_random_problems_match_reference(case):
    layout = case.layout().to(DEVICE)
    q, k, v = case.inputs(device=DEVICE)
    out, lse = attention_forward(q, k, v, layout, **case.options())
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(case.seed))
    grads = attention_backward(grad_out.to(DEVICE), q, k, v, out, lse, layout, **case.options())
    expected = reference(case, q, k, v, grad_out)
    for name, actual, exact in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                                   expected, strict=True):  # fmt: skip
        finite = torch.isfinite(exact)  # lse of rows that see nothing is -inf on both sides
        assert torch.equal(torch.isfinite(actual.cpu()), finite), name
        actual, exact = actual.cpu()[finite].double(), exact[finite]
        if not exact.any():  # e.g. dq when every row sees one key: exactly 0
            assert bool((actual.abs() < 1e-5).all()), name
        else:
            error = relative_error(actual, exact)
            assert error < TOLERANCE_FP32, f"{name}: relative error {error:.3g}"


def test_broadcast_grad_out(poisoned_allocations):
    """dout expanded along positions (stride 0), as autograd hands it for out.mean(1)."""
    case = CASES["causal-gqa2-ragged-layout-per-batch-kvhead"]
    layout = case.layout().to(DEVICE)
    q, k, v = case.inputs(device=DEVICE)
    out, lse = attention_forward(q, k, v, layout, **case.options())
    grad_out = torch.randn(case.batch, 1, case.heads_q, case.head_dim).expand(out.shape)
    grads = attention_backward(grad_out.to(DEVICE), q, k, v, out, lse, layout, **case.options())
    expected = reference(case, q, k, v, grad_out.contiguous())[2:]
    for name, actual, exact, like in zip(("dq", "dk", "dv"), grads, expected, (q, k, v),
                                         strict=True):  # fmt: skip
        check(name, actual, exact, like)


def test_empty_rows_give_zeros_and_minus_inf():
    case = CASES["empty-rows-causal-gqa2"]
    layout = case.layout().to(DEVICE)
    q, k, v = case.inputs(device=DEVICE)
    out, lse = attention_forward(q, k, v, layout, **case.options())
    rows = slice(0, 2 * case.q_block)  # q block 0 has no blocks, block 1 only hidden ones
    assert torch.equal(out[:, rows], torch.zeros_like(out[:, rows]))
    assert bool((lse[:, :, rows] == float("-inf")).all())
    grad_out = torch.randn_like(out)
    dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, layout, **case.options())
    assert torch.equal(dq[:, rows], torch.zeros_like(dq[:, rows]))
    assert all(bool(torch.isfinite(g).all()) for g in (dq, dk, dv))


# ---- GPU: half precision against PyTorch's own error, determinism -------------------------
GPU_CASES = {
    "causal-gqa4-64": Case(
        batch=2, seq_len_q=1000, heads_q=8, heads_kv=2, head_dim=64, q_block=64, kv_block=64,
        layout_heads="kv", causal=True, density=0.5,
    ),
    "window-mha-128": Case(
        batch=1, seq_len_q=1100, seq_len_kv=900, heads_q=4, heads_kv=4, head_dim=128,
        q_block=128, kv_block=64, layout_heads="q", window_size=(300, 50), density=0.6,
    ),
    "gqa2-96-empty-rows": Case(
        batch=2, seq_len_q=700, heads_q=4, heads_kv=2, head_dim=96, q_block=64, kv_block=128,
        layout_batch=2, causal=True, empty_rows=True, density=0.5,
    ),
    "causal-gqa8-32": Case(
        batch=1, seq_len_q=900, heads_q=8, heads_kv=1, head_dim=32, q_block=64, kv_block=128,
        causal=True, density=0.6,
    ),
    "bidirectional-256": Case(
        batch=1, seq_len_q=600, heads_q=2, heads_kv=2, head_dim=256, q_block=128, kv_block=128,
        density=0.7,
    ),
}  # fmt: skip


def assert_within_twice_torch_error(
    case: Case, dtype: torch.dtype, device: str = "cuda", forward_option=None, backward_option=None
):
    """FlashAttention's rule: error vs float64 at most 2x that of PyTorch in the same dtype.
    forward_option / backward_option: launcher options (an explicit kernel config)."""
    layout = case.layout().to(device)
    q, k, v = case.inputs(dtype, device)
    grad_out = torch.randn(q.shape, dtype=dtype, device=device)
    out, lse = attention_forward(q, k, v, layout, **case.options(), **(forward_option or {}))
    dq, dk, dv = attention_backward(
        grad_out, q, k, v, out, lse, layout, **case.options(), **(backward_option or {})
    )
    exact = reference(case, q, k, v, grad_out)
    mask = layout_mask(layout, case.batch, case.heads_q, causal=case.causal,
                       window_size=case.window_size)  # fmt: skip
    q_half, k_half, v_half = (t.detach().clone().requires_grad_() for t in (q, k, v))
    torch_out, torch_lse = attention_reference(
        q_half, k_half, v_half, mask, case.options()["softmax_scale"]
    )
    torch_grads = torch.autograd.grad(torch_out, (q_half, k_half, v_half), grad_out)
    labels = ("out", "lse", "dq", "dk", "dv")
    ours = (out, lse, dq, dk, dv)
    theirs = (torch_out, torch_lse, *torch_grads)
    for label, mine, torch_value, truth in zip(labels, ours, theirs, exact, strict=True):
        assert mine.dtype == (torch.float32 if label == "lse" else dtype), label
        error, torch_error = relative_error(mine, truth), relative_error(torch_value, truth)
        assert error <= 2 * torch_error + 1e-6, f"{label}: {error:.3g} vs torch {torch_error:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_half_precision_within_twice_torch_error(name, dtype, poisoned_allocations):
    assert_within_twice_torch_error(GPU_CASES[name], dtype)


# D = 128 at blocks of 128 keys, where every autotune config applies: unpacked query tiles
# (all loads through TMA on Hopper) and GQA-packed ones (K/V through TMA).
CONFIG_CASES = {
    "unpacked": Case(
        batch=1, seq_len_q=1000, heads_q=4, heads_kv=2, head_dim=128, q_block=128,
        kv_block=128, layout_heads="kv", causal=True, density=0.6,
    ),
    "packed": Case(
        batch=1, seq_len_q=1000, heads_q=8, heads_kv=2, head_dim=128, q_block=64,
        kv_block=128, layout_heads="kv", causal=True, density=0.6,
    ),
}  # fmt: skip
# kernel -> its configs at D = 128, bf16, blocks of 128, TMA loads, on an H100 / H200
LAUNCH = configs.Launch(128, 128, 2, True, 232_448)
KERNEL_CONFIGS = {
    "forward": configs.forward_configs(LAUNCH, 128),
    "dq": configs.dq_configs(LAUNCH, 128),
    "dkdv": configs.dkdv_configs(LAUNCH._replace(block_m=64), 128),
}
CONFIG_OPTION = {"forward": "config", "dq": "dq_config", "dkdv": "dkdv_config"}


def assert_config_within_twice_torch_error(case: Case, kernel: str, config):
    """One kernel under an explicit config, the others autotuned: FlashAttention's rule."""
    option = {CONFIG_OPTION[kernel]: config}
    forward_option = option if kernel == "forward" else {}
    backward_option = {} if kernel == "forward" else option
    assert_within_twice_torch_error(case, torch.bfloat16, forward_option=forward_option,
                                    backward_option=backward_option)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case_name", list(CONFIG_CASES))
@pytest.mark.parametrize(
    "kernel, index",
    [(kernel, index) for kernel, listed in KERNEL_CONFIGS.items() for index in range(len(listed))],
)
def test_every_autotune_config_within_twice_torch_error(kernel, index, case_name):
    """The autotuner keeps whichever config runs fastest on the machine at hand, so each
    one it may pick must be right, not only today's winner."""
    assert_config_within_twice_torch_error(
        CONFIG_CASES[case_name], kernel, KERNEL_CONFIGS[kernel][index]
    )


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_backward_is_deterministic(name):
    case = GPU_CASES[name]
    layout = case.layout().to("cuda")
    q, k, v = case.inputs(torch.bfloat16, "cuda")
    out, lse = attention_forward(q, k, v, layout, **case.options())
    grad_out = torch.randn_like(out)
    first = attention_backward(grad_out, q, k, v, out, lse, layout, **case.options())
    second = attention_backward(grad_out, q, k, v, out, lse, layout, **case.options())
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
