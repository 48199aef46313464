"""Block-sparse attention backward in one kernel, dQ accumulated with fp32 atomics
(FlashAttention-2/3's backward when determinism is not asked for).

1. delta = rowsum(dO * O), fp32 [B, H_q, S_q], by a small row kernel.
2. One program per (kv tile, kv head, batch) walks layout.transpose() rows for each query
   head of its GQA group, as backward.py's dK/dV kernel does, and per query tile also adds
   its share of dQ, dS K, into an fp32 [B, S_q, H_q, D] buffer with relaxed atomic adds.

Five matmuls per (kv tile, query tile) pair (S^T, dP^T, dV, dK, dQ) where the two-kernel
backward needs seven (its dQ kernel recomputes S and dP). The order in which programs add
into a dQ row varies between runs, so dQ is not bitwise reproducible; dK and dV are.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flash_msa import _env
from flash_msa.layout import BlockLayout, BlockPositions
from flash_msa.ops.registry import QueryMasks
from flash_msa.ops.triton import configs
from flash_msa.ops.triton.backward import (
    dkdv_step,
    dkdv_tiles,
    key_program,
    query_chunk,
    shared_arguments,
    store_dkdv,
)
from flash_msa.ops.triton.common import (
    AUTOTUNE_KEY,
    config_arguments,
    descriptor_scratch,
    element_offsets,
    load_rows,
    padding_rows,
    query_mask_arguments,
    resolve_tma,
    strides,
)

DELTA_ROWS = 64  # rows of a delta program


@triton.jit
def _delta_kernel(
    out, grad_out, delta, stride_out_b, stride_out_s, stride_out_h, stride_grad_out_b,
    stride_grad_out_s, stride_grad_out_h, stride_delta_b, stride_delta_h, seq_len_q,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(S_q, ROWS), H_q, B): delta fp32 [B, H_q, S_q] = rowsum(dO * O) in fp32."""
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    row_valid = rows < seq_len_q  # [ROWS]
    o_tile = load_rows(out + batch * stride_out_b,
                       element_offsets(rows, head, stride_out_s, stride_out_h), row_valid,
                       HEAD_DIM, HEAD_DIM_PAD)  # fmt: skip  # [ROWS, D_PAD]
    do_tile = load_rows(grad_out + batch * stride_grad_out_b,
                        element_offsets(rows, head, stride_grad_out_s, stride_grad_out_h),
                        row_valid, HEAD_DIM, HEAD_DIM_PAD)  # fmt: skip  # [ROWS, D_PAD]
    row_delta = tl.sum(do_tile.to(tl.float32) * o_tile.to(tl.float32), 1)  # [ROWS]
    offsets = batch * stride_delta_b + head.to(tl.int64) * stride_delta_h + rows
    tl.store(delta + offsets, row_delta, mask=row_valid)


