"""Block-sparse attention forward: FlashAttention-2 over the active blocks of a BlockLayout.

One program owns a query tile of ROWS positions x PACK query heads (PACK > 1 packs the
heads of a GQA group that share a layout row, so each K/V tile is loaded once for all of
them) and walks that q block's CSR row: only active blocks cost work. Online softmax in
fp32 with exp2; element masks (causal, window, ragged kv end, documents, per-token query
masks) only on partial tiles. On Hopper, K/V tiles (and unpacked query tiles) load through
2-D tensor descriptors (TMA) built by each program; elsewhere through pointers. With block
positions, q holds blocks of a longer sequence and K/V a buffer of its blocks: masks and
dropout see the sequence's positions.
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
    LN_2,
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
    mask_arguments,
    packing,
    padding_rows,
    position_arguments,
    query_mask_arguments,
    query_program,
    resolve_tma,
    row_steps,
    store_rows,
    strides,
    tile_order,
    tile_source,
)


@triton.jit
def _forward_kernel(
    q, k, v, out, lse, row_offsets, col_indices, tile_order, documents, q_block_positions,
    kv_block_positions, query_masks,
    stride_q_b, stride_q_s, stride_q_h, stride_k_b, stride_k_s, stride_k_h,
    stride_v_b, stride_v_s, stride_v_h, stride_out_b, stride_out_s, stride_out_h,
    stride_lse_b, stride_lse_h, stride_documents_b, stride_layout,
    dropout_p, dropout_seed, seq_len_q, seq_len_kv, position_seq_len, group,
    layout_batch_stride, layout_head_divisor, qk_scale, window_left, window_right,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, Q_BLOCK: tl.constexpr,
    KV_BLOCK: tl.constexpr, ROWS: tl.constexpr, PACK: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_DOCUMENTS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, HAS_QUERY_MASKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid (num_q_blocks * Q_BLOCK // ROWS, H_q // PACK, B); tile_order maps program 0..
    to the query tile it runs (heavy rows first). qk_scale = softmax_scale * log2(e).
    TMA: K/V tiles (and unpacked Q tiles) load through tensor descriptors. HAS_POSITIONS:
    q_block_positions, kv_block_positions (int32) place q's blocks and k's slots in a
    sequence of position_seq_len tokens. HAS_QUERY_MASKS: query_masks (int64 [nnz], aligned
    with col_indices) keep, per block, the rows whose bit is set."""
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
    documents += batch * stride_documents_b
    query_documents = documents_of(documents, query_positions, query_end,
                                   HAS_DOCUMENTS)[:, None]  # fmt: skip
    k_source = tile_source(k + batch * stride_k_b, kv_head, stride_k_s, stride_k_h, seq_len_kv,
                           HEAD_DIM, BLOCK_N, HEAD_DIM_PAD, TMA)  # fmt: skip
    v_source = tile_source(v + batch * stride_v_b, kv_head, stride_v_s, stride_v_h, seq_len_kv,
                           HEAD_DIM, BLOCK_N, HEAD_DIM_PAD, TMA)  # fmt: skip

    # The group's heads in this tile share one layout row (PACK > 1 only if they do).
    layout = batch * layout_batch_stride + first_head // layout_head_divisor
    STEPS_PER_BLOCK: tl.constexpr = KV_BLOCK // BLOCK_N
    step_start, step_end = row_steps(
        row_offsets, layout, stride_layout, first_row // Q_BLOCK, STEPS_PER_BLOCK
    )

    row_max = tl.full([ROWS * PACK], float("-inf"), tl.float32)  # [BLOCK_M], log2 units
    row_sum = tl.zeros([ROWS * PACK], tl.float32)  # [BLOCK_M]
    acc = tl.zeros([ROWS * PACK, HEAD_DIM_PAD], tl.float32)  # [BLOCK_M, D_PAD]
    for step in range(step_start, step_end):
        k_tile, v_tile, key_positions, scores = kv_step(
            q_tile, k_source, v_source, col_indices, kv_block_positions, query_masks, step,
            kv_head, query_positions, query_first, query_last, query_documents, documents,
            stride_k_s, stride_k_h, stride_v_s, stride_v_h, key_end, qk_scale, window_left,
            window_right, STEPS_PER_BLOCK, Q_BLOCK, ROWS, KV_BLOCK, BLOCK_N, HEAD_DIM,
            HEAD_DIM_PAD, HAS_LEFT, HAS_RIGHT, HAS_DOCUMENTS, HAS_POSITIONS, HAS_QUERY_MASKS,
            DOT_PRECISION, TMA,
        )  # fmt: skip  # scores [BLOCK_M, BLOCK_N]
        new_max = tl.maximum(row_max, tl.max(scores, 1))  # [BLOCK_M]
        # A row with nothing visible yet keeps max -inf; shift it by 0 so exp2 gives 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # [BLOCK_M]
        probs = tl.math.exp2(scores - shift[:, None])  # [BLOCK_M, BLOCK_N]
        rescale = tl.math.exp2(row_max - shift)  # [BLOCK_M]
        row_sum = row_sum * rescale + tl.sum(probs, 1)  # [BLOCK_M]
        acc = acc * rescale[:, None]  # [BLOCK_M, D_PAD]
        if HAS_DROPOUT:  # the normaliser row_sum keeps every probability
            probs *= dropout_scale(
                dropout_seed, batch, heads[:, None], query_positions[:, None],
                key_positions[None, :], dropout_p,
            )  # fmt: skip
        acc = tl.dot(probs.to(v_tile.dtype), v_tile, acc, input_precision=DOT_PRECISION)
        row_max = new_max

    empty = row_sum == 0.0  # [BLOCK_M] rows that saw no key: out 0, lse -inf
    safe_sum = tl.where(empty, 1.0, row_sum)  # [BLOCK_M]
    acc = acc / safe_sum[:, None]  # [BLOCK_M, D_PAD]
    out_offsets = element_offsets(rows, heads, stride_out_s, stride_out_h)  # [BLOCK_M]
    store_rows(out + batch * stride_out_b, out_offsets, row_valid, acc, HEAD_DIM, HEAD_DIM_PAD)
    log_sum = tl.where(empty, float("-inf"), (row_max + tl.math.log2(safe_sum)) * LN_2)
    lse_offsets = heads.to(tl.int64) * stride_lse_h + rows  # [BLOCK_M]
    tl.store(lse + batch * stride_lse_b + lse_offsets, log_sum, mask=row_valid)


