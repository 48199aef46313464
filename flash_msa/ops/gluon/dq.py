"""dQ of the block-sparse attention backward for Hopper (sm_90) in Gluon, over the CSR rows.

One program owns a query tile of 128 rows (one query block of one head, or 128 / PACK
positions x PACK query heads of a GQA group, as the forward's tiles) and walks its layout
row; the tiles launch heaviest first. Three partitions share the program:

- a producer warp issues TMA loads: the two 64-row halves of Q and dO once, then the K and
  V tiles of each active block into a NUM_STAGES-deep ring ("ready" and "empty" mbarriers
  per slot);
- two consumer warpgroups, one per query half, run per block S = Q K^T and dP = dO V^T as
  async warpgroup MMAs, P = exp2(S * scale - lse), dS = P (dP - delta), and dQ += dS K
  with dS from shared memory, dQ [64, D] in fp32 registers for the tile's life; a block's
  dS K runs beside the next block's exponentials (issued between its S and its dP).

Every element of dQ is written once, by its tile: bitwise reproducible. Masks as in the
forward (forward.Masks: key bounds per row, per-token query masks).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flash_msa import _env
from flash_msa.layout import BlockLayout
from flash_msa.ops.gluon.forward import (
    BLOCK_M,
    BLOCK_N,
    CONSUMER_REGISTERS,
    CONSUMER_WARPS,
    HALF_ROWS,
    LOWER,
    MAX_REGISTERS,
    PRODUCER_REGISTERS,
    PRODUCER_WARPS,
    UPPER,
    _descriptor,
    _mask_rows,
    _mask_scores,
    _masks,
    _partial,
    _query_word,
    _tile,
    _visible_keys,
    copy_half,
    document_bounds,
    half_descriptor,
    half_layout,
    kernel_masks,
    load_blocks,
    mma_layout,
    slot_barriers,
    store_half,
)
from flash_msa.ops.registry import QueryMasks
from flash_msa.ops.triton.common import layout_arguments

LOG2_E: gl.constexpr = gl.constexpr(_env.LOG2_E)


@gluon.jit
def query_rows(values, row_offset, query_first, seq_len_q, ROWS: gl.constexpr, other,
               LSE: gl.constexpr, layout: gl.constexpr, PACK: gl.constexpr):  # fmt: skip
    """The ROWS rows' values [ROWS] in `layout` (`other` past S_q) of [B, H_q, S_q] values
    from row_offset (the first head's row); row r is position query_first + r // PACK of
    head r % PACK. LSE: the lse in log2 units, +inf for rows that see no key, so that their
    P is 0 (as past S_q, other=inf)."""
    slots = gl.arange(0, ROWS, layout=layout)
    queries = query_first + slots // PACK
    offsets = row_offset + (slots % PACK) * seq_len_q + queries
    rows = gl.load(values + offsets, mask=queries < seq_len_q, other=other)
    if LSE:
        rows = gl.where(rows == float("-inf"), float("inf"), rows * LOG2_E)
    return rows


@gluon.jit
def _producer(loads, PACK: gl.constexpr):
    """One warp: both halves of Q and dO of the program's tile (one barrier a half), then K
    and V of each active block of its row into the ring (a slot is refilled once both
    consumers released it)."""
    (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_ready, k_ready,
     k_empty, v_ready, v_empty, col_indices, tiles) = loads  # fmt: skip
    HALF: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    start, end, q_row, q_col, kv_row, kv_col, _, query_first, batch = _tile(
        gl.program_id(0), tiles, 2 * HALF, HEAD_DIM, PACK
    )
    if end > start:
        for half in gl.static_range(2):
            bar = q_ready.index(half)
            row = q_row + half * HALF
            first = query_first + half * (HALF // PACK)
            mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            copy_half(q_desc, q_smem.index(half), bar, row, q_col, batch, first, PACK)
            copy_half(do_desc, do_smem.index(half), bar, row, q_col, batch, first, PACK)
        ring = (k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty)
        load_blocks(ring, col_indices, start, end, kv_row, kv_col, gl.to_tensor(0))


@gluon.jit
def _block(
    q, do, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, ds_smem, step, dq, row_lse,
    row_delta, qk_scale, row_blocks, visible, words, MASKS: gl.constexpr, PACK: gl.constexpr,
    WITH_DQ: gl.constexpr,
):  # fmt: skip
    """Block `step` of the row (row_blocks: its kv block indices; visible, words: see
    forward._visible_keys and _query_word): S = Q K^T, then (WITH_DQ) the block before's
    dQ += dS K (its dS in ds_smem [HALF_M, BLOCK_N]), then dP = dO V^T, all async; P =
    exp2(S * scale - lse) while the other two run, dS = P (dP - delta) into ds_smem.
    Returns dQ; the block's V slot and the block before's K slot are released. dS goes
    through shared memory: as a register A operand it holds 32 more registers across the
    MMAs, and ptxas serialises them (C7512, too few registers)."""
    NUM_STAGES: gl.constexpr = k_smem.type.shape[0]
    ROWS: gl.constexpr = q.type.shape[0]
    KV_ROWS: gl.constexpr = k_smem.type.shape[1]
    dtype: gl.constexpr = q.dtype
    s_layout: gl.constexpr = mma_layout(KV_ROWS, dtype)  # [HALF_M, BLOCK_N] accumulators
    stage = step % NUM_STAGES
    phase = (step // NUM_STAGES) & 1
    before = (step + NUM_STAGES - 1) % NUM_STAGES
    if MASKS.scores:  # the load's latency hides behind the waits for K and S
        key_first = gl.load(row_blocks + step) * KV_ROWS
        partial = _partial(key_first, visible, KV_ROWS, MASKS)
    if MASKS.query:
        word, partial = _query_word(words, step, partial, ROWS, PACK)
    mbarrier.wait(k_ready.index(stage), phase)
    s = gl.zeros([ROWS, KV_ROWS], gl.float32, s_layout)
    s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s, use_acc=False, is_async=True)
    if WITH_DQ:
        dq = warpgroup_mma(ds_smem, k_smem.index(before), dq, is_async=True)  # [HALF_M, D]
    mbarrier.wait(v_ready.index(stage), phase)
    dp = gl.zeros([ROWS, KV_ROWS], gl.float32, s_layout)
    dp = warpgroup_mma(do, v_smem.index(stage).permute((1, 0)), dp, use_acc=False,
                       is_async=True)  # fmt: skip
    if WITH_DQ:
        s = warpgroup_mma_wait(2, deps=(s,))  # S done; dS K and dP may still run
    else:
        s = warpgroup_mma_wait(1, deps=(s,))
    if MASKS.scores:
        s = _mask_scores(s, partial, key_first, visible, 1, MASKS)
    if MASKS.query:
        s = _mask_rows(s, partial, word, words, PACK)
    p = gl.exp2(s * qk_scale - gl.expand_dims(row_lse, 1))  # [HALF_M, BLOCK_N]
    # The block's V barrier once more (complete: it passes at once): its spin loop ends a
    # basic block, which keeps ptxas from hoisting the MMA wait above the exponentials.
    mbarrier.wait(v_ready.index(stage), phase)
    if WITH_DQ:
        dp, dq = warpgroup_mma_wait(0, deps=(dp, dq))
        mbarrier.arrive(k_empty.index(before))
    else:
        dp = warpgroup_mma_wait(0, deps=(dp,))
    mbarrier.arrive(v_empty.index(stage))
    ds = p * (dp - gl.expand_dims(row_delta, 1))  # [HALF_M, BLOCK_N]
    ds_smem.store(ds.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    return dq


@gluon.jit
def _consumer(shared, HALF: gl.constexpr, MASKS: gl.constexpr, PACK: gl.constexpr):
    """One warpgroup: rows HALF * 64 .. HALF * 64 + 63 of the program's tile; their dQ
    (times softmax_scale) leaves through the half's Q tile by TMA (see dq_kernel)."""
    (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_desc, q_ready, k_ready, k_empty, v_ready,
     v_empty, lse, delta, col_indices, query_masks, tiles, qk_scale, softmax_scale, bounds,
     tail) = shared  # fmt: skip
    ROWS: gl.constexpr = q_smem.type.shape[1]
    TOKENS: gl.constexpr = ROWS // PACK  # positions of the half's rows
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    KV_ROWS: gl.constexpr = k_smem.type.shape[1]
    NUM_STAGES: gl.constexpr = k_smem.type.shape[0]
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = mma_layout(KV_ROWS, dtype)  # [HALF_M, BLOCK_N] accumulators
    dq_layout: gl.constexpr = mma_layout(HEAD_DIM, dtype)  # [HALF_M, D] accumulators
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    q = q_smem.index(HALF)  # [HALF_M, D]
    do = do_smem.index(HALF)  # [HALF_M, D]
    seq_len_kv, window_left, window_right, document_first, document_last = bounds
    out, seq_len_q, row_stride = tail
    start, end, q_row, q_col, _, _, lse_offset, query_first, batch = _tile(
        gl.program_id(0), tiles, 2 * ROWS, HEAD_DIM, PACK
    )
    row_offset = lse_offset - query_first  # the first head's row of [B, H_q, S_q]
    query_first = query_first + HALF * TOKENS
    row_lse = query_rows(lse, row_offset, query_first, seq_len_q, ROWS, float("inf"), True,
                         rows, PACK)  # fmt: skip  # [HALF_M]
    row_delta = query_rows(delta, row_offset, query_first, seq_len_q, ROWS, 0.0, False, rows,
                           PACK)  # fmt: skip  # [HALF_M]
    visible = None
    if MASKS.scores:
        documents = batch * seq_len_kv
        tile_bounds = (seq_len_kv, window_left, window_right, document_first + documents,
                       document_last + documents)  # fmt: skip
        visible = _visible_keys(query_first, tile_bounds, ROWS, rows, MASKS, PACK)
    words = None
    if MASKS.query:
        words = (query_masks + start, HALF * TOKENS)
    dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, dq_layout)  # [HALF_M, D]
    if end > start:
        mbarrier.wait(q_ready.index(HALF), 0)
        ds = ds_smem.index(HALF)  # [HALF_M, BLOCK_N]
        blocks = (q, do, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, ds)
        # Block 0: S, dP and dS; each block's dS K runs beside the next block's softmax.
        dq = _block(*blocks, 0, dq, row_lse, row_delta, qk_scale, col_indices + start,
                    visible, words, MASKS, PACK, False)  # fmt: skip
        for step in range(1, end - start):
            dq = _block(*blocks, step, dq, row_lse, row_delta, qk_scale, col_indices + start,
                        visible, words, MASKS, PACK, True)  # fmt: skip
        last = (end - start - 1) % NUM_STAGES
        dq = warpgroup_mma(ds, k_smem.index(last), dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq,))
        mbarrier.arrive(k_empty.index(last))
    # The half's Q tile is no longer read: it holds dQ on its way out.
    q.store((dq * softmax_scale).to(dtype))
    store_half(dq_desc, q, out, q_row + HALF * ROWS, q_col, batch, query_first, seq_len_q,
               row_stride, MASKS, PACK)  # fmt: skip
    tma.store_wait(0)


