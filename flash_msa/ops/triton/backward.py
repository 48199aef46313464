"""Block-sparse attention backward: FlashAttention-2's two-kernel split, without atomics.

1. dQ kernel (grid and packing of the forward): walks the CSR rows, recomputes P from
   q, k and lse, accumulates dQ in fp32. It also writes delta = rowsum(dO * O) for the
   second kernel, from the dO tile it holds anyway (no separate preprocessing pass).
2. dK/dV kernel: one program per (kv tile, kv head, batch) walks layout.transpose()
   rows for each query head of its GQA group, accumulates dK, dV in fp32 and writes
   them once.

Every output element is written by exactly one program, so results are bitwise
deterministic and autotuning reruns are harmless.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flash_msa.layout import BlockLayout
from flash_msa.ops.triton import configs
from flash_msa.ops.triton.forward import (
    AUTOTUNE_KEY,
    LOG2_E,
    _documents_of,
    _dropout_scale,
    _load_tile,
    _mask_scores,
    _packed_rows,
    _row_offsets,
    _row_steps,
    _step_first,
    _store_rows,
    _tile_source,
    descriptor_scratch,
    document_arguments,
    dot_precision,
    head_dim_pad,
    last_dim_contiguous,
    layout_arguments,
    mask_arguments,
    packing,
    tile_order,
    use_tma,
)

LOG2_E_CONSTANT: tl.constexpr = tl.constexpr(LOG2_E)


@triton.jit
def _log2_lse(lse_base, lse_offsets, row_valid):
    """lse in log2 units [R]; +inf for rows that saw nothing (and padding rows), so that
    exp2(scores - lse) is 0 there instead of NaN."""
    lse = tl.load(lse_base + lse_offsets, mask=row_valid, other=float("inf"))  # [R]
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2_E_CONSTANT)


@triton.jit
def _dq_kernel(
    q,
    k,
    v,
    out,
    grad_out,
    lse,
    delta,
    grad_q,
    row_offsets,
    col_indices,
    tile_order,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_os,
    stride_oh,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    stride_lse_b,
    stride_lse_h,
    documents,
    stride_documents_b,
    dropout_p,
    dropout_seed,
    stride_layout,
    seq_len_q,
    seq_len_kv,
    group,
    layout_batch_stride,
    layout_head_divisor,
    qk_scale,
    softmax_scale,
    window_left,
    window_right,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    PACK: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_DOCUMENTS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (num_q_blocks * Q_BLOCK // ROWS, H_q // PACK, B), tiles in tile_order; lse and
    delta are fp32 [B, H_q, S_q]."""
    tile = tl.load(tile_order + tl.program_id(0))  # heavy rows first
    first_head = tl.program_id(1) * PACK
    batch = tl.program_id(2).to(tl.int64)
    kv_head = first_head // group
    query_first = tile * ROWS
    query_last = query_first + ROWS - 1

    positions, heads = _packed_rows(query_first, first_head, ROWS, PACK)  # [BLOCK_M], [BLOCK_M]
    row_valid = positions < seq_len_q  # [BLOCK_M]
    ROW_TMA: tl.constexpr = TMA and PACK == 1  # a packed tile's rows are not one head's run
    q_source = _tile_source(q + batch * stride_qb, first_head, stride_qs, stride_qh, seq_len_q,
                            HEAD_DIM, ROWS, HEAD_DIM_PAD, ROW_TMA)  # fmt: skip
    q_tile = _load_tile(q_source, query_first, positions, heads, row_valid, stride_qs, stride_qh,
                        HEAD_DIM, HEAD_DIM_PAD, ROW_TMA)  # fmt: skip  # [BLOCK_M, D_PAD]
    o_source = _tile_source(out + batch * stride_ob, first_head, stride_os, stride_oh, seq_len_q,
                            HEAD_DIM, ROWS, HEAD_DIM_PAD, ROW_TMA)  # fmt: skip
    o_tile = _load_tile(o_source, query_first, positions, heads, row_valid, stride_os, stride_oh,
                        HEAD_DIM, HEAD_DIM_PAD, ROW_TMA)  # fmt: skip  # [BLOCK_M, D_PAD]
    do_source = _tile_source(grad_out + batch * stride_dob, first_head, stride_dos, stride_doh,
                             seq_len_q, HEAD_DIM, ROWS, HEAD_DIM_PAD, ROW_TMA)  # fmt: skip
    do_tile = _load_tile(do_source, query_first, positions, heads, row_valid, stride_dos,
                         stride_doh, HEAD_DIM, HEAD_DIM_PAD, ROW_TMA)  # fmt: skip
    documents += batch * stride_documents_b
    query_documents = _documents_of(documents, positions, seq_len_q, HAS_DOCUMENTS)[:, None]

    lse_offsets = batch * stride_lse_b + heads.to(tl.int64) * stride_lse_h + positions  # [BLOCK_M]
    row_delta = tl.sum(do_tile.to(tl.float32) * o_tile.to(tl.float32), 1)  # [BLOCK_M]
    tl.store(delta + lse_offsets, row_delta, mask=row_valid)
    row_lse = _log2_lse(lse, lse_offsets, row_valid)  # [BLOCK_M]

    k_source = _tile_source(k + batch * stride_kb, kv_head, stride_ks, stride_kh, seq_len_kv,
                            HEAD_DIM, BLOCK_N, HEAD_DIM_PAD, TMA)  # fmt: skip
    v_source = _tile_source(v + batch * stride_vb, kv_head, stride_vs, stride_vh, seq_len_kv,
                            HEAD_DIM, BLOCK_N, HEAD_DIM_PAD, TMA)  # fmt: skip
    key_range = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    layout = batch * layout_batch_stride + first_head // layout_head_divisor
    steps_per_block: tl.constexpr = KV_BLOCK // BLOCK_N
    step_start, step_end = _row_steps(
        row_offsets, layout, stride_layout, query_first // Q_BLOCK, steps_per_block
    )

    dq = tl.zeros([ROWS * PACK, HEAD_DIM_PAD], tl.float32)  # [BLOCK_M, D_PAD]
    for step in range(step_start, step_end):
        key_first = _step_first(col_indices, step, steps_per_block, KV_BLOCK, BLOCK_N)
        key_positions = key_first + key_range  # [BLOCK_N]
        key_valid = key_positions < seq_len_kv  # [BLOCK_N]
        k_tile = _load_tile(k_source, key_first, key_positions, kv_head, key_valid, stride_ks,
                            stride_kh, HEAD_DIM, HEAD_DIM_PAD, TMA)  # fmt: skip  # [BLOCK_N, D_PAD]
        v_tile = _load_tile(v_source, key_first, key_positions, kv_head, key_valid, stride_vs,
                            stride_vh, HEAD_DIM, HEAD_DIM_PAD, TMA)  # fmt: skip  # [BLOCK_N, D_PAD]

        scores = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION)
        scores *= qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        scores = _mask_scores(
            scores,
            positions[:, None],
            key_positions[None, :],
            query_first,
            query_last,
            key_first,
            BLOCK_N,
            seq_len_kv,
            window_left,
            window_right,
            HAS_LEFT,
            HAS_RIGHT,
            documents,
            query_documents,
            HAS_DOCUMENTS,
        )  # [BLOCK_M, BLOCK_N]
        probs = tl.math.exp2(scores - row_lse[:, None])  # [BLOCK_M, BLOCK_N]
        grad_probs = tl.dot(do_tile, tl.trans(v_tile), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:  # dP of the kept, rescaled probabilities; delta already has them
            grad_probs *= _dropout_scale(
                dropout_seed, batch, heads[:, None], positions[:, None], key_positions[None, :],
                dropout_p,
            )  # fmt: skip
        grad_scores = probs * (grad_probs - row_delta[:, None])  # [BLOCK_M, BLOCK_N]
        dq = tl.dot(grad_scores.to(k_tile.dtype), k_tile, dq, input_precision=DOT_PRECISION)

    dq_rows = _row_offsets(positions, heads, stride_dqs, stride_dqh)  # [BLOCK_M]
    dq = dq * softmax_scale  # [BLOCK_M, D_PAD]
    _store_rows(grad_q + batch * stride_dqb, dq_rows, row_valid, dq, HEAD_DIM, HEAD_DIM_PAD)


@triton.jit
def _dkdv_kernel(
    q,
    k,
    v,
    grad_out,
    lse,
    delta,
    grad_k,
    grad_v,
    row_offsets,
    row_indices,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_dvb,
    stride_dvs,
    stride_dvh,
    stride_lse_b,
    stride_lse_h,
    documents,
    stride_documents_b,
    dropout_p,
    dropout_seed,
    stride_layout,
    seq_len_q,
    seq_len_kv,
    group,
    layout_batch_stride,
    layout_head_divisor,
    qk_scale,
    softmax_scale,
    window_left,
    window_right,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    PACK: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    HAS_DOCUMENTS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (cdiv(S_kv, BLOCK_N), H_kv, B), in kv order: under a causal layout the first kv
    blocks are used by the most query blocks, so the heavy tiles already start first.
    row_offsets / row_indices: the transposed layout (rows = kv blocks, entries = q
    blocks). Query tiles are ROWS positions x PACK heads of the group, as in the forward."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    key_first = tile * BLOCK_N

    key_positions = key_first + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    key_valid = key_positions < seq_len_kv  # [BLOCK_N]
    k_source = _tile_source(k + batch * stride_kb, kv_head, stride_ks, stride_kh, seq_len_kv,
                            HEAD_DIM, BLOCK_N, HEAD_DIM_PAD, TMA)  # fmt: skip
    k_tile = _load_tile(k_source, key_first, key_positions, kv_head, key_valid, stride_ks,
                        stride_kh, HEAD_DIM, HEAD_DIM_PAD, TMA)  # fmt: skip  # [BLOCK_N, D_PAD]
    v_source = _tile_source(v + batch * stride_vb, kv_head, stride_vs, stride_vh, seq_len_kv,
                            HEAD_DIM, BLOCK_N, HEAD_DIM_PAD, TMA)  # fmt: skip
    v_tile = _load_tile(v_source, key_first, key_positions, kv_head, key_valid, stride_vs,
                        stride_vh, HEAD_DIM, HEAD_DIM_PAD, TMA)  # fmt: skip  # [BLOCK_N, D_PAD]
    documents += batch * stride_documents_b
    ROW_TMA: tl.constexpr = TMA and PACK == 1  # a packed tile's rows are not one head's run

    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)  # [BLOCK_N, D_PAD]
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)  # [BLOCK_N, D_PAD]
    steps_per_block: tl.constexpr = Q_BLOCK // ROWS
    for chunk in range(0, group // PACK):
        # PACK heads of the group at a time; each chunk reads its own layout row when
        # layout heads are per query head (then PACK = 1).
        first_head = kv_head * group + chunk * PACK
        layout = batch * layout_batch_stride + first_head // layout_head_divisor
        step_start, step_end = _row_steps(
            row_offsets, layout, stride_layout, key_first // KV_BLOCK, steps_per_block
        )
        q_source = _tile_source(q + batch * stride_qb, first_head, stride_qs, stride_qh,
                                seq_len_q, HEAD_DIM, ROWS, HEAD_DIM_PAD, ROW_TMA)  # fmt: skip
        do_source = _tile_source(
            grad_out + batch * stride_dob, first_head, stride_dos, stride_doh, seq_len_q,
            HEAD_DIM, ROWS, HEAD_DIM_PAD, ROW_TMA,
        )  # fmt: skip
        for step in range(step_start, step_end):
            query_first = _step_first(row_indices, step, steps_per_block, Q_BLOCK, ROWS)
            positions, heads = _packed_rows(query_first, first_head, ROWS, PACK)  # [BLOCK_M] x2
            row_valid = positions < seq_len_q  # [BLOCK_M]
            q_tile = _load_tile(q_source, query_first, positions, heads, row_valid, stride_qs,
                                stride_qh, HEAD_DIM, HEAD_DIM_PAD, ROW_TMA)  # fmt: skip
            do_tile = _load_tile(do_source, query_first, positions, heads, row_valid, stride_dos,
                                 stride_doh, HEAD_DIM, HEAD_DIM_PAD, ROW_TMA)  # fmt: skip
            lse_offsets = batch * stride_lse_b + heads.to(tl.int64) * stride_lse_h + positions
            row_lse = _log2_lse(lse, lse_offsets, row_valid)  # [BLOCK_M]; padding rows: +inf
            row_delta = tl.load(delta + lse_offsets, mask=row_valid, other=0.0)  # [BLOCK_M]

            # Transposed scores, so that dK and dV accumulate as [BLOCK_N, D] without transposes.
            scores = tl.dot(k_tile, tl.trans(q_tile), input_precision=DOT_PRECISION)
            scores *= qk_scale  # [BLOCK_N, BLOCK_M], log2 units
            scores = _mask_scores(
                scores,
                positions[None, :],
                key_positions[:, None],
                query_first,
                query_first + ROWS - 1,
                key_first,
                BLOCK_N,
                seq_len_kv,
                window_left,
                window_right,
                HAS_LEFT,
                HAS_RIGHT,
                documents,
                _documents_of(documents, positions, seq_len_q, HAS_DOCUMENTS)[None, :],
                HAS_DOCUMENTS,
            )  # [BLOCK_N, BLOCK_M]
            probs = tl.math.exp2(scores - row_lse[None, :])  # [BLOCK_N, BLOCK_M]
            if HAS_DROPOUT:  # dV from the kept, rescaled probabilities; dP likewise
                scale = _dropout_scale(
                    dropout_seed, batch, heads[None, :], positions[None, :],
                    key_positions[:, None], dropout_p,
                )  # fmt: skip  # [BLOCK_N, BLOCK_M]
                dropped = (probs * scale).to(do_tile.dtype)
                dv = tl.dot(dropped, do_tile, dv, input_precision=DOT_PRECISION)
                grad_probs = tl.dot(v_tile, tl.trans(do_tile), input_precision=DOT_PRECISION)
                grad_probs *= scale
            else:
                dv = tl.dot(probs.to(do_tile.dtype), do_tile, dv, input_precision=DOT_PRECISION)
                grad_probs = tl.dot(v_tile, tl.trans(do_tile), input_precision=DOT_PRECISION)
            grad_scores = probs * (grad_probs - row_delta[None, :])  # [BLOCK_N, BLOCK_M]
            dk = tl.dot(grad_scores.to(q_tile.dtype), q_tile, dk, input_precision=DOT_PRECISION)

    dk = dk * softmax_scale  # [BLOCK_N, D_PAD]
    dk_rows = key_positions.to(tl.int64) * stride_dks + kv_head.to(tl.int64) * stride_dkh
    _store_rows(grad_k + batch * stride_dkb, dk_rows, key_valid, dk, HEAD_DIM, HEAD_DIM_PAD)
    dv_rows = key_positions.to(tl.int64) * stride_dvs + kv_head.to(tl.int64) * stride_dvh
    _store_rows(grad_v + batch * stride_dvb, dv_rows, key_valid, dv, HEAD_DIM, HEAD_DIM_PAD)


@functools.cache
def _tuned_dq(head_dim_padded: int, kv_block: int):
    configs_list = configs.dq_configs(head_dim_padded, kv_block)
    return triton.autotune(configs=configs_list, key=AUTOTUNE_KEY)(_dq_kernel)


@functools.cache
def _tuned_dkdv(head_dim_padded: int):
    configs_list = configs.dkdv_configs(head_dim_padded)
    return triton.autotune(configs=configs_list, key=AUTOTUNE_KEY)(_dkdv_kernel)


def attention_backward(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) shaped like q, k, v in their dtypes; lse fp32 [B, H_q, S_q] from the forward."""
    grad_out, q, k, v, out = (last_dim_contiguous(t) for t in (grad_out, q, k, v, out))
    lse = lse.contiguous()
    batch, seq_len_q, heads_q, head_dim = q.shape
    seq_len_kv, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    padded = head_dim_pad(head_dim)
    layout_batch_stride, layout_head_divisor = layout_arguments(layout, heads_q, heads_kv)
    delta = torch.empty_like(lse)
    grad_q = torch.empty_like(q, memory_format=torch.contiguous_format)
    grad_k = torch.empty_like(k, memory_format=torch.contiguous_format)
    grad_v = torch.empty_like(v, memory_format=torch.contiguous_format)
    shared = dict(
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=padded,
        Q_BLOCK=layout.q_block,
        KV_BLOCK=layout.kv_block,
        DOT_PRECISION=dot_precision(q.dtype),
        TMA=use_tma(q, k, v, out, grad_out),
        HAS_DOCUMENTS=document_ids is not None,
        HAS_DROPOUT=dropout_p > 0,
        **mask_arguments(causal, window_size),
    )
    scalars = (
        seq_len_q, seq_len_kv, group, layout_batch_stride, layout_head_divisor,
        softmax_scale * LOG2_E, softmax_scale,
    )  # fmt: skip

    row_offsets = layout.row_offsets.contiguous()
    documents, stride_documents, _ = document_arguments(document_ids, row_offsets)
    tile = packing(layout, layout.q_block, configs.max_query_rows(padded, "dq"), heads_q, heads_kv)
    order = tile_order(layout, tile.rows)
    grid = (order.numel(), heads_q // tile.pack, batch)
    with descriptor_scratch(q.device):
        _tuned_dq(padded, layout.kv_block)[grid](
            q, k, v, out, grad_out, lse, delta, grad_q,
            row_offsets, layout.col_indices, order,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
            *grad_out.stride()[:3], *grad_q.stride()[:3], lse.stride(0), lse.stride(1),
            documents, stride_documents, dropout_p, dropout_seed, row_offsets.stride(0),
            *scalars, ROWS=tile.rows, PACK=tile.pack, **shared,
        )  # fmt: skip

    transposed = layout.transpose()
    transposed_offsets = transposed.row_offsets.contiguous()
    kv_rows = configs.dkdv_kv_rows(padded, layout.kv_block)
    max_rows = configs.max_query_rows(padded, "dkdv")
    tile = packing(layout, layout.q_block, max_rows, heads_q, heads_kv)
    grid = (triton.cdiv(seq_len_kv, kv_rows), heads_kv, batch)
    with descriptor_scratch(q.device):
        _tuned_dkdv(padded)[grid](
            q, k, v, grad_out, lse, delta, grad_k, grad_v,
            transposed_offsets, transposed.col_indices,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3],
            *grad_k.stride()[:3], *grad_v.stride()[:3], lse.stride(0), lse.stride(1),
            documents, stride_documents, dropout_p, dropout_seed, transposed_offsets.stride(0),
            *scalars,
            ROWS=tile.rows, PACK=tile.pack, **shared, BLOCK_N=kv_rows,
        )  # fmt: skip
    return grad_q, grad_k, grad_v
