"""Block-sparse attention backward: FlashAttention-2's two-kernel split, without atomics.

1. dQ kernel (grid and packing of the forward): walks the CSR rows, recomputes P from
   q, k and lse, accumulates dQ in fp32. It also writes delta = rowsum(dO * O) for the
   second kernel, from the dO tile it holds anyway (no separate preprocessing pass).
2. dK/dV kernel: one program per (kv tile, kv head, batch) walks layout.transpose()
   rows for each query head of its GQA group, accumulates dK, dV in fp32 and writes
   them once. Per-token query masks reach it in the transposed layout's order
   (QueryMasks.csc).

Every output element is written by exactly one program, so results are bitwise
deterministic and autotuning reruns are harmless. With block positions both walk local rows
and buffer slots while masks and dropout see the sequence's positions, as in the forward.
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
from flash_msa.ops.triton.common import (
    AUTOTUNE_KEY,
    config_arguments,
    descriptor_scratch,
    document_arguments,
    documents_of,
    dropout_scale,
    element_offsets,
    global_positions,
    kv_step,
    layout_arguments,
    load_query_tile,
    load_tile,
    log2_lse,
    mask_arguments,
    mask_scores,
    packed_rows,
    packing,
    padding_rows,
    position_arguments,
    query_mask_arguments,
    query_mask_word,
    query_program,
    resolve_tma,
    row_steps,
    step_first,
    store_rows,
    strides,
    tile_order,
    tile_source,
)


@triton.jit
def _dq_kernel(
    q, k, v, out, grad_out, lse, delta, grad_q, row_offsets, col_indices, tile_order, documents,
    q_block_positions, kv_block_positions, query_masks,
    stride_q_b, stride_q_s, stride_q_h, stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h, stride_out_b, stride_out_s, stride_out_h,
    stride_grad_out_b, stride_grad_out_s, stride_grad_out_h,
    stride_grad_q_b, stride_grad_q_s, stride_grad_q_h, stride_lse_b, stride_lse_h,
    stride_documents_b, stride_layout,
    dropout_p, dropout_seed, seq_len_q, seq_len_kv, position_seq_len, group,
    layout_batch_stride, layout_head_divisor, qk_scale, softmax_scale, window_left, window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, Q_BLOCK: tl.constexpr,
    KV_BLOCK: tl.constexpr, ROWS: tl.constexpr, PACK: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_DOCUMENTS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, HAS_QUERY_MASKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid (num_q_blocks * Q_BLOCK // ROWS, H_q // PACK, B), tiles in tile_order; lse and
    delta are fp32 [B, H_q, S_q]. HAS_POSITIONS, HAS_QUERY_MASKS: as in the forward."""
    batch, first_head, kv_head, first_row, rows, heads, row_valid = query_program(
        tile_order, seq_len_q, group, ROWS, PACK
    )  # rows, heads, row_valid: [BLOCK_M]
    query_first, query_positions = global_positions(first_row, rows, Q_BLOCK, q_block_positions,
                                                    HAS_POSITIONS)  # fmt: skip  # [BLOCK_M]
    query_last = query_first + ROWS - 1
    query_end = position_seq_len if HAS_POSITIONS else seq_len_q
    key_end = position_seq_len if HAS_POSITIONS else seq_len_kv
    ROW_TMA: tl.constexpr = TMA and PACK == 1  # a packed tile's rows are not one head's run
    q_tile = load_query_tile(q + batch * stride_q_b, first_head, first_row, rows, heads,
                             row_valid, stride_q_s, stride_q_h, seq_len_q, HEAD_DIM, HEAD_DIM_PAD,
                             ROWS, ROW_TMA)  # fmt: skip  # [BLOCK_M, D_PAD]
    o_tile = load_query_tile(out + batch * stride_out_b, first_head, first_row, rows,
                             heads, row_valid, stride_out_s, stride_out_h, seq_len_q, HEAD_DIM,
                             HEAD_DIM_PAD, ROWS, ROW_TMA)  # fmt: skip  # [BLOCK_M, D_PAD]
    do_tile = load_query_tile(grad_out + batch * stride_grad_out_b, first_head, first_row,
                              rows, heads, row_valid, stride_grad_out_s, stride_grad_out_h,
                              seq_len_q, HEAD_DIM, HEAD_DIM_PAD, ROWS,
                              ROW_TMA)  # fmt: skip  # [BLOCK_M, D_PAD]
    documents += batch * stride_documents_b
    query_documents = documents_of(documents, query_positions, query_end,
                                   HAS_DOCUMENTS)[:, None]  # fmt: skip

    lse_offsets = batch * stride_lse_b + heads.to(tl.int64) * stride_lse_h + rows  # [BLOCK_M]
    row_delta = tl.sum(do_tile.to(tl.float32) * o_tile.to(tl.float32), 1)  # [BLOCK_M]
    tl.store(delta + lse_offsets, row_delta, mask=row_valid)
    row_lse = log2_lse(lse, lse_offsets, row_valid)  # [BLOCK_M]

    k_source = tile_source(k + batch * stride_k_b, kv_head, stride_k_s, stride_k_h, seq_len_kv,
                           HEAD_DIM, BLOCK_N, HEAD_DIM_PAD, TMA)  # fmt: skip
    v_source = tile_source(v + batch * stride_v_b, kv_head, stride_v_s, stride_v_h, seq_len_kv,
                           HEAD_DIM, BLOCK_N, HEAD_DIM_PAD, TMA)  # fmt: skip
    layout = batch * layout_batch_stride + first_head // layout_head_divisor
    STEPS_PER_BLOCK: tl.constexpr = KV_BLOCK // BLOCK_N
    step_start, step_end = row_steps(
        row_offsets, layout, stride_layout, first_row // Q_BLOCK, STEPS_PER_BLOCK
    )

    dq = tl.zeros([ROWS * PACK, HEAD_DIM_PAD], tl.float32)  # [BLOCK_M, D_PAD]
    for step in range(step_start, step_end):
        k_tile, v_tile, key_positions, scores = kv_step(
            q_tile, k_source, v_source, col_indices, kv_block_positions, query_masks, step,
            kv_head, query_positions, query_first, query_last, query_documents, documents,
            stride_k_s, stride_k_h, stride_v_s, stride_v_h, key_end, qk_scale, window_left,
            window_right, STEPS_PER_BLOCK, Q_BLOCK, ROWS, KV_BLOCK, BLOCK_N, HEAD_DIM,
            HEAD_DIM_PAD, HAS_LEFT, HAS_RIGHT, HAS_DOCUMENTS, HAS_POSITIONS, HAS_QUERY_MASKS,
            DOT_PRECISION, TMA,
        )  # fmt: skip  # scores [BLOCK_M, BLOCK_N]
        probs = tl.math.exp2(scores - row_lse[:, None])  # [BLOCK_M, BLOCK_N]
        grad_probs = tl.dot(do_tile, tl.trans(v_tile), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:  # dP of the kept, rescaled probabilities; delta already has them
            grad_probs *= dropout_scale(
                dropout_seed, batch, heads[:, None], query_positions[:, None],
                key_positions[None, :], dropout_p,
            )  # fmt: skip
        grad_scores = probs * (grad_probs - row_delta[:, None])  # [BLOCK_M, BLOCK_N]
        dq = tl.dot(grad_scores.to(k_tile.dtype), k_tile, dq, input_precision=DOT_PRECISION)

    dq_offsets = element_offsets(rows, heads, stride_grad_q_s, stride_grad_q_h)  # [BLOCK_M]
    dq = dq * softmax_scale  # [BLOCK_M, D_PAD]
    store_rows(grad_q + batch * stride_grad_q_b, dq_offsets, row_valid, dq, HEAD_DIM, HEAD_DIM_PAD)


@triton.jit
def _key_program(
    k, v, kv_head, key_row_first, kv_block_positions, stride_k_s, stride_k_h,
    stride_v_s, stride_v_h, seq_len_kv, position_seq_len, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """What a dK/dV program holds for its life: its key rows and positions [BLOCK_N], the
    first key position, and its K and V tiles [BLOCK_N, D_PAD] (k, v point at this batch
    row; rows past the keys' end read as 0)."""
    key_rows = key_row_first + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    key_first, key_positions = global_positions(key_row_first, key_rows, KV_BLOCK,
                                                kv_block_positions, HAS_POSITIONS)  # fmt: skip
    key_end = position_seq_len if HAS_POSITIONS else seq_len_kv
    key_valid = key_positions < key_end  # [BLOCK_N] rows that hold keys
    k_source = tile_source(k, kv_head, stride_k_s, stride_k_h, seq_len_kv, HEAD_DIM, BLOCK_N,
                           HEAD_DIM_PAD, TMA)  # fmt: skip
    k_tile = load_tile(k_source, key_row_first, key_rows, kv_head, key_valid, stride_k_s,
                       stride_k_h, HEAD_DIM, HEAD_DIM_PAD, TMA)  # fmt: skip  # [BLOCK_N, D_PAD]
    v_source = tile_source(v, kv_head, stride_v_s, stride_v_h, seq_len_kv, HEAD_DIM, BLOCK_N,
                           HEAD_DIM_PAD, TMA)  # fmt: skip
    v_tile = load_tile(v_source, key_row_first, key_rows, kv_head, key_valid, stride_v_s,
                       stride_v_h, HEAD_DIM, HEAD_DIM_PAD, TMA)  # fmt: skip  # [BLOCK_N, D_PAD]
    return key_rows, key_first, key_positions, k_tile, v_tile


@triton.jit
def _query_chunk(
    q, grad_out, row_offsets, chunk, kv_head, batch, key_row_first, stride_q_s, stride_q_h,
    stride_grad_out_s, stride_grad_out_h, stride_layout, seq_len_q, group, layout_batch_stride,
    layout_head_divisor, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    Q_BLOCK: tl.constexpr, KV_BLOCK: tl.constexpr, ROWS: tl.constexpr, PACK: tl.constexpr,
    TMA: tl.constexpr,
):  # fmt: skip
    """PACK query heads of the group at a time: a chunk's first head, its [start, end) steps
    along the transposed layout's row of the program's kv block (each chunk reads its own
    layout row when layout heads are per query head; then PACK = 1), and where its q and dO
    tiles come from (q, grad_out point at this batch row)."""
    ROW_TMA: tl.constexpr = TMA and PACK == 1  # a packed tile's rows are not one head's run
    first_head = kv_head * group + chunk * PACK
    layout = batch * layout_batch_stride + first_head // layout_head_divisor
    step_start, step_end = row_steps(
        row_offsets, layout, stride_layout, key_row_first // KV_BLOCK, Q_BLOCK // ROWS
    )
    q_source = tile_source(q, first_head, stride_q_s, stride_q_h, seq_len_q, HEAD_DIM, ROWS,
                           HEAD_DIM_PAD, ROW_TMA)  # fmt: skip
    do_source = tile_source(grad_out, first_head, stride_grad_out_s, stride_grad_out_h,
                            seq_len_q, HEAD_DIM, ROWS, HEAD_DIM_PAD, ROW_TMA)  # fmt: skip
    return first_head, step_start, step_end, q_source, do_source


@triton.jit
def _dkdv_step(
    dk, dv, k_tile, v_tile, q_source, do_source, lse, delta, row_indices, documents,
    q_block_positions, query_masks, step, step_end, batch, first_head, key_first, key_positions,
    stride_q_s, stride_q_h, stride_grad_out_s, stride_grad_out_h, stride_lse_b, stride_lse_h,
    dropout_p, dropout_seed, seq_len_q, query_end, key_end, qk_scale, window_left,
    window_right, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, Q_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, PACK: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_DOCUMENTS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, HAS_QUERY_MASKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, TOKENS: tl.constexpr,
):  # fmt: skip
    """One query tile of a dK/dV program (step along the transposed layout's row, of
    [step_start, step_end)): dK and dV [BLOCK_N, D_PAD] accumulated. lse and delta are
    fp32 [B, H_q, S_q]; documents points at this batch row's ids. TOKENS > 1 (rows of one token,
    Q_BLOCK 1, no query masks): the tile gathers the steps step .. step + TOKENS - 1, each a
    token of PACK heads, BLOCK_M = TOKENS * PACK."""
    ROW_TMA: tl.constexpr = TMA and PACK == 1
    STEPS_PER_BLOCK: tl.constexpr = Q_BLOCK // ROWS
    if TOKENS > 1:
        slots = tl.arange(0, TOKENS * PACK)  # [BLOCK_M], heads fastest
        entries = step + slots // PACK
        live = entries < step_end
        rows = tl.load(row_indices + entries, mask=live, other=0)  # [BLOCK_M] the tokens
        heads = first_head + slots % PACK
        row_valid = live & (rows < seq_len_q)
        query_positions = rows
        if HAS_POSITIONS:
            query_positions = tl.load(q_block_positions + rows, mask=live, other=0)
        # Bounds of the tile's positions, for mask_scores' whole-tile tests.
        query_first = tl.min(tl.where(live, query_positions, query_end), 0)
        query_last = tl.max(tl.where(live, query_positions, -1), 0)
        first_row = query_first  # read by TMA loads only, which packed tiles never take
    else:
        first_row = step_first(row_indices, step, STEPS_PER_BLOCK, Q_BLOCK, ROWS)
        rows, heads = packed_rows(first_row, first_head, ROWS, PACK)  # [BLOCK_M] x2
        row_valid = rows < seq_len_q  # [BLOCK_M]
        query_first, query_positions = global_positions(
            first_row, rows, Q_BLOCK, q_block_positions, HAS_POSITIONS
        )  # [BLOCK_M]
        query_last = query_first + ROWS - 1
    q_tile = load_tile(q_source, first_row, rows, heads, row_valid, stride_q_s, stride_q_h,
                       HEAD_DIM, HEAD_DIM_PAD, ROW_TMA)  # fmt: skip  # [BLOCK_M, D_PAD]
    do_tile = load_tile(do_source, first_row, rows, heads, row_valid, stride_grad_out_s,
                        stride_grad_out_h, HEAD_DIM, HEAD_DIM_PAD,
                        ROW_TMA)  # fmt: skip  # [BLOCK_M, D_PAD]
    lse_offsets = batch * stride_lse_b + heads.to(tl.int64) * stride_lse_h + rows
    row_lse = log2_lse(lse, lse_offsets, row_valid)  # [BLOCK_M]; padding rows: +inf
    row_delta = tl.load(delta + lse_offsets, mask=row_valid, other=0.0)  # [BLOCK_M]

    # Transposed scores, so that dK and dV accumulate as [BLOCK_N, D] without transposes.
    scores = tl.dot(k_tile, tl.trans(q_tile), input_precision=DOT_PRECISION)
    scores *= qk_scale  # [BLOCK_N, BLOCK_M], log2 units
    query_documents = documents_of(documents, query_positions, query_end, HAS_DOCUMENTS)
    query_mask = query_mask_word(query_masks, step // STEPS_PER_BLOCK, HAS_QUERY_MASKS)
    scores = mask_scores(
        scores, query_positions[None, :], key_positions[:, None], query_first, query_last,
        key_first, BLOCK_N, key_end, window_left, window_right,
        HAS_LEFT, HAS_RIGHT, documents, query_documents[None, :], HAS_DOCUMENTS, query_mask,
        Q_BLOCK, ROWS, HAS_QUERY_MASKS,
    )  # fmt: skip  # [BLOCK_N, BLOCK_M]
    probs = tl.math.exp2(scores - row_lse[None, :])  # [BLOCK_N, BLOCK_M]
    grad_probs = tl.dot(v_tile, tl.trans(do_tile), input_precision=DOT_PRECISION)
    if HAS_DROPOUT:  # dV from the kept, rescaled probabilities; dP likewise
        scale = dropout_scale(
            dropout_seed, batch, heads[None, :], query_positions[None, :],
            key_positions[:, None], dropout_p,
        )  # fmt: skip  # [BLOCK_N, BLOCK_M]
        dv = tl.dot((probs * scale).to(do_tile.dtype), do_tile, dv,
                    input_precision=DOT_PRECISION)  # fmt: skip
        grad_probs *= scale
    else:
        dv = tl.dot(probs.to(do_tile.dtype), do_tile, dv, input_precision=DOT_PRECISION)
    grad_scores = probs * (grad_probs - row_delta[None, :])  # [BLOCK_N, BLOCK_M]
    dk = tl.dot(grad_scores.to(q_tile.dtype), q_tile, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _store_dkdv(
    grad_k, grad_v, dk, dv, key_rows, kv_head, stride_grad_k_s, stride_grad_k_h,
    stride_grad_v_s, stride_grad_v_h, seq_len_kv, softmax_scale, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    """Write a dK/dV program's dK (times softmax_scale) and dV [BLOCK_N, D_PAD] (grad_k,
    grad_v point at this batch row); with positions its padding rows too (zeros)."""
    row_valid = key_rows < seq_len_kv  # [BLOCK_N]
    dk_offsets = element_offsets(key_rows, kv_head, stride_grad_k_s, stride_grad_k_h)
    store_rows(grad_k, dk_offsets, row_valid, dk * softmax_scale, HEAD_DIM, HEAD_DIM_PAD)
    dv_offsets = element_offsets(key_rows, kv_head, stride_grad_v_s, stride_grad_v_h)
    store_rows(grad_v, dv_offsets, row_valid, dv, HEAD_DIM, HEAD_DIM_PAD)


@triton.jit
def _dkdv_kernel(
    q, k, v, grad_out, lse, delta, grad_k, grad_v, row_offsets, row_indices, documents,
    q_block_positions, kv_block_positions, query_masks,
    stride_q_b, stride_q_s, stride_q_h, stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h, stride_grad_out_b, stride_grad_out_s, stride_grad_out_h,
    stride_grad_k_b, stride_grad_k_s, stride_grad_k_h,
    stride_grad_v_b, stride_grad_v_s, stride_grad_v_h, stride_lse_b, stride_lse_h,
    stride_documents_b, stride_layout,
    dropout_p, dropout_seed, seq_len_q, seq_len_kv, position_seq_len, group,
    layout_batch_stride, layout_head_divisor, qk_scale, softmax_scale, window_left, window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, Q_BLOCK: tl.constexpr,
    KV_BLOCK: tl.constexpr, ROWS: tl.constexpr, PACK: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_DOCUMENTS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, HAS_QUERY_MASKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(S_kv, BLOCK_N), H_kv, B), in kv order: under a causal layout the first kv
    blocks are used by the most query blocks, so the heavy tiles already start first.
    row_offsets / row_indices: the transposed layout (rows = kv blocks, entries = q
    blocks). Query tiles are ROWS positions x PACK heads of the group, as in the forward.
    HAS_POSITIONS: the programs walk buffer slots (kv blocks of the layout) and local query
    blocks, whose positions come from kv_block_positions and q_block_positions; a slot's
    padding rows (past the sequence end) get dK = dV = 0. HAS_QUERY_MASKS: query_masks are
    the words in the transposed layout's order (aligned with row_indices). TOKENS: steps a
    query tile gathers (_dkdv_step)."""
    kv_head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    key_row_first = tl.program_id(0) * BLOCK_N
    query_end = position_seq_len if HAS_POSITIONS else seq_len_q
    key_end = position_seq_len if HAS_POSITIONS else seq_len_kv
    key_rows, key_first, key_positions, k_tile, v_tile = _key_program(
        k + batch * stride_k_b, v + batch * stride_v_b, kv_head, key_row_first,
        kv_block_positions, stride_k_s, stride_k_h, stride_v_s, stride_v_h, seq_len_kv,
        position_seq_len, HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK, BLOCK_N, HAS_POSITIONS, TMA,
    )  # fmt: skip  # [BLOCK_N] x3 and [BLOCK_N, D_PAD] x2
    documents += batch * stride_documents_b

    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)  # [BLOCK_N, D_PAD]
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)  # [BLOCK_N, D_PAD]
    for chunk in range(0, group // PACK):
        first_head, step_start, step_end, q_source, do_source = _query_chunk(
            q + batch * stride_q_b, grad_out + batch * stride_grad_out_b, row_offsets, chunk,
            kv_head, batch, key_row_first, stride_q_s, stride_q_h, stride_grad_out_s,
            stride_grad_out_h, stride_layout, seq_len_q, group, layout_batch_stride,
            layout_head_divisor, HEAD_DIM, HEAD_DIM_PAD, Q_BLOCK, KV_BLOCK, ROWS, PACK, TMA,
        )  # fmt: skip
        for step in range(step_start, step_end, TOKENS):
            dk, dv = _dkdv_step(
                dk, dv, k_tile, v_tile, q_source, do_source, lse, delta, row_indices,
                documents, q_block_positions, query_masks, step, step_end, batch, first_head,
                key_first,
                key_positions, stride_q_s, stride_q_h, stride_grad_out_s, stride_grad_out_h,
                stride_lse_b, stride_lse_h, dropout_p, dropout_seed, seq_len_q, query_end,
                key_end, qk_scale, window_left, window_right, HEAD_DIM, HEAD_DIM_PAD, Q_BLOCK,
                BLOCK_N, ROWS, PACK, HAS_LEFT, HAS_RIGHT, HAS_DOCUMENTS, HAS_DROPOUT,
                HAS_POSITIONS, HAS_QUERY_MASKS, DOT_PRECISION, TMA, TOKENS,
            )  # fmt: skip  # [BLOCK_N, D_PAD] x2

    _store_dkdv(grad_k + batch * stride_grad_k_b, grad_v + batch * stride_grad_v_b, dk, dv,
               key_rows, kv_head, stride_grad_k_s, stride_grad_k_h, stride_grad_v_s,
               stride_grad_v_h, seq_len_kv, softmax_scale, HEAD_DIM,
               HEAD_DIM_PAD)  # fmt: skip


@functools.cache
def _tuned_dq(launch: configs.Launch, kv_block: int):
    choices = configs.dq_configs(launch, kv_block)
    return triton.autotune(configs=choices, key=AUTOTUNE_KEY)(_dq_kernel)


@functools.cache
def _tuned_dkdv(launch: configs.Launch, block_n: int):
    choices = configs.dkdv_configs(launch, block_n)
    return triton.autotune(configs=choices, key=AUTOTUNE_KEY)(_dkdv_kernel)


def _shared_arguments(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    layout: BlockLayout,
    *,
    causal: bool,
    window_size: tuple[int, int],
    softmax_scale: float,
    document_ids: torch.Tensor | None,
    dropout_p: float,
    dropout_seed: int,
    positions: BlockPositions | None,
    tma: bool,
) -> dict:
    """Launch keywords both backward kernels take (dQ and dK/dV): inputs, strides, masks,
    sizes and constexprs."""
    heads_q, head_dim = q.shape[2], q.shape[3]
    return dict(
        q=q, k=k, v=v, grad_out=grad_out, lse=lse, delta=delta,
        **strides("q", q), **strides("k", k), **strides("v", v),
        **strides("grad_out", grad_out), **strides("lse", lse, "bh"),
        **document_arguments(document_ids, layout.row_offsets),
        **position_arguments(positions, layout.row_offsets),
        dropout_p=dropout_p, dropout_seed=dropout_seed, seq_len_q=q.shape[1],
        seq_len_kv=k.shape[1], group=heads_q // k.shape[2], **layout_arguments(layout, heads_q),
        qk_scale=softmax_scale * _env.LOG2_E, softmax_scale=softmax_scale,
        **mask_arguments(causal, window_size), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=_env.head_dim_pad(head_dim), Q_BLOCK=layout.q_block,
        KV_BLOCK=layout.kv_block, HAS_DROPOUT=dropout_p > 0,
        DOT_PRECISION=_env.dot_precision(q.dtype), TMA=tma,
    )  # fmt: skip


def _dkdv_tiles(
    layout: BlockLayout,
    q: torch.Tensor,
    heads_kv: int,
    tma: bool,
    query_rows: int | None,
    kv_rows: int | None,
) -> tuple[configs.RowTile, int, int, configs.Launch]:
    """Query tile, the steps it gathers (TOKENS: rows of one token fill a tile with several
    tokens, since the kv block's entries are tokens), key rows (BLOCK_N) and autotune Launch
    of a program over the transposed layout (None: the configs module's choice)."""
    padded = _env.head_dim_pad(q.shape[3])
    if kv_rows is None:
        kv_rows = configs.dkdv_kv_rows(padded, layout.kv_block)
    if query_rows is None:
        query_rows = configs.max_query_rows(padded, "dkdv")
    tile = packing(layout, query_rows, q.shape[2], heads_kv)
    tokens = max(1, query_rows // (tile.rows * tile.pack)) if layout.q_block == 1 else 1
    launch = configs.Launch(padded, tokens * tile.rows * tile.pack, q.element_size(), tma,
                            _env.shared_memory(q.device))  # fmt: skip
    return tile, tokens, kv_rows, launch


def _grad_q(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    layout: BlockLayout,
    shared: dict,
    query_masks: QueryMasks | None,
    tma: bool,
    query_rows: int | None,
    config: triton.Config | None,
) -> torch.Tensor:
    """dQ from the dQ kernel (which also fills shared["delta"]); shared: _shared_arguments."""
    heads_q, padded = q.shape[2], _env.head_dim_pad(q.shape[3])
    grad_q = torch.empty_like(q, memory_format=torch.contiguous_format)
    max_rows = configs.max_query_rows(padded, "dq") if query_rows is None else query_rows
    tile = packing(layout, max_rows, heads_q, k.shape[2])
    order = tile_order(layout, tile.rows)
    grid = (order.numel(), heads_q // tile.pack, q.shape[0])
    launch = configs.Launch(padded, tile.rows * tile.pack, q.element_size(), tma,
                            _env.shared_memory(q.device))  # fmt: skip
    kernel = _dq_kernel if config is not None else _tuned_dq(launch, layout.kv_block)
    with descriptor_scratch(q.device):
        kernel[grid](
            out=out, grad_q=grad_q, row_offsets=layout.row_offsets,
            col_indices=layout.col_indices, tile_order=order, **strides("out", out),
            **strides("grad_q", grad_q), stride_layout=layout.row_offsets.stride(0),
            **query_mask_arguments(query_masks, "csr", layout.row_offsets), ROWS=tile.rows,
            PACK=tile.pack, **shared, **config_arguments(config),
        )  # fmt: skip
    return grad_q


def grad_q_and_delta(
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
    query_masks: QueryMasks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dQ (like q) and delta = rowsum(dO * O) (fp32 [B, H_q, S_q]) from the dQ kernel alone,
    for a backend that computes dK and dV itself; arguments as in attention_backward (no
    dropout, no block positions)."""
    delta = torch.empty_like(lse)
    tma = resolve_tma(None, q, k, v, out, grad_out, kv_padding=0)
    shared = _shared_arguments(
        grad_out, q, k, v, lse, delta, layout, causal=causal, window_size=window_size,
        softmax_scale=softmax_scale, document_ids=document_ids, dropout_p=0.0, dropout_seed=0,
        positions=None, tma=tma,
    )  # fmt: skip
    grad_q = _grad_q(grad_out, q, k, out, lse, layout, shared, query_masks, tma, None, None)
    return grad_q, delta


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
    positions: BlockPositions | None = None,
    query_masks: QueryMasks | None = None,
    tma: bool | None = None,
    dq_query_rows: int | None = None,
    dkdv_query_rows: int | None = None,
    dkdv_kv_rows: int | None = None,
    dq_config: triton.Config | None = None,
    dkdv_config: triton.Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of validated, kernel-ready inputs (custom_op.py makes them so).

    Args:
        grad_out, q, k, v, out: as in attention_forward, unit stride along D.
        lse: fp32 [B, H_q, S_q] from the forward, contiguous.
        positions, tma: as in attention_forward.
        query_masks: per-token selections: dQ reads the CSR words, dK/dV the CSC ones.
        dq_query_rows, dkdv_query_rows: the most rows of a query tile of each kernel;
            dkdv_kv_rows: key rows of a dK/dV program (None: the configs module's choice).
        dq_config, dkdv_config: run these kernel configs instead of autotuning.

    Returns:
        (dq, dk, dv) shaped like q, k, v in their dtypes, contiguous.
    """
    batch, heads_kv = q.shape[0], k.shape[2]
    delta = torch.empty_like(lse)
    grad_k = torch.empty_like(k, memory_format=torch.contiguous_format)
    grad_v = torch.empty_like(v, memory_format=torch.contiguous_format)
    tma = resolve_tma(tma, q, k, v, out, grad_out,
                      kv_padding=padding_rows(positions, layout.kv_block))  # fmt: skip
    shared = _shared_arguments(
        grad_out, q, k, v, lse, delta, layout, causal=causal, window_size=window_size,
        softmax_scale=softmax_scale, document_ids=document_ids, dropout_p=dropout_p,
        dropout_seed=dropout_seed, positions=positions, tma=tma,
    )  # fmt: skip

    grad_q = _grad_q(grad_out, q, k, out, lse, layout, shared, query_masks, tma, dq_query_rows,
                     dq_config)  # fmt: skip

    transposed = layout.transpose()
    tile, tokens, kv_rows, launch = _dkdv_tiles(layout, q, heads_kv, tma, dkdv_query_rows,
                                               dkdv_kv_rows)  # fmt: skip
    grid = (triton.cdiv(k.shape[1], kv_rows), heads_kv, batch)
    kernel = _dkdv_kernel if dkdv_config is not None else _tuned_dkdv(launch, kv_rows)
    with descriptor_scratch(q.device):
        kernel[grid](
            grad_k=grad_k, grad_v=grad_v, row_offsets=transposed.row_offsets,
            row_indices=transposed.col_indices, **strides("grad_k", grad_k),
            **strides("grad_v", grad_v), stride_layout=transposed.row_offsets.stride(0),
            **query_mask_arguments(query_masks, "csc", layout.row_offsets), ROWS=tile.rows,
            PACK=tile.pack, BLOCK_N=kv_rows, TOKENS=tokens, **shared,
            **config_arguments(dkdv_config),
        )  # fmt: skip
    return grad_q, grad_k, grad_v
