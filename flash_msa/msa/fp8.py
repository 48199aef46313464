"""FP8 selection scores: the proxies quantized to e4m3 for the scoring kernels' products.

Block scores and per-token selection may run their proxy products on FP8 tensor cores (e4m3
inputs, fp32 accumulation: twice bf16's rate on Hopper). Each proxy query row is divided by
its own largest magnitude and each kv block of proxy keys by its own, both times e4m3's
largest value, so that every row and block spans e4m3's range; the kernels multiply the
factors back into the maxima they take (a positive factor commutes with a max).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from flash_msa import _env
from flash_msa.ops.triton.common import element_offsets, load_rows, store_rows, strides

FP8 = torch.float8_e4m3fn  # score_dtype of FP8 scoring


ROWS = 32  # proxy query rows a program of _quantize_rows_kernel scales
E4M3_LARGEST: tl.constexpr = tl.constexpr(448.0)  # torch.finfo(FP8).max
# A factor's inverse is a product with 1 / 448 rounded to fp32; a row's factor the reciprocal
# of its largest magnitude times 448.
INVERSE_LARGEST: tl.constexpr = tl.constexpr(1 / 448)


@triton.jit
def _onto_e4m3_grid(values):
    """fp32 values of magnitude at most 464 rounded to nearest even onto e4m3's grid, still in
    fp32 (steps of 2^(e - 3) for values in [2^e, 2^(e + 1)), 2^-9 below 2^-6), so that their
    conversion to e4m3 is exact (the Triton interpreter's own conversion does not carry a
    rounding into the exponent)."""
    exponent = (values.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased by 127
    step_exponent = tl.maximum(exponent, 127 - 6) - 3
    step = (step_exponent << 23).to(tl.float32, bitcast=True)
    inverse_step = ((254 - step_exponent) << 23).to(tl.float32, bitcast=True)
    steps = values * inverse_step  # at most 16 in magnitude
    steps = (steps + 12582912.0) - 12582912.0  # 1.5 x 2^23: rounds to an integer, ties even
    return steps * step


@triton.jit
def _quantize_rows_kernel(q_proxy, q8, q_scales, rows, seq_len, heads, stride_q_b, stride_q_s,
                          stride_q_h, stride_q8_b, stride_q8_s, stride_q8_h, DIM: tl.constexpr,
                          DIM_PAD: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """ROWS (token, head) rows of q_proxy [B, S, H_p, D], scaled so their largest magnitude
    is 448, into q8 (like q_proxy) and their factors into q_scales [B, S, H_p] (contiguous)."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]: b * S * H_p + s * H_p + h
    valid = row < rows
    batch = (row // (seq_len * heads)).to(tl.int64)
    token, head = row // heads % seq_len, row % heads
    offsets = batch * stride_q_b + element_offsets(token, head, stride_q_s, stride_q_h)
    values = load_rows(q_proxy, offsets, valid, DIM, DIM_PAD).to(tl.float32)  # [ROWS, DIM_PAD]
    largest = tl.max(tl.abs(values), axis=1)  # [ROWS]
    positive = largest > 0
    factor = tl.math.div_rn(1.0, tl.where(positive, largest, E4M3_LARGEST)) * E4M3_LARGEST
    q8_offsets = batch * stride_q8_b + element_offsets(token, head, stride_q8_s, stride_q8_h)
    store_rows(q8, q8_offsets, valid, _onto_e4m3_grid(values * factor[:, None]), DIM, DIM_PAD)
    tl.store(q_scales + row, tl.where(positive, largest * INVERSE_LARGEST, 1.0), mask=valid)


@triton.jit
def _quantize_blocks_kernel(k_proxy, k8, k_scales, seq_len, stride_k_b, stride_k_s, stride_k_h,
                            stride_k8_b, stride_k8_s, stride_k8_h, DIM: tl.constexpr,
                            DIM_PAD: tl.constexpr, KV_BLOCK: tl.constexpr):  # fmt: skip
    """Grid (kv blocks, H_pk, B): one kv block of one key head of k_proxy [B, S, H_pk, D]
    divided by its factor (its largest magnitude over 448) into k8 (like k_proxy), the factor
    into k_scales [B, H_pk, kv blocks] (contiguous)."""
    block, head, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    tokens = block * KV_BLOCK + tl.arange(0, KV_BLOCK)  # [KV_BLOCK]
    valid = tokens < seq_len
    offsets = batch * stride_k_b + element_offsets(tokens, head, stride_k_s, stride_k_h)
    values = load_rows(k_proxy, offsets, valid, DIM, DIM_PAD).to(tl.float32)  # [KV_BLOCK, DIM_PAD]
    largest = tl.max(tl.max(tl.abs(values), axis=1), axis=0)
    scale = tl.where(largest > 0, largest * INVERSE_LARGEST, 1.0)
    k8_offsets = batch * stride_k8_b + element_offsets(tokens, head, stride_k8_s, stride_k8_h)
    store_rows(k8, k8_offsets, valid, _onto_e4m3_grid(tl.math.div_rn(values, scale)), DIM,
               DIM_PAD)  # fmt: skip
    tl.store(k_scales + (batch * tl.num_programs(1) + head) * tl.num_programs(0) + block, scale)


def quantize_proxies(
    q_proxy: torch.Tensor, k_proxy: torch.Tensor, kv_block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 scoring's inputs from q_proxy [B, S_q, H_p, D_p] and k_proxy [B, S, H_pk, D_p]
    (S_q = S but for a context-parallel rank's queries): (q8 like q_proxy, fp32 q_scales
    [B, S_q, H_p], k8 like k_proxy, fp32 k_scales [B, H_pk, ceil(S / kv_block)]), q8 and k8
    float8_e4m3fn and contiguous, in one pass over each proxy. q8 is each (token, head) row
    of q_proxy times its factor, e4m3's largest value (448) over the row's largest magnitude,
    and q8 * q_scales is q_proxy up to e4m3's rounding; k8 each kv block of each key head
    divided by its largest magnitude over 448, k8 * k_scales (repeated over a block's keys)
    is k_proxy. Zero rows and blocks keep a factor of 1. The proxies' last dimension has
    stride 1 (the callers see to it)."""
    batch, seq_len, heads, dim = q_proxy.shape
    keys, heads_keys = k_proxy.shape[1:3]  # keys = seq_len but under context parallelism
    num_kv_blocks = math.ceil(keys / kv_block)
    q8 = torch.empty(q_proxy.shape, dtype=FP8, device=q_proxy.device)
    q_scales = torch.empty(batch, seq_len, heads, dtype=torch.float32, device=q_proxy.device)
    k8 = torch.empty(k_proxy.shape, dtype=FP8, device=k_proxy.device)
    k_scales = torch.empty(batch, heads_keys, num_kv_blocks, dtype=torch.float32,
                           device=k_proxy.device)  # fmt: skip
    if q8.numel():
        rows = batch * seq_len * heads
        _quantize_rows_kernel[(triton.cdiv(rows, ROWS),)](
            q_proxy=q_proxy, q8=q8, q_scales=q_scales, rows=rows, seq_len=seq_len, heads=heads,
            **strides("q", q_proxy), **strides("q8", q8), DIM=dim,
            DIM_PAD=_env.head_dim_pad(dim), ROWS=ROWS,
        )  # fmt: skip
        _quantize_blocks_kernel[(num_kv_blocks, heads_keys, batch)](
            k_proxy=k_proxy, k8=k8, k_scales=k_scales, seq_len=keys, **strides("k", k_proxy),
            **strides("k8", k8), DIM=dim, DIM_PAD=_env.head_dim_pad(dim), KV_BLOCK=kv_block,
            num_warps=8 if kv_block * dim > 4096 else 4,
        )  # fmt: skip
    return q8, q_scales, k8, k_scales


def check_score_dtype(score_dtype, device: torch.device) -> None:
    """score_dtype is None or FP8, and FP8 runs on device (tensor cores of sm_89 and up, or
    the interpreter; any CPU device passes before a call)."""
    if score_dtype not in (None, FP8):
        raise ValueError(
            f"score_dtype must be None (the proxies' dtype) or torch.float8_e4m3fn, got "
            f"{score_dtype!r}"
        )
    capability = _env.capability(device)
    if score_dtype == FP8 and capability is not None and capability < (8, 9):
        raise ValueError(
            f"score_dtype torch.float8_e4m3fn needs FP8 tensor cores (compute capability 8.9 "
            f"or more), but {device} has {capability[0]}.{capability[1]}: pass score_dtype=None"
        )