@gluon.jit
def dq_kernel(
    q_desc, do_desc, k_desc, v_desc, dq_desc, lse, delta, row_order, row_offsets,
    col_indices, query_masks, seq_len_q, seq_len_kv, heads_q, group, stride_layout,
    layout_batch_stride, layout_head_divisor, qk_scale, softmax_scale, grad_q,
    document_first, document_last, window_left, window_right, NUM_STAGES: gl.constexpr,
    HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr, HAS_DOCUMENTS: gl.constexpr,
    KV_TAIL: gl.constexpr, Q_TAIL: gl.constexpr, HAS_QUERY_MASKS: gl.constexpr,
    PACK: gl.constexpr,
):  # fmt: skip
    """Grid (ceil(S_q / q_block) x B x H_q / PACK,): program p runs tile p of the forward's
    order (_tile; row_order: the query blocks heaviest first). q_desc, do_desc, dq_desc:
    PACK 1, 2-D views [B * S_q, H_q * D] in blocks [64, D]; PACK > 1, the 4-D tensors
    [B, S_q, H_q, D] in boxes [1, 64 / PACK, PACK, D] (dq_desc: grad_q's). k_desc / v_desc:
    [B * S_kv, H_kv * D] in blocks [128, D]. lse (natural log), delta = rowsum(dO * O):
    fp32 [B, H_q, S_q]. Masks and query_masks as in the forward kernel."""
    HALF: gl.constexpr = HALF_ROWS
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    KV_ROWS: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = k_desc.dtype
    MASKS: gl.constexpr = _masks(HAS_LEFT, HAS_RIGHT, HAS_DOCUMENTS, KV_TAIL, Q_TAIL,
                                 HAS_QUERY_MASKS)  # fmt: skip
    Q_BLOCK: gl.constexpr = 2 * HALF // PACK
    num_q_blocks = (seq_len_q + Q_BLOCK - 1) // Q_BLOCK

    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], half_layout(HEAD_DIM, dtype))
    do_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], half_layout(HEAD_DIM, dtype))
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, KV_ROWS, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, KV_ROWS, HEAD_DIM], v_desc.layout)
    # dS of each consumer [warpgroup, 64 queries, 128 keys] (32 KB), dQ's A operand
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF, KV_ROWS], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, HALF, KV_ROWS], ds_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
    k_ready, k_empty = slot_barriers(NUM_STAGES, 2)  # one arrival per consumer warpgroup
    v_ready, v_empty = slot_barriers(NUM_STAGES, 2)
    fence_async_shared()

    tiles = (row_order, row_offsets, stride_layout, layout_batch_stride, layout_head_divisor,
             heads_q, group, seq_len_q, seq_len_kv, num_q_blocks)  # fmt: skip
    bounds = (seq_len_kv, window_left, window_right, document_first, document_last)
    tail = (grad_q, seq_len_q, heads_q * HEAD_DIM)
    shared = (q_smem, do_smem, k_smem, v_smem, ds_smem, dq_desc, q_ready, k_ready, k_empty, v_ready,
              v_empty, lse, delta, col_indices, query_masks, tiles, qk_scale, softmax_scale,
              bounds, tail)  # fmt: skip
    loads = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_ready,
             k_ready, k_empty, v_ready, v_empty, col_indices, tiles)  # fmt: skip
    gl.warp_specialize(
        [(_consumer, (shared, UPPER, MASKS, PACK)), (_consumer, (shared, LOWER, MASKS, PACK)),
         (_producer, (loads, PACK))],
        [CONSUMER_WARPS, PRODUCER_WARPS],
        [CONSUMER_REGISTERS, PRODUCER_REGISTERS],
    )  # fmt: skip