@functools.cache
def _tuned_forward(launch: configs.Launch, kv_block: int):
    choices = configs.forward_configs(launch, kv_block)
    return triton.autotune(configs=choices, key=AUTOTUNE_KEY)(_forward_kernel)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
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
    config: triton.Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of validated, kernel-ready inputs (custom_op.py makes them so).

    Args:
        q: [B, S_q, H_q, D]; k, v: [B, S_kv, H_kv, D], unit stride along D.
        layout: the active blocks, its tensors contiguous.
        document_ids: int32 [B, S] (S_q == S_kv): keys of another document are never seen.
        dropout_p, dropout_seed: probabilities dropped by Philox bits under the seed.
        positions: int32 BlockPositions of q's blocks and the K/V buffer's slots, or None.
        query_masks: per-token selections (their CSR words are read), or None.
        tma: load tiles through tensor descriptors (None: wherever the GPU and the strides
            allow it).
        query_rows: the most rows (positions x packed heads) of a query tile (None:
            configs.max_query_rows).
        config: run this kernel config (BLOCK_N, warps, stages) instead of autotuning.

    Returns:
        out like q (contiguous) and lse fp32 [B, H_q, S_q].
    """
    batch, seq_len_q, heads_q, head_dim = q.shape
    heads_kv = k.shape[2]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, heads_q, seq_len_q, dtype=torch.float32, device=q.device)
    padded = _env.head_dim_pad(head_dim)
    max_rows = configs.max_query_rows(padded, "forward") if query_rows is None else query_rows
    tile = packing(layout, max_rows, heads_q, heads_kv)
    order = tile_order(layout, tile.rows)
    grid = (order.numel(), heads_q // tile.pack, batch)
    tma = resolve_tma(tma, q, k, v, kv_padding=padding_rows(positions, layout.kv_block))
    launch = configs.Launch(padded, tile.rows * tile.pack, q.element_size(), tma,
                            _env.shared_memory(q.device))  # fmt: skip
    kernel = _forward_kernel if config is not None else _tuned_forward(launch, layout.kv_block)
    with descriptor_scratch(q.device):
        kernel[grid](
            q=q, k=k, v=v, out=out, lse=lse, row_offsets=layout.row_offsets,
            col_indices=layout.col_indices, tile_order=order,
            **strides("q", q), **strides("k", k), **strides("v", v), **strides("out", out),
            **strides("lse", lse, "bh"), stride_layout=layout.row_offsets.stride(0),
            **document_arguments(document_ids, layout.row_offsets),
            **position_arguments(positions, layout.row_offsets),
            **query_mask_arguments(query_masks, "csr", layout.row_offsets),
            dropout_p=dropout_p, dropout_seed=dropout_seed, seq_len_q=seq_len_q,
            seq_len_kv=k.shape[1], group=heads_q // heads_kv, **layout_arguments(layout, heads_q),
            qk_scale=softmax_scale * _env.LOG2_E, **mask_arguments(causal, window_size),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=padded, Q_BLOCK=layout.q_block,
            KV_BLOCK=layout.kv_block, ROWS=tile.rows, PACK=tile.pack,
            HAS_DROPOUT=dropout_p > 0, DOT_PRECISION=_env.dot_precision(q.dtype),
            TMA=tma, **config_arguments(config),
        )  # fmt: skip
    return out, lse