@triton.jit
def _fused_kernel(
    q, k, v, grad_out, lse, delta, grad_q_sum, grad_k, grad_v, row_offsets, row_indices,
    documents, q_block_positions, kv_block_positions, query_masks,
    stride_q_b, stride_q_s, stride_q_h, stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h, stride_grad_out_b, stride_grad_out_s, stride_grad_out_h,
    stride_grad_q_sum_b, stride_grad_q_sum_s, stride_grad_q_sum_h,
    stride_grad_k_b, stride_grad_k_s, stride_grad_k_h,
    stride_grad_v_b, stride_grad_v_s, stride_grad_v_h, stride_lse_b, stride_lse_h,
    stride_documents_b, stride_layout,
    dropout_p, dropout_seed, seq_len_q, seq_len_kv, position_seq_len, group,
    layout_batch_stride, layout_head_divisor, qk_scale, softmax_scale, window_left, window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, Q_BLOCK: tl.constexpr,
    KV_BLOCK: tl.constexpr, ROWS: tl.constexpr, PACK: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_DOCUMENTS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, HAS_QUERY_MASKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid, tiles, layout and options of backward._dkdv_kernel; delta is read, not written.
    grad_q_sum: fp32 [B, S_q, H_q, D], zero on entry, receives sum dS K (without
    softmax_scale) of every query tile the program meets."""
    kv_head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    key_row_first = tl.program_id(0) * BLOCK_N
    query_end = position_seq_len if HAS_POSITIONS else seq_len_q
    key_end = position_seq_len if HAS_POSITIONS else seq_len_kv
    key_rows, key_first, key_positions, k_tile, v_tile = key_program(
        k + batch * stride_k_b, v + batch * stride_v_b, kv_head, key_row_first,
        kv_block_positions, stride_k_s, stride_k_h, stride_v_s, stride_v_h, seq_len_kv,
        position_seq_len, HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK, BLOCK_N, HAS_POSITIONS, TMA,
    )  # fmt: skip  # [BLOCK_N] x3 and [BLOCK_N, D_PAD] x2
    documents += batch * stride_documents_b
    grad_q_sum += batch * stride_grad_q_sum_b
    dims = tl.arange(0, HEAD_DIM_PAD)  # [D_PAD]

    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)  # [BLOCK_N, D_PAD]
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)  # [BLOCK_N, D_PAD]
    for chunk in range(0, group // PACK):
        first_head, step_start, step_end, q_source, do_source = query_chunk(
            q + batch * stride_q_b, grad_out + batch * stride_grad_out_b, row_offsets, chunk,
            kv_head, batch, key_row_first, stride_q_s, stride_q_h, stride_grad_out_s,
            stride_grad_out_h, stride_layout, seq_len_q, group, layout_batch_stride,
            layout_head_divisor, HEAD_DIM, HEAD_DIM_PAD, Q_BLOCK, KV_BLOCK, ROWS, PACK, TMA,
        )  # fmt: skip
        for step in range(step_start, step_end):
            dk, dv, grad_scores, rows, heads, row_valid = dkdv_step(
                dk, dv, k_tile, v_tile, q_source, do_source, lse, delta, row_indices,
                documents, q_block_positions, query_masks, step, batch, first_head, key_first,
                key_positions, stride_q_s, stride_q_h, stride_grad_out_s, stride_grad_out_h,
                stride_lse_b, stride_lse_h, dropout_p, dropout_seed, seq_len_q, query_end,
                key_end, qk_scale, window_left, window_right, HEAD_DIM, HEAD_DIM_PAD, Q_BLOCK,
                BLOCK_N, ROWS, PACK, HAS_LEFT, HAS_RIGHT, HAS_DOCUMENTS, HAS_DROPOUT,
                HAS_POSITIONS, HAS_QUERY_MASKS, DOT_PRECISION, TMA,
            )  # fmt: skip  # grad_scores [BLOCK_N, BLOCK_M]; rows, heads, row_valid [BLOCK_M]
            dq = tl.dot(tl.trans(grad_scores).to(k_tile.dtype), k_tile,
                        input_precision=DOT_PRECISION)  # fmt: skip  # [BLOCK_M, D_PAD]
            offsets = element_offsets(rows, heads, stride_grad_q_sum_s, stride_grad_q_sum_h)
            mask = row_valid[:, None] & (dims[None, :] < HEAD_DIM)  # [BLOCK_M, D_PAD]
            tl.atomic_add(grad_q_sum + offsets[:, None] + dims[None, :], dq, mask=mask,
                          sem="relaxed")  # fmt: skip

    store_dkdv(grad_k + batch * stride_grad_k_b, grad_v + batch * stride_grad_v_b, dk, dv,
               key_rows, kv_head, stride_grad_k_s, stride_grad_k_h, stride_grad_v_s,
               stride_grad_v_h, seq_len_kv, softmax_scale, HEAD_DIM,
               HEAD_DIM_PAD)  # fmt: skip


@functools.cache
def _tuned_fused(launch: configs.Launch, block_n: int):
    # The autotuner runs every config on the same buffers: dQ's sum starts from zero each time.
    choices = configs.dkdv_configs(launch, block_n)
    return triton.autotune(configs=choices, key=AUTOTUNE_KEY, reset_to_zero=["grad_q_sum"])(
        _fused_kernel
    )


def attention_backward_atomic(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    layout: BlockLayout,
    *,
    causal: bool,
    window_size: tuple[int, int],
    softmax_scale: float,
    document_ids: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    positions: BlockPositions | None = None,
    query_masks: QueryMasks | None = None,
    tma: bool | None = None,
    query_rows: int | None = None,
    kv_rows: int | None = None,
    config: triton.Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """backward.attention_backward's gradients from one kernel over the transposed layout,
    dQ through fp32 atomics (not bitwise reproducible).

    Args:
        grad_out, q, k, v, out, lse, layout and the options up to query_masks: as in
            backward.attention_backward (query_masks: the kernel reads the CSC words).
        tma: as in attention_forward.
        query_rows: the most rows of a query tile; kv_rows: key rows of a program (None:
            the configs module's choices for the dK/dV kernel).
        config: run this kernel config instead of autotuning.

    Returns:
        (dq, dk, dv) shaped like q, k, v in their dtypes, contiguous.
    """
    batch, seq_len_q, heads_q, head_dim = q.shape
    heads_kv = k.shape[2]
    padded = _env.head_dim_pad(head_dim)
    delta = torch.empty_like(lse)
    grad_q_sum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # [B, S_q, H_q, D]
    grad_k = torch.empty_like(k, memory_format=torch.contiguous_format)
    grad_v = torch.empty_like(v, memory_format=torch.contiguous_format)
    tma = resolve_tma(tma, q, k, v, grad_out,
                      kv_padding=padding_rows(positions, layout.kv_block))  # fmt: skip

    _delta_kernel[(triton.cdiv(seq_len_q, DELTA_ROWS), heads_q, batch)](
        out=out, grad_out=grad_out, delta=delta, **strides("out", out),
        **strides("grad_out", grad_out), **strides("delta", delta, "bh"), seq_len_q=seq_len_q,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=padded, ROWS=DELTA_ROWS,
    )  # fmt: skip

    transposed = layout.transpose()
    tile, kv_rows, launch = dkdv_tiles(layout, q, heads_kv, tma, query_rows, kv_rows)
    grid = (triton.cdiv(k.shape[1], kv_rows), heads_kv, batch)
    kernel = _fused_kernel if config is not None else _tuned_fused(launch, kv_rows)
    with descriptor_scratch(q.device):
        kernel[grid](
            grad_q_sum=grad_q_sum, grad_k=grad_k, grad_v=grad_v,
            row_offsets=transposed.row_offsets, row_indices=transposed.col_indices,
            **strides("grad_q_sum", grad_q_sum), **strides("grad_k", grad_k),
            **strides("grad_v", grad_v), stride_layout=transposed.row_offsets.stride(0),
            **query_mask_arguments(query_masks, "csc", layout.row_offsets), ROWS=tile.rows,
            PACK=tile.pack, BLOCK_N=kv_rows,
            **shared_arguments(
                grad_out, q, k, v, lse, delta, layout, causal=causal, window_size=window_size,
                softmax_scale=softmax_scale, document_ids=document_ids, dropout_p=dropout_p,
                dropout_seed=dropout_seed, positions=positions, tma=tma,
            ),
            **config_arguments(config),
        )  # fmt: skip
    return grad_q_sum.mul_(softmax_scale).to(q.dtype), grad_k, grad_v