def grad_q(
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
    document_ids: torch.Tensor | None = None,
    query_masks: QueryMasks | None = None,
    num_stages: int = 2,
) -> torch.Tensor:
    """dQ like q (contiguous, q's dtype) on kernel-ready inputs with rows contiguous
    (backward.attention_backward makes them so): lse from the forward and delta =
    rowsum(dO * O), fp32 [B, H_q, S_q]; the other arguments as in
    backward.attention_backward (query_masks: the CSR words are read)."""
    batch, seq_len_q, heads_q, head_dim = q.shape
    seq_len_kv, heads_kv = k.shape[1], k.shape[2]
    pack = BLOCK_M // layout.q_block
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    masks, window_left, window_right = kernel_masks(
        causal, window_size, document_ids is not None, seq_len_q, seq_len_kv, layout.q_block
    )
    document_first, document_last = (
        (lse, lse) if document_ids is None else document_bounds(document_ids)
    )  # lse stands in (never read) without documents
    q_desc, do_desc, dq_desc = (half_descriptor(t, pack) for t in (q, grad_out, dq))
    tiles = -(-seq_len_q // layout.q_block) * (heads_q // pack) * batch
    dq_kernel[(tiles,)](
        q_desc=q_desc, do_desc=do_desc, k_desc=_descriptor(k, BLOCK_N),
        v_desc=_descriptor(v, BLOCK_N), dq_desc=dq_desc, lse=lse, delta=delta,
        row_order=layout.heavy_rows_first(), row_offsets=layout.row_offsets,
        col_indices=layout.col_indices,
        # col_indices stands in (never read) without query masks
        query_masks=layout.col_indices if query_masks is None else query_masks.csr,
        seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, heads_q=heads_q, group=heads_q // heads_kv,
        stride_layout=layout.row_offsets.stride(0), **layout_arguments(layout, heads_q),
        qk_scale=softmax_scale * _env.LOG2_E, softmax_scale=softmax_scale, grad_q=dq,
        document_first=document_first, document_last=document_last, window_left=window_left,
        window_right=window_right, NUM_STAGES=num_stages, **masks.constexprs(),
        HAS_QUERY_MASKS=query_masks is not None, PACK=pack, num_warps=4,
        maxnreg=MAX_REGISTERS,
    )  # fmt: skip
    return dq
