"""Block-sparse attention backward for Hopper (sm_90) in Gluon, over the transposed layout.

One program owns a kv tile of 128 keys of one (batch, kv head) and walks that tile's column
of the layout (layout.transpose()), for every query head of its GQA group: only the active
(query block, kv block) pairs cost work. Four partitions share the program:

- a producer warp issues TMA loads: the K and V tiles once, then, for each active query
  block, its two 64-row halves of Q and dO into a NUM_STAGES-deep shared-memory ring
  (a "ready" and an "empty" mbarrier per slot, Q and dO apart);
- two consumer warpgroups, each owning 64 of the 128 keys, run per query half
  S = Q K^T and dP = dO V^T (async warpgroup MMAs, both issued before the softmax),
  P = exp2(S * scale - lse), dS = P (dP - delta), then dV += P^T dO and dK += dS^T Q
  with P and dS from shared memory, accumulating dK and dV [64, D] in fp32 registers for
  the program's life (queries on the MMAs' M keep lse and delta at two registers a thread);
- a dQ writer warp, which works only when dQ is computed here.

dQ comes one of four ways (attention_backward's grad_q):
- "triton": dK and dV only (four matmuls); dQ comes from the Triton dQ kernel, which walks
  the CSR rows (three more matmuls) and writes every element once: deterministic;
- "gluon": the same with dQ from the Gluon dQ kernel (dq.py), also over the CSR rows and
  deterministic;
- "atomic": five matmuls. The consumers exchange their dS halves through shared memory
  and each computes half of dQ's columns over all 128 keys, dS K[:, half], into a shared
  fp32 tile that the writer adds to an fp32 dQ buffer with a TMA reduce-add: not bitwise
  reproducible (the order of the adds across programs varies);
- "ordered": the same, with the writer adding into each query half in a fixed order of kv
  blocks (counters in global memory; see _dq_writer): bitwise reproducible.

Element masks are the forward's (forward.Masks: key bounds per query row, per-token query
masks from the words in the transposed layout's order). Rows past S_q read lse +inf (P =
0); keys past S_kv are masked, and their dK / dV rows are not stored.

kv_block 128, q_block one of forward.QUERY_BLOCKS: below 128 a query block's 128 rows are
128 / q_block positions x 128 / q_block query heads of the group (as the forward's tiles),
walked PACK heads at a time, and dQ takes "triton" or "gluon"; D in {64, 128}, fp16 or
bf16.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flash_msa import _env
from flash_msa.layout import BlockLayout
from flash_msa.ops.gluon import dq as gluon_dq
from flash_msa.ops.gluon.dq import query_rows
from flash_msa.ops.gluon.forward import (
    BLOCK_M,
    CONSUMER_REGISTERS,
    CONSUMER_WARPS,
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
    _rows_contiguous,
    _store_rows,
    _store_tile,
    _visible_keys,
    copy_half,
    document_bounds,
    half_coordinates,
    half_descriptor,
    half_layout,
    half_tile,
    head_column,
    kernel_masks,
    mma_layout,
    slot_barriers,
)
from flash_msa.ops.gluon.walk import aligned_shift, walk_alignment, wrapped
from flash_msa.ops.registry import QueryMasks
from flash_msa.ops.triton.backward import grad_q_and_delta
from flash_msa.ops.triton.common import layout_arguments

BLOCK_N = 128  # keys of one program (one layout block)
HALF_N = 64  # keys of one consumer warpgroup
QUERY_ROWS = 64  # query rows of one step (half a layout block)
QUERY_ROWS_CONSTEXPR: gl.constexpr = gl.constexpr(QUERY_ROWS)
LOG2_E: gl.constexpr = gl.constexpr(_env.LOG2_E)


@gluon.jit
def _column(walk, member, MODE: gl.constexpr, PACK: gl.constexpr):
    """The first query head of the program's GQA group's member-th PACK heads; [start, end)
    of the transposed layout's entries (query blocks) of the program's kv block for those
    heads (PACK heads share a layout row); and the entries the walk skips before its first
    (walk.aligned_shift over MODE.align; walk.wrapped turns a step into its half block)."""
    (t_row_offsets, t_col_indices, batch, kv_head, kv_block, group, seq_len_q, seq_len_kv,
     stride_layout, layout_batch_stride, layout_head_divisor) = walk  # fmt: skip
    head = kv_head * group + member * PACK
    layout_row = batch * layout_batch_stride + head // layout_head_divisor
    row = t_row_offsets + layout_row * stride_layout
    start = gl.load(row + kv_block)
    end = gl.load(row + kv_block + 1)
    shift = aligned_shift(t_col_indices, start, end, kv_block, MODE.align,
                          2 * QUERY_ROWS_CONSTEXPR // PACK)  # fmt: skip
    return head, start, end, shift


@gluon.jit
def _query_first(t_col_indices, half_block, TOKENS: gl.constexpr):
    """The first query position of step `half_block` of a column: half half_block % 2 (TOKENS
    positions) of the query block of entry half_block // 2."""
    return gl.load(t_col_indices + half_block // 2) * (2 * TOKENS) + (half_block % 2) * TOKENS


@gluon.jit
def _reads(query_masks, half_block, MASKS: gl.constexpr, TOKENS: gl.constexpr):
    """Whether step `half_block` of a column has work: always without query masks; with
    them, where one of its TOKENS positions reads the kv block (a bit of the entry's word
    from bit (half_block % 2) * TOKENS). Every partition skips the same steps. Query masks
    hold at most 64 positions a block, so they come with packed heads, which the ordered
    mode does not take (attention_backward refuses it): no ordered walk skips a turn."""
    reads = True
    if MASKS.query:
        ALL: gl.constexpr = (1 << TOKENS) - 1
        word = gl.load(query_masks + half_block // 2)
        reads = ((word >> ((half_block % 2) * TOKENS)) & ALL) != 0
    return reads


@gluon.jit
def _producer(loads, MODE: gl.constexpr, MASKS: gl.constexpr, PACK: gl.constexpr):
    """One warp: K and V once, then both halves of Q and dO of each query block of the
    column (those with work: _reads), PACK heads after PACK heads of the group, into the
    ring, in the order of the column's aligned walk (_column, walk.py)."""
    (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready, q_ready,
     q_empty, do_ready, do_empty, walk, query_masks) = loads  # fmt: skip
    (t_row_offsets, t_col_indices, batch, kv_head, kv_block, group, seq_len_q, seq_len_kv,
     stride_layout, layout_batch_stride, layout_head_divisor) = walk  # fmt: skip
    ROWS: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    KV_ROWS: gl.constexpr = k_desc.block_type.shape[0]
    NUM_STAGES: gl.constexpr = q_smem.type.shape[0]
    kv_row = batch * seq_len_kv + kv_block * KV_ROWS
    mbarrier.expect(kv_ready.index(0), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kv_row, kv_head * HEAD_DIM], kv_ready.index(0),
                                    k_smem)  # fmt: skip
    mbarrier.expect(kv_ready.index(1), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [kv_row, kv_head * HEAD_DIM], kv_ready.index(1),
                                    v_smem)  # fmt: skip
    step = 0
    for member in range(group // PACK):
        head, start, end, shift = _column(walk, member, MODE, PACK)
        # Two steps per entry: its query block's halves of ROWS rows (ROWS / PACK positions).
        for index in range(2 * start, 2 * end):
            half_block = wrapped(index, 2 * end, 2 * (end - start), 2 * shift)
            if _reads(query_masks, half_block, MASKS, ROWS // PACK):
                query_first = _query_first(t_col_indices, half_block, ROWS // PACK)
                stage = step % NUM_STAGES
                phase = (step // NUM_STAGES) & 1
                # A fresh barrier counts as having completed the phase before 0.
                mbarrier.wait(q_empty.index(stage), phase ^ 1)
                _load_half(q_desc, q_smem.index(stage), q_ready.index(stage), batch, seq_len_q,
                           query_first, head, PACK)  # fmt: skip
                mbarrier.wait(do_empty.index(stage), phase ^ 1)
                _load_half(do_desc, do_smem.index(stage), do_ready.index(stage), batch, seq_len_q,
                           query_first, head, PACK)  # fmt: skip
                step += 1


@gluon.jit
def _load_half(desc, half, ready, batch, seq_len_q, query_first, head, PACK: gl.constexpr):
    """A TMA load of the query half [ROWS, D] from position query_first of the PACK heads
    from `head` (see forward.copy_half), completing `ready`."""
    HEAD_DIM: gl.constexpr = half.type.shape[1]
    mbarrier.expect(ready, desc.block_type.nbytes)
    copy_half(desc, half, ready, batch * seq_len_q + query_first,
              head_column(head, HEAD_DIM, PACK), batch, query_first, PACK)  # fmt: skip


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add the shared-memory tile src to tensor_desc's block at coord with a TMA reduce
    (cp.reduce.async.bulk.tensor .add; rows past the tensor's end are dropped); it completes
    like a TMA store (tma.store_wait). The Gluon of this Triton has the op, not the call."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
    )


class Mode(NamedTuple):
    fused: bool  # dQ in the kernel, beside dK and dV
    ordered: bool  # its adds in kv order (bitwise reproducible)
    align: int  # positions the columns' walks align their starts to (0: none; _column)


@gluon.constexpr_function
def _mode(fused, ordered, align):
    return Mode(fused, ordered, align)


@gluon.jit
def _ptx(value, INSTRUCTIONS: gl.constexpr):
    """Run the PTX INSTRUCTIONS in every thread, in order with the code around them; value:
    an i32 the asm passes through (inline asm must have an operand and a result)."""
    return gl.inline_asm_elementwise(INSTRUCTIONS + " mov.b32 $0, $1;", "=r,r", [value],
                                     dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _dq_writer(writes, MODE: gl.constexpr, MASKS: gl.constexpr, PACK: gl.constexpr):
    """One warp (with MODE.fused; else none of its work): each step, the consumers' dQ tiles
    [QUERY_ROWS, D / 2] fp32 (one each) added into dQ with TMA reduce-adds, then their slots
    freed; PACK > 1, a tile's rows are QUERY_ROWS / PACK positions x PACK heads, added as a
    box [1, positions, PACK, D / 2] of the 4-D view. MODE.ordered (PACK 1): the adds into a
    query half come in the order of its kv blocks, the highest first, so dQ is bitwise
    reproducible: an i32 counter per (batch, query head, query half) counts the kv blocks
    added so far, and the kv block of entry e of the column waits for it to reach turns[e]
    (entry_turns), adds, waits for its adds to complete and counts itself. The programs run
    highest kv block first, so a program waits only on ones started before it (no deadlock),
    and under a causal or banded layout the kv block c + 1 reaches a query block one step
    before c does: in step, the waits are short."""
    if MODE.fused:
        (dq_desc, dq_smem, dq_full, dq_empty, walk, heads_q, counters, halves, turns,
         query_masks) = writes
        (t_row_offsets, t_col_indices, batch, kv_head, kv_block, group, seq_len_q, seq_len_kv,
         stride_layout, layout_batch_stride, layout_head_divisor) = walk  # fmt: skip
        ROWS: gl.constexpr = dq_smem.type.shape[1]
        HALF_D: gl.constexpr = dq_smem.type.shape[2]
        step = 0
        for member in range(group // PACK):
            head, start, end, shift = _column(walk, member, MODE, PACK)
            for index in range(2 * start, 2 * end):
                half_block = wrapped(index, 2 * end, 2 * (end - start), 2 * shift)
                if _reads(query_masks, half_block, MASKS, ROWS // PACK):
                    query_first = _query_first(t_col_indices, half_block, ROWS // PACK)
                    if MODE.ordered:
                        counter = (counters + (batch * heads_q + head).to(gl.int64) * halves
                                   + query_first // ROWS)  # fmt: skip
                        turn = gl.load(turns + half_block // 2)
                        seen = gl.load(counter, volatile=True)
                        while seen != turn:
                            seen = gl.load(counter, volatile=True)
                        # Acquire: the earlier kv blocks' adds are seen, by the TMA unit too.
                        _ptx(turn, "fence.acq_rel.gpu; fence.proxy.async.global;")
                    for half in gl.static_range(2):
                        mbarrier.wait(dq_full.index(half), step & 1)
                        # PACK > 1: positions from S_q on are dropped
                        coordinates = half_coordinates(
                            batch * seq_len_q + query_first, head_column(head, 2 * HALF_D, PACK),
                            batch, query_first, half * HALF_D, PACK,
                        )  # fmt: skip
                        _tma_reduce_add(dq_desc, coordinates,
                                        half_tile(dq_desc, dq_smem.index(half), PACK))  # fmt: skip
                    if MODE.ordered:
                        # Release once the adds are complete (not only read from shared memory).
                        _ptx(turn, "cp.async.bulk.wait_group 0; fence.proxy.async.global; "
                                   "fence.acq_rel.gpu;")  # fmt: skip
                        gl.thread_barrier()
                        gl.store(counter, turn + 1)
                    else:
                        tma.store_wait(0)
                    for half in gl.static_range(2):
                        mbarrier.arrive(dq_empty.index(half))
                    step += 1


@gluon.jit
def _consumer(shared, HALF: gl.constexpr, MODE: gl.constexpr, MASKS: gl.constexpr,
              PACK: gl.constexpr):  # fmt: skip
    """One warpgroup: keys HALF * 64 .. HALF * 64 + 63 of the program's kv tile; dK and dV
    of those keys, and with MODE.fused their share of dQ. A step's 64 rows are 64 / PACK
    positions x PACK query heads (row r: position r // PACK, head r % PACK)."""
    (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, ds_ready, dq_smem, dq_full, dq_empty,
     dk_desc, dv_desc, kv_ready, q_ready, q_empty, do_ready, do_empty, lse, delta, walk,
     heads_q, qk_scale, softmax_scale, bounds, tail, query_masks) = shared  # fmt: skip
    (t_row_offsets, t_col_indices, batch, kv_head, kv_block, group, seq_len_q, seq_len_kv,
     stride_layout, layout_batch_stride, layout_head_divisor) = walk  # fmt: skip
    ROWS: gl.constexpr = q_smem.type.shape[1]
    TOKENS: gl.constexpr = ROWS // PACK  # positions of a step's rows
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    NUM_STAGES: gl.constexpr = q_smem.type.shape[0]
    KEYS: gl.constexpr = k_smem.type.shape[0] // 2
    HALF_D: gl.constexpr = HEAD_DIM // 2  # dQ columns of one warpgroup
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = mma_layout(KEYS, dtype)  # [QUERY_ROWS, KEYS] accumulators
    o_layout: gl.constexpr = mma_layout(HEAD_DIM, dtype)  # [KEYS, D] accumulators
    dq_layout: gl.constexpr = mma_layout(HALF_D, dtype)  # [QUERY_ROWS, D / 2] accumulators
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    k_mine = k_smem.slice(HALF * KEYS, KEYS)  # [KEYS, D]
    v_mine = v_smem.slice(HALF * KEYS, KEYS)  # [KEYS, D]
    p_mine = p_smem.index(HALF)  # [QUERY_ROWS, KEYS]
    # dQ's columns HALF * D / 2 .. of the tile's keys: K [2 * KEYS, D / 2] in two halves.
    k_upper = k_smem.slice(0, KEYS).slice(HALF * HALF_D, HALF_D, dim=1)
    k_lower = k_smem.slice(KEYS, KEYS).slice(HALF * HALF_D, HALF_D, dim=1)
    key_first = kv_block * (2 * KEYS) + HALF * KEYS

    mbarrier.wait(kv_ready.index(0), 0)
    mbarrier.wait(kv_ready.index(1), 0)
    dk = gl.zeros([KEYS, HEAD_DIM], gl.float32, o_layout)  # [KEYS, D]
    dv = gl.zeros([KEYS, HEAD_DIM], gl.float32, o_layout)  # [KEYS, D]
    step = 0
    for member in range(group // PACK):
        head, start, end, shift = _column(walk, member, MODE, PACK)
        row_offset = (batch * heads_q + head).to(gl.int64) * seq_len_q
        for index in range(2 * start, 2 * end):
            half_block = wrapped(index, 2 * end, 2 * (end - start), 2 * shift)
            if _reads(query_masks, half_block, MASKS, TOKENS):
                query_first = _query_first(t_col_indices, half_block, TOKENS)
                stage = step % NUM_STAGES
                phase = (step // NUM_STAGES) & 1
                buffer = step % 2
                q_tile = q_smem.index(stage)  # [QUERY_ROWS, D]
                do_tile = do_smem.index(stage)  # [QUERY_ROWS, D]
                mbarrier.wait(q_ready.index(stage), phase)
                s = gl.zeros([ROWS, KEYS], gl.float32, s_layout)
                s = warpgroup_mma(q_tile, k_mine.permute((1, 0)), s, use_acc=False,
                                  is_async=True)  # fmt: skip  # [QUERY_ROWS, KEYS]
                mbarrier.wait(do_ready.index(stage), phase)
                dp = gl.zeros([ROWS, KEYS], gl.float32, s_layout)
                dp = warpgroup_mma(do_tile, v_mine.permute((1, 0)), dp, use_acc=False,
                                   is_async=True)  # fmt: skip  # [QUERY_ROWS, KEYS]
                row_lse = query_rows(lse, row_offset, query_first, seq_len_q, ROWS, float("inf"),
                                      True, rows, PACK)  # fmt: skip  # [QUERY_ROWS]
                row_delta = query_rows(delta, row_offset, query_first, seq_len_q, ROWS, 0.0,
                                        False, rows, PACK)  # fmt: skip  # [QUERY_ROWS]
                if MASKS.scores:
                    visible = _visible_keys(query_first, bounds, ROWS, rows, MASKS, PACK)
                    partial = _partial(key_first, visible, KEYS, MASKS)
                if MASKS.query:  # the entry's word; bit t: position t of its query block
                    words = (query_masks, (half_block % 2) * TOKENS)
                    word, partial = _query_word(words, half_block // 2, partial, ROWS, PACK)
                s = warpgroup_mma_wait(1, deps=(s,))
                if MASKS.scores:
                    # key_first through an empty asm: the block's key positions are then built
                    # in the masked path instead of hoisted out of the loop, where they held
                    # registers across it and were spilled (SASS: 17 local loads a step at 8 x 16
                    # with causal and query masks, 2 through the asm).
                    s = _mask_scores(s, partial, _ptx(key_first, ""), visible, 1, MASKS)
                if MASKS.query:
                    s = _mask_rows(s, partial, word, words, PACK)
                p = gl.exp2(s * qk_scale - gl.expand_dims(row_lse, 1))  # [QUERY_ROWS, KEYS]
                # P and dS reach their matmuls with the keys on M (dV = P^T dO, dK = dS^T Q)
                # from shared memory: queries on M keep lse and delta at two registers a thread.
                p_mine.store(p.to(dtype))
                fence_async_shared()
                gl.thread_barrier()
                dv = warpgroup_mma(p_mine.permute((1, 0)), do_tile, dv, is_async=True)
                dp = warpgroup_mma_wait(1, deps=(dp,))
                ds = p * (dp - gl.expand_dims(row_delta, 1))  # [QUERY_ROWS, KEYS]
                # Two buffers of dS, alternating by step: with MODE.fused both warpgroups read
                # both halves, and a warpgroup rewrites one only after the other has passed the
                # next step's barrier, so after its matmuls of this one have completed.
                ds_mine = ds_smem.index(2 * buffer + HALF)  # [QUERY_ROWS, KEYS]
                ds_mine.store(ds.to(dtype))
                fence_async_shared()
                gl.thread_barrier()
                if MODE.fused:
                    # Each warpgroup computes half of dQ's columns over all 128 keys, dS
                    # [QUERY_ROWS, 2 * KEYS] K [2 * KEYS, D / 2] (one fp32 tile per query half
                    # and kv tile is added), before dK, whose matmul hides dQ's way out.
                    mbarrier.arrive(ds_ready.index(buffer))
                    mbarrier.wait(ds_ready.index(buffer), (step // 2) & 1)
                    dq = gl.zeros([ROWS, HALF_D], gl.float32, dq_layout)
                    dq = warpgroup_mma(ds_smem.index(2 * buffer), k_upper, dq, use_acc=False,
                                       is_async=True)  # fmt: skip
                    dq = warpgroup_mma(ds_smem.index(2 * buffer + 1), k_lower, dq,
                                       is_async=True)  # fmt: skip  # [QUERY_ROWS, D / 2]
                    dk = warpgroup_mma(ds_mine.permute((1, 0)), q_tile, dk, is_async=True)
                    dv, dq = warpgroup_mma_wait(1, deps=(dv, dq))
                    mbarrier.arrive(do_empty.index(stage))
                    # The writer has added this warpgroup's tile of the step before.
                    dq_tile = dq_smem.index(HALF)  # [QUERY_ROWS, D / 2] fp32
                    mbarrier.wait(dq_empty.index(HALF), (step & 1) ^ 1)
                    dq_tile.store(dq * softmax_scale)
                    fence_async_shared()
                    gl.thread_barrier()
                    mbarrier.arrive(dq_full.index(HALF))
                    dk = warpgroup_mma_wait(0, deps=(dk,))
                    mbarrier.arrive(q_empty.index(stage))
                else:
                    dk = warpgroup_mma(ds_mine.permute((1, 0)), q_tile, dk, is_async=True)
                    dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
                    mbarrier.arrive(q_empty.index(stage))
                    mbarrier.arrive(do_empty.index(stage))
                step += 1

    if MODE.fused:
        # The other warpgroup's dQ matmuls read these K rows too: wait until they are done.
        mbarrier.arrive(ds_ready.index(2))
        mbarrier.wait(ds_ready.index(2), 0)
    # This warpgroup's K and V rows are no longer read: they hold dK and dV on their way out.
    k_mine.store((dk * softmax_scale).to(dtype))
    v_mine.store(dv.to(dtype))
    kv_row = batch * seq_len_kv + key_first
    kv_col = kv_head * HEAD_DIM
    if MASKS.kv_tail:
        grad_k, grad_v, row_stride = tail
        if key_first + KEYS > seq_len_kv:
            # Past S_kv, the [B * S_kv, H_kv * D] view holds the next batch element's rows.
            _store_rows(grad_k, k_mine, kv_row, seq_len_kv - key_first, kv_col, row_stride)
            _store_rows(grad_v, v_mine, kv_row, seq_len_kv - key_first, kv_col, row_stride)
        else:
            _store_tile(dk_desc, k_mine, kv_row, kv_col)
            _store_tile(dv_desc, v_mine, kv_row, kv_col)
    else:
        _store_tile(dk_desc, k_mine, kv_row, kv_col)
        _store_tile(dv_desc, v_mine, kv_row, kv_col)
    tma.store_wait(0)


@gluon.jit
def _backward_kernel(
    q_desc, do_desc, k_desc, v_desc, dk_desc, dv_desc, dq_desc, lse, delta, grad_k, grad_v,
    t_row_offsets, t_col_indices, seq_len_q, seq_len_kv, heads_q, group, stride_layout,
    layout_batch_stride, layout_head_divisor, qk_scale, softmax_scale, document_first,
    document_last, window_left, window_right, counters, halves, turns, query_masks,
    NUM_STAGES: gl.constexpr,
    GRAD_Q: gl.constexpr, ORDERED: gl.constexpr, HAS_LEFT: gl.constexpr,
    HAS_RIGHT: gl.constexpr, HAS_DOCUMENTS: gl.constexpr, KV_TAIL: gl.constexpr,
    Q_TAIL: gl.constexpr, HAS_QUERY_MASKS: gl.constexpr, PACK: gl.constexpr,
    ALIGN: gl.constexpr,
):  # fmt: skip
    """Grid (ceil(S_kv / 128), H_kv, B), kv blocks fastest (under a causal layout the first
    ones are the heaviest; with MODE.ordered the last first). q_desc / do_desc: PACK 1,
    [B * S_q, H_q * D] in blocks [64, D]; PACK > 1 (query blocks of 128 / PACK positions x
    PACK heads of the group, as the forward's tiles), the 4-D tensors [B, S_q, H_q, D] in
    boxes [1, 64 / PACK, PACK, D]; k_desc, v_desc: [B * S_kv, H_kv * D] in blocks
    [128, D]; dk_desc / dv_desc: grad_k / grad_v's like views in blocks [64, D]. lse
    (natural log), delta = rowsum(dO * O): fp32 [B, H_q, S_q]; dq_desc: with GRAD_Q an fp32
    [B * S_q, H_q * D] view of zeros in blocks [64, D / 2], added to (TMA reduce-adds; rows
    past S_q get zeros added), PACK > 1 the 4-D [B, S_q, H_q, D] in boxes [1, 64 / PACK,
    PACK, D / 2]; with ORDERED (PACK 1), counters: i32 zeros [B, H_q, halves] (halves:
    the query halves of a head, 2 * ceil(S_q / 128)) and turns: i32 [nnz], each entry of
    the transposed layout's turn in its query block's row (entry_turns, _dq_writer). The
    transposed layout row of (b, h) is b * layout_batch_stride + h // layout_head_divisor.
    ALIGN: the positions the columns' walks align to (walk.py; 0, as ORDERED needs: none).
    Masks as in the forward kernel; HAS_QUERY_MASKS: query_masks (int64 [nnz], aligned with
    the transposed layout's entries) has bit t of an entry set when position t of its query
    block reads its kv block."""
    ROWS: gl.constexpr = QUERY_ROWS_CONSTEXPR
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    KV_ROWS: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    MASKS: gl.constexpr = _masks(HAS_LEFT, HAS_RIGHT, HAS_DOCUMENTS, KV_TAIL, Q_TAIL,
                                 HAS_QUERY_MASKS)  # fmt: skip
    # A NamedTuple, not bools: those reach warp_specialize's partitions as run-time values.
    MODE: gl.constexpr = _mode(GRAD_Q, ORDERED, ALIGN)
    kv_block = gl.program_id(0)
    if MODE.ordered:  # highest first: see _dq_writer
        kv_block = gl.num_programs(0) - 1 - kv_block
    kv_head = gl.program_id(1)
    batch = gl.program_id(2)

    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, ROWS, HEAD_DIM],
                                       half_layout(HEAD_DIM, dtype))  # fmt: skip
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, ROWS, HEAD_DIM],
                                        half_layout(HEAD_DIM, dtype))  # fmt: skip
    k_smem = gl.allocate_shared_memory(dtype, [KV_ROWS, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [KV_ROWS, HEAD_DIM], v_desc.layout)
    # P of each warpgroup [warpgroup, 64 queries, 64 keys] (16 KB); dS of both
    # [2 * buffer + warpgroup, 64 queries, 64 keys], two buffers (32 KB).
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, KV_ROWS // 2], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [2, ROWS, KV_ROWS // 2], p_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [4, ROWS, KV_ROWS // 2], p_layout)
    # [buffer]: both warpgroups' dS of a step stored; [2]: both warpgroups' matmuls done
    ds_ready = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    # [warpgroup]: its dQ tile in shared memory, written / added
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if GRAD_Q:
        # A consumer's dQ tile [64, D / 2] fp32 on its way out (32 KB for both at D = 128).
        dq_smem = gl.allocate_shared_memory(gl.float32, [2, ROWS, HEAD_DIM // 2],
                                            half_layout(HEAD_DIM // 2, gl.float32))  # fmt: skip
        for i in gl.static_range(3):
            mbarrier.init(ds_ready.index(i), count=2)  # one arrival per consumer warpgroup
        for i in gl.static_range(2):
            mbarrier.init(dq_full.index(i), count=1)
            mbarrier.init(dq_empty.index(i), count=1)
    else:
        dq_smem = ds_ready  # never read
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_ready.index(i), count=1)
    q_ready, q_empty = slot_barriers(NUM_STAGES, 2)  # one arrival per consumer warpgroup
    do_ready, do_empty = slot_barriers(NUM_STAGES, 2)
    fence_async_shared()

    documents = batch * seq_len_kv
    bounds = (seq_len_kv, window_left, window_right, document_first + documents,
              document_last + documents)  # fmt: skip
    tail = (grad_k, grad_v, heads_q // group * HEAD_DIM)
    walk = (t_row_offsets, t_col_indices, batch, kv_head, kv_block, group, seq_len_q,
            seq_len_kv, stride_layout, layout_batch_stride, layout_head_divisor)  # fmt: skip
    shared = (q_smem, do_smem, k_smem, v_smem, p_smem, ds_smem, ds_ready, dq_smem, dq_full,
              dq_empty, dk_desc, dv_desc, kv_ready, q_ready, q_empty, do_ready, do_empty, lse,
              delta, walk, heads_q, qk_scale, softmax_scale, bounds, tail,
              query_masks)  # fmt: skip
    writes = (dq_desc, dq_smem, dq_full, dq_empty, walk, heads_q, counters, halves, turns,
              query_masks)  # fmt: skip
    loads = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_ready,
             q_ready, q_empty, do_ready, do_empty, walk, query_masks)  # fmt: skip
    gl.warp_specialize(
        [(_consumer, (shared, UPPER, MODE, MASKS, PACK)),
         (_consumer, (shared, LOWER, MODE, MASKS, PACK)),
         (_producer, (loads, MODE, MASKS, PACK)), (_dq_writer, (writes, MODE, MASKS, PACK))],
        [CONSUMER_WARPS, PRODUCER_WARPS, PRODUCER_WARPS],
        [CONSUMER_REGISTERS, PRODUCER_REGISTERS, PRODUCER_REGISTERS],
    )  # fmt: skip


@triton.jit
def _delta_kernel(out, grad_out, delta, rows, heads, seq_len, HEAD_DIM: tl.constexpr,
                  BLOCK: tl.constexpr):  # fmt: skip
    """delta[b, h, s] = sum_d dO * O over rows (b, s, h) of the [B * S * H, D] views."""
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] over (b, s, h)
    valid = row < rows
    columns = tl.arange(0, HEAD_DIM)
    offsets = row.to(tl.int64)[:, None] * HEAD_DIM + columns[None, :]  # [BLOCK, D]
    o = tl.load(out + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
    do = tl.load(grad_out + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
    head = row % heads
    token = row // heads  # b * S + s
    target = (token // seq_len * heads + head).to(tl.int64) * seq_len + token % seq_len
    tl.store(delta + target, tl.sum(o * do, 1), mask=valid)


def row_delta(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """fp32 [B, H, S]: rowsum(dO * O) of contiguous [B, S, H, D] tensors."""
    batch, seq_len, heads, head_dim = out.shape
    delta = torch.empty(batch, heads, seq_len, dtype=torch.float32, device=out.device)
    rows = batch * seq_len * heads
    block = 64
    _delta_kernel[(triton.cdiv(rows, block),)](
        out=out, grad_out=grad_out, delta=delta, rows=rows, heads=heads, seq_len=seq_len,
        HEAD_DIM=head_dim, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return delta


GRAD_Q_MODES = ("triton", "gluon", "ordered", "atomic")
DQ_ACCUMULATOR = torch.float32  # the "ordered" and "atomic" modes' dQ buffer, q's shape


def dq_buffer_fits(q: torch.Tensor) -> bool:
    """Whether the "ordered" and "atomic" modes' dQ buffer for q fits the device's free
    memory."""
    return q.numel() * DQ_ACCUMULATOR.itemsize <= _env.available_bytes(q.device)


def entry_turns(layout: BlockLayout) -> torch.Tensor:
    """i32 [nnz], aligned with layout.transpose().col_indices: each (query block, kv block)
    pair's turn among the kv blocks of its query block's row, counted from the last (the
    highest kv block adds first)."""
    row_offsets = layout.row_offsets
    ends = torch.repeat_interleave(row_offsets[:, 1:].flatten(),
                                   row_offsets.diff(dim=1).flatten())  # fmt: skip
    turns = ends - 1 - torch.arange(layout.nnz, device=row_offsets.device)
    return turns[layout.transpose_entries()].to(torch.int32)


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
    query_masks: QueryMasks | None = None,
    grad_q: str = "triton",
    num_stages: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the Gluon forward on kernel-ready inputs (custom_op.py makes them so),
    kv_block 128, layout.q_block one of forward.QUERY_BLOCKS (below 128: 128 / q_block
    query heads of a GQA group in a query block's 128 rows, as the forward packs them).

    Args:
        grad_out, q, k, v, out, lse, layout, causal, window_size, softmax_scale,
            document_ids: as in forward.attention_forward and its (out, lse).
        query_masks: per-token selections (q_block <= 64): the dQ kernel reads the CSR
            words, the dK/dV kernel the CSC ones.
        grad_q: how dQ is computed: "triton", by the Triton dQ kernel over the rows (seven
            matmuls per block pair, bitwise reproducible); "gluon", likewise by the Gluon
            dQ kernel (dq.grad_q); "ordered", beside dK and dV in
            the Gluon kernel (five matmuls), added to an fp32 dQ in each query half's kv
            order (bitwise reproducible); "atomic", the same added in any order. Query
            blocks below 128 (packed heads) take every mode but "ordered".
        num_stages: depth of the Q / dO shared-memory ring (2 for "ordered" and "atomic",
            whose P, dS and dQ tiles take 80 KB of shared memory).

    Returns:
        (dq, dk, dv) shaped like q, k, v in their dtypes, contiguous.
    """
    if grad_q not in GRAD_Q_MODES:
        raise ValueError(f"grad_q must be one of {GRAD_Q_MODES}, got {grad_q!r}")
    fused = grad_q in ("ordered", "atomic")
    pack = BLOCK_M // layout.q_block
    if grad_q == "ordered" and pack > 1:
        raise ValueError(
            f"grad_q='ordered' counts the adds per query half of one head: q_block "
            f"{layout.q_block} packs {pack} heads a tile, use grad_q='triton' or 'atomic'"
        )
    if fused and num_stages > 2:
        raise ValueError(
            f"grad_q={grad_q!r} stages dS and dQ in shared memory: num_stages must be 2, got "
            f"{num_stages}"
        )
    q, k, v, out, grad_out = (_rows_contiguous(t) for t in (q, k, v, out, grad_out))
    batch, seq_len_q, heads_q, head_dim = q.shape
    seq_len_kv, heads_kv = k.shape[1], k.shape[2]
    options = dict(causal=causal, window_size=window_size, softmax_scale=softmax_scale,
                   document_ids=document_ids)  # fmt: skip
    counters = turns = lse  # stand-ins, never read, unless grad_q == "ordered"
    halves = 2 * triton.cdiv(seq_len_q, 2 * QUERY_ROWS)  # query halves of a head
    if fused:
        delta = row_delta(out, grad_out)
        accumulated = torch.zeros(q.shape, dtype=DQ_ACCUMULATOR, device=q.device)
        if grad_q == "ordered":
            counters = torch.zeros(batch, heads_q, halves, dtype=torch.int32, device=q.device)
            turns = entry_turns(layout)
    elif grad_q == "gluon":
        delta = row_delta(out, grad_out)
        dq = gluon_dq.grad_q(grad_out, q, k, v, lse, delta, layout, **options,
                             query_masks=query_masks)  # fmt: skip
    else:
        dq, delta = grad_q_and_delta(grad_out, q, k, v, out, lse, layout, **options,
                                     query_masks=query_masks)  # fmt: skip
    if not fused:  # the kernel's dQ view stands in, never read
        accumulated = torch.empty(1, QUERY_ROWS, pack, head_dim, device=q.device)
    grad_k = torch.empty_like(k, memory_format=torch.contiguous_format)
    grad_v = torch.empty_like(v, memory_format=torch.contiguous_format)
    masks, window_left, window_right = kernel_masks(
        causal, window_size, document_ids is not None, seq_len_q, seq_len_kv, layout.q_block
    )
    transposed = layout.transpose()
    document_first, document_last = (
        (lse, lse) if document_ids is None else document_bounds(document_ids)
    )  # lse stands in (never read) without documents
    grid = (transposed.row_offsets.shape[1] - 1, heads_kv, batch)
    _backward_kernel[grid](
        q_desc=half_descriptor(q, pack), do_desc=half_descriptor(grad_out, pack),
        k_desc=_descriptor(k, BLOCK_N), v_desc=_descriptor(v, BLOCK_N),
        dk_desc=_descriptor(grad_k, HALF_N), dv_desc=_descriptor(grad_v, HALF_N),
        dq_desc=half_descriptor(accumulated, pack, head_dim // 2), lse=lse, delta=delta,
        grad_k=grad_k, grad_v=grad_v,
        t_row_offsets=transposed.row_offsets, t_col_indices=transposed.col_indices,
        seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, heads_q=heads_q, group=heads_q // heads_kv,
        stride_layout=transposed.row_offsets.stride(0), **layout_arguments(layout, heads_q),
        qk_scale=softmax_scale * _env.LOG2_E,
        softmax_scale=softmax_scale, document_first=document_first,
        document_last=document_last, window_left=window_left, window_right=window_right,
        counters=counters, halves=halves, turns=turns,
        # lse stands in (never read) without query masks
        query_masks=lse if query_masks is None else query_masks.csc, NUM_STAGES=num_stages,
        GRAD_Q=fused, ORDERED=grad_q == "ordered",
        # Q and dO of PACK heads a position; the ordered mode's turns need the plain walk.
        ALIGN=0 if grad_q == "ordered" else walk_alignment(
            transposed, pack * 2 * head_dim * q.dtype.itemsize, q.device
        ),
        **masks.constexprs(),
        HAS_QUERY_MASKS=query_masks is not None, PACK=pack, num_warps=4,
        maxnreg=MAX_REGISTERS,
    )  # fmt: skip
    if fused:
        dq = accumulated.to(q.dtype)
    return dq, grad_k, grad_v
