"""Block-sparse attention forward for Hopper (sm_90) in Gluon, over the active blocks of a
CSR layout, with FlashAttention-3's structure.

A tile is 128 query rows of one (batch, head); its CSR row lists its active kv blocks, the
only ones that cost work (a dense layout is the all-active CSR). Tiles launch one (batch,
kv head) after another, each over its query blocks heaviest first, each query block over
the query heads of the kv head's GQA group (which read the same K and V). A program runs
one tile, or (persistent) one per SM runs tiles until none are left, its producer taking
each next one from a counter and handing it to the consumers. Three partitions of warps share the
program (gl.warp_specialize):

- a producer warp (few registers) issues TMA loads: the two 64-row halves of the query tile
  once, then the K and V tiles of each active block into a NUM_STAGES-deep shared-memory
  ring, each slot guarded by a "ready" and an "empty" mbarrier (K and V apart, so S = Q K^T
  may start while V is still in flight);
- two consumer warpgroups, each owning 64 query rows, run S = Q K^T and O += P V as async
  warpgroup MMAs (P from registers, fp32 accumulators) with online softmax in fp32 and
  exp2. Within a warpgroup, S of block j is issued before O += P V of block j - 1, and the
  softmax of block j runs while that matmul does. With PINGPONG the two warpgroups take
  turns to issue their matmuls (a pair of mbarriers passes the turn), so one warpgroup's
  softmax overlaps the other's matmuls.

Element masks (a left / right window bound, causal being the right bound 0; documents;
keys from S_kv on) are compiled in only for calls that have them (Masks), with the
semantics of the Triton kernels' mask_scores. Each is a bound on the keys a query row sees
(a document is a run of positions), so a consumer bounds its 64 rows' keys once and decides
per block with two scalar compares whether the block is full (no mask work) or partial
(scores of keys a query must not see set to -inf in registers before the softmax); the
producer only loads. Rows that see no key get zero output and lse = -inf.

Each consumer writes its 64 rows of O through the shared memory its query half used (TMA
store) and its log-sum-exp (natural log) with plain stores. S_q and S_kv need not be
multiples of 128: TMA reads the rows past a batch element's end from the next one (past
the tensor's end: zeros), keys from S_kv on are masked, and a query half that ends past
S_q stores its rows with plain masked stores (a TMA store would overwrite the next batch
element's first rows).

kv_block 128, q_block one of QUERY_BLOCKS: below 128 a tile's 128 rows are 128 / q_block
positions x 128 / q_block query heads of one GQA group (row r: position r // PACK, head
r % PACK), loaded and stored through 4-D TMA boxes, optionally with per-token query masks
(a word of position bits per CSR entry); D in {64, 128}, fp16 or bf16.
"""

from __future__ import annotations

from typing import NamedTuple

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
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flash_msa import _env
from flash_msa.layout import heavy_rows_first
from flash_msa.ops.triton.common import mask_arguments
from flash_msa.patterns._build import is_int

BLOCK_M = 128  # query rows of one program
HALF_M = 64  # query rows of one consumer warpgroup
BLOCK_N = 128  # keys of one layout block
HEAD_DIMS = (64, 128)
# Query positions of a tile: q_block = 128 / PACK positions x PACK query heads of a group
QUERY_BLOCKS = (2, 4, 8, 16, 32, 64, 128)
DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
# TMA views: the inputs' dtypes and fp32 (the backward's dQ accumulator)
VIEW_DTYPES = {**DTYPES, torch.float32: gl.float32}
CONSUMER_WARPS: gl.constexpr = gl.constexpr(4)  # one warpgroup per consumer
PRODUCER_WARPS: gl.constexpr = gl.constexpr(1)
# setmaxnreg budgets: the program has 3 warpgroups (2 consumers + the producer's), 168
# registers a thread on average (64K registers / 384 threads, rounded down to 8); the
# producer gives most of its share to the consumers.
MAX_REGISTERS = 168
CONSUMER_REGISTERS: gl.constexpr = gl.constexpr(240)
PRODUCER_REGISTERS: gl.constexpr = gl.constexpr(24)


class Masks(NamedTuple):
    """The element masks and ragged ends a compiled variant of the kernel handles: all False
    is the path of full blocks only."""

    left: bool = False  # keys j >= i - window_left
    right: bool = False  # keys j <= i + window_right (causal: window_right = 0)
    documents: bool = False  # keys of the query's document only
    kv_tail: bool = False  # S_kv is not a multiple of 128: keys from S_kv on are masked
    q_tail: bool = False  # S_q is not a multiple of the tile: rows from S_q on are not stored
    query: bool = False  # per-token selections: a row reads a block only where its bit is set

    @property
    def lower(self) -> bool:
        """Whether a query's keys have a lower bound above 0."""
        return self.left or self.documents

    @property
    def upper(self) -> bool:
        """Whether a query's keys have an upper bound below the last block's end."""
        return self.right or self.documents or self.kv_tail

    @property
    def scores(self) -> bool:
        """Whether a block may be partial (scores to mask)."""
        return self.lower or self.upper or self.query

    def constexprs(self) -> dict[str, bool]:
        """The kernels' keyword constexprs for the element masks (the forward also takes
        HAS_QUERY_MASKS = query)."""
        return dict(HAS_LEFT=self.left, HAS_RIGHT=self.right, HAS_DOCUMENTS=self.documents,
                    KV_TAIL=self.kv_tail, Q_TAIL=self.q_tail)  # fmt: skip


HALF_ROWS: gl.constexpr = gl.constexpr(HALF_M)
UPPER: gl.constexpr = gl.constexpr(0)
LOWER: gl.constexpr = gl.constexpr(1)
LN_2: gl.constexpr = gl.constexpr(_env.LN_2)


@gluon.jit
def _tile(tile, tiles, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, PACK: gl.constexpr):
    """Tile `tile` of the launch order: (batch, kv head) pairs one after the other (batch
    major), each over its query blocks by descending work (row_order), and each query block
    over the query heads of the kv head's GQA group (PACK > 1: PACK heads a tile); so the
    tiles that run together read the K and V of one kv head (L2), the heads of a group at
    once where they share a layout row, and each kv head ends on its lightest tiles. A tile
    is BLOCK rows: BLOCK / PACK tokens x PACK heads. Returns its CSR row's entries [start,
    end), its TMA coordinates q_row, q_col (Q and O: the 2-D view's, or PACK > 1 the first
    head in the 4-D view), kv_row, kv_col (K and V), lse_offset (of its first head and
    token), the position of its first query and its batch element. tiles = (row_order,
    row_offsets, stride_layout, layout_batch_stride, layout_head_divisor, heads_q, group,
    seq_len_q, seq_len_kv, num_q_blocks): see _forward_kernel."""
    (row_order, row_offsets, stride_layout, layout_batch_stride, layout_head_divisor, heads_q,
     group, seq_len_q, seq_len_kv, num_q_blocks) = tiles  # fmt: skip
    members = group // PACK  # tiles of a query block in a GQA group
    heads_kv = heads_q // group
    pair = tile // (num_q_blocks * members)  # batch * H_kv + kv head
    rank = tile % (num_q_blocks * members)
    query_block = gl.load(row_order + rank // members)
    batch = pair // heads_kv
    kv_head = pair % heads_kv
    head = kv_head * group + rank % members * PACK  # the tile's first query head
    row = row_offsets + (batch * layout_batch_stride + head // layout_head_divisor) * stride_layout
    start = gl.load(row + query_block)
    end = gl.load(row + query_block + 1)
    query_first = query_block * (BLOCK // PACK)
    q_row = batch * seq_len_q + query_first
    lse_offset = (batch * heads_q + head).to(gl.int64) * seq_len_q + query_first
    if PACK == 1:
        q_col = head * HEAD_DIM
    else:
        q_col = head
    return (start, end, q_row, q_col, batch * seq_len_kv, kv_head * HEAD_DIM, lse_offset,
            query_first, batch)  # fmt: skip


@gluon.constexpr_function
def _scalar_layout(warps):
    """A [1, 1] tensor over `warps` warps (every thread holds the one element)."""
    return gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[32, 1],
                            warps_per_cta=[warps, 1], order=[1, 0])  # fmt: skip


@gluon.jit
def _publish(tile, taken, schedule):
    """The producer: tile index `tile` into slot `taken` % 2 of the schedule, once both
    consumers have taken what the slot held before. schedule = (tile_ids, tile_ready,
    tile_empty): int32 [2, 1, 1] shared memory and its slots' mbarriers."""
    tile_ids, tile_ready, tile_empty = schedule
    slot = taken % 2
    mbarrier.wait(tile_empty.index(slot), ((taken // 2) & 1) ^ 1)
    tile_ids.index(slot).store(gl.full([1, 1], tile, gl.int32, _scalar_layout(1)))
    mbarrier.arrive(tile_ready.index(slot))


@gluon.jit
def _take(taken, schedule, WARPS: gl.constexpr):
    """A consumer: the tile index in slot `taken` % 2 of the schedule (see _publish)."""
    tile_ids, tile_ready, tile_empty = schedule
    slot = taken % 2
    mbarrier.wait(tile_ready.index(slot), (taken // 2) & 1)
    tile = gl.max(gl.max(tile_ids.index(slot).load(_scalar_layout(WARPS)), axis=1), axis=0)
    mbarrier.arrive(tile_empty.index(slot))
    return tile


@gluon.jit
def _load_tile(tile, count, loaded, loads, PACK: gl.constexpr):
    """The producer's work for one tile: the query halves once the consumers are done with
    the previous tile's (so they load while that tile ends), then K and V of each active
    block of the row into the ring (a slot is refilled once both consumers released it; the
    ring runs on across tiles). count: blocks loaded so far, the ring's position; loaded:
    tiles with active blocks so far, the query halves' phase; returns both, updated."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
     v_ready, v_empty, col_indices, tiles) = loads  # fmt: skip
    HALF: gl.constexpr = q_smem.type.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    start, end, q_row, q_col, kv_row, kv_col, _, query_first, batch = _tile(
        tile, tiles, 2 * HALF, HEAD_DIM, PACK
    )
    if end > start:
        for half in gl.static_range(2):
            # A fresh barrier counts as having completed the phase before 0: the first
            # waits pass at once.
            mbarrier.wait(q_empty.index(half), (loaded & 1) ^ 1)
            bar = q_ready.index(half)
            mbarrier.expect(bar, q_desc.block_type.nbytes)
            copy_half(q_desc, q_smem.index(half), bar, q_row + half * HALF, q_col, batch,
                      query_first + half * (HALF // PACK), PACK)  # fmt: skip
        loaded += 1
        ring = (k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty)
        count = load_blocks(ring, col_indices, start, end, kv_row, kv_col, count)
    return count, loaded


@gluon.jit
def head_column(head, HEAD_DIM: gl.constexpr, PACK: gl.constexpr):
    """The column coordinate of query head `head` in a half_descriptor view: its first
    element (head * HEAD_DIM) in the 2-D view for PACK 1, the head itself in the 4-D one."""
    if PACK == 1:
        column = head * HEAD_DIM
    else:
        column = head
    return column


@gluon.jit
def half_coordinates(row, column, batch, query_first, offset, PACK: gl.constexpr):
    """A query half's TMA coordinates in a half_descriptor view, from element `offset` of
    its rows on: PACK 1, [row, column + offset] of the 2-D view; PACK > 1, [batch,
    query_first, column, offset] of the 4-D one (column: see head_column)."""
    if PACK == 1:
        coordinates = [row, column + offset]
    else:
        coordinates = [batch, query_first, column, offset]
    return coordinates


@gluon.jit
def half_tile(desc, tile, PACK: gl.constexpr):
    """The shared tile [64, columns] of a query half as desc's block: itself for PACK 1,
    reshaped to the 4-D box [1, 64 / PACK positions, PACK heads, columns] otherwise."""
    if PACK == 1:
        shaped = tile
    else:
        shaped = tile.reshape(desc.block_type.shape)
    return shaped


@gluon.jit
def copy_half(desc, half, bar, row, column, batch, query_first, PACK: gl.constexpr):
    """A TMA load of a query-side half [64, D] into the shared tile `half`, counted on the
    mbarrier `bar`, at half_coordinates (PACK > 1: zeros from S on)."""
    tma.async_copy_global_to_shared(desc, half_coordinates(row, column, batch, query_first, 0,
                                                           PACK),
                                    bar, half_tile(desc, half, PACK))  # fmt: skip


@gluon.jit
def store_half(desc, tile, out, row, column, batch, query_first, seq_len_q, row_stride,
               MASKS: gl.constexpr, PACK: gl.constexpr):  # fmt: skip
    """The shared tile [64, D] (a query half written by this warpgroup) to its rows, with
    copy_half's coordinates: PACK > 1 the 4-D view's box (TMA drops the positions from S_q
    on); PACK 1 a TMA store, or with MASKS.q_tail for a half that ends past S_q masked plain
    stores into out (row_stride elements a row): past S_q the [B * S_q, H * D] view holds
    the next batch element's first rows, which a TMA store of the whole half would
    overwrite."""
    ROWS: gl.constexpr = tile.type.shape[0]
    if PACK > 1:
        fence_async_shared()
        tma.async_copy_shared_to_global(desc, half_coordinates(row, column, batch, query_first,
                                                               0, PACK),
                                        half_tile(desc, tile, PACK))  # fmt: skip
    elif MASKS.q_tail:
        if query_first + ROWS > seq_len_q:
            _store_rows(out, tile, row, seq_len_q - query_first, column, row_stride)
        else:
            _store_tile(desc, tile, row, column)
    else:
        _store_tile(desc, tile, row, column)


@gluon.jit
def load_blocks(ring, col_indices, start, end, kv_row, kv_col, count):
    """A producer's TMA loads of the K and V tiles of a row's active blocks start .. end - 1
    (col_indices: their kv block indices; kv_row, kv_col: the batch element's first row and
    the kv head's column in the 2-D views) into the ring from its position count on, a slot
    refilled once both consumers released it; returns the position after them. ring =
    (k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty)."""
    k_desc, v_desc, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty = ring
    KV_ROWS: gl.constexpr = k_desc.block_type.shape[0]
    NUM_STAGES: gl.constexpr = k_smem.type.shape[0]
    block = gl.load(col_indices + start)
    for j in range(start, end):
        stage = count % NUM_STAGES
        phase = (count // NUM_STAGES) & 1
        row = kv_row + block * KV_ROWS
        # The next index loads while this step waits for its slots.
        block = gl.load(col_indices + j + 1, mask=j + 1 < end, other=0)
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            k_desc, [row, kv_col], k_ready.index(stage), k_smem.index(stage)
        )
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            v_desc, [row, kv_col], v_ready.index(stage), v_smem.index(stage)
        )
        count += 1
    return count


@gluon.jit
def _producer(loads, num_tiles, schedule, next_tile, PERSISTENT: gl.constexpr,
              PACK: gl.constexpr):  # fmt: skip
    """One warp, over its program's tiles (see _load_tile): the one of the program's index,
    and, PERSISTENT, each next one taken from the counter next_tile (int32, 0 at launch) plus
    the program count, so programs that finish early take more tiles, each handed to the
    consumers (schedule, see _publish); past the last, num_tiles tells them to stop. Else
    (one program per tile) the program's tiles are p, p + P, ..."""
    count = 0
    loaded = 0
    if PERSISTENT:
        taken = 0  # tile indices handed to the consumers so far
        tile = gl.program_id(0)
        while tile < num_tiles:
            _publish(tile, taken, schedule)
            taken += 1
            # The next tile's index arrives while this one's loads are issued.
            following = gl.atomic_add(next_tile, 1) + gl.num_programs(0)
            count, loaded = _load_tile(tile, count, loaded, loads, PACK)
            tile = following
        _publish(num_tiles, taken, schedule)
    else:
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            count, loaded = _load_tile(tile, count, loaded, loads, PACK)


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, FIRST: gl.constexpr, MASKED: gl.constexpr):
    """Online softmax of one block of scores s [HALF_M, BLOCK_N] (raw Q K^T, -inf where
    masked): the new row maxima (log2 units), the rescale factor of what was accumulated, p
    and the row sums."""
    row_max = gl.max(s, axis=1) * qk_scale  # [HALF_M]
    if FIRST:
        m_new = row_max
    else:
        m_new = gl.maximum(m_i, row_max)
    if MASKED:
        # A row that has seen no key yet keeps the maximum -inf: shifting it by 0 makes its
        # exponentials and its rescale factor 0, not NaN.
        shift = gl.where(m_new == float("-inf"), 0.0, m_new)  # [HALF_M]
    else:
        shift = m_new
    p = gl.exp2(s * qk_scale - gl.expand_dims(shift, 1))  # [HALF_M, BLOCK_N]
    if FIRST:
        alpha = gl.full_like(m_new, 1.0)
        l_new = gl.sum(p, axis=1)
    else:
        alpha = gl.exp2(m_i - shift)  # [HALF_M]
        l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _visible_keys(query_first, bounds, ROWS: gl.constexpr, layout: gl.constexpr,
                  MASKS: gl.constexpr, PACK: gl.constexpr = 1):  # fmt: skip
    """The keys the ROWS queries (ROWS / PACK positions from query_first, PACK heads each:
    row r is position query_first + r // PACK) may see, as bounds: lower, upper
    [HALF_M] (in `layout`), query i sees keys lower[i] <= j <= upper[i]; lowest, highest
    (scalars), the largest lower and the smallest upper bound over the rows, between which
    a block is full. bounds = (key_end, window_left, window_right, document_first,
    document_last): document_first / document_last point at this batch element's int32 [S]
    first and last positions of each token's document (documents are contiguous runs, so
    a key is in the query's document iff it lies between them)."""
    key_end, window_left, window_right, document_first, document_last = bounds
    queries = query_first + gl.arange(0, ROWS, layout=layout) // PACK  # [HALF_M]
    query_last = query_first + ROWS // PACK - 1
    lower = gl.zeros_like(queries)  # [HALF_M]
    upper = gl.zeros_like(queries) + (key_end - 1)  # [HALF_M]
    lowest = 0
    highest = key_end - 1
    if MASKS.left:
        lower = gl.maximum(lower, queries - window_left)
        lowest = gl.maximum(lowest, query_last - window_left)
    if MASKS.right:
        upper = gl.minimum(upper, queries + window_right)
        highest = gl.minimum(highest, query_first + window_right)
    if MASKS.documents:  # S_q == S_kv: rows from S_q on (never stored) read the last token's
        tokens = gl.minimum(queries, key_end - 1)  # [HALF_M]
        lower = gl.maximum(lower, gl.load(document_first + tokens))
        upper = gl.minimum(upper, gl.load(document_last + tokens))
        # Runs are sorted: the last row's document starts last, the first row's ends first.
        lowest = gl.maximum(lowest, gl.load(document_first + gl.minimum(query_last, key_end - 1)))
        highest = gl.minimum(highest, gl.load(document_last + gl.minimum(query_first, key_end - 1)))
    return lower, upper, lowest, highest


@gluon.jit
def _partial(key_first, visible, KEYS: gl.constexpr, MASKS: gl.constexpr):
    """Whether the block of KEYS keys from position key_first needs the element mask
    (visible: see _visible_keys). A partial block may still leave every score visible; a
    full one never hides one."""
    _, _, lowest, highest = visible
    partial = False
    if MASKS.lower:
        partial = partial | (key_first < lowest)
    if MASKS.upper:
        partial = partial | (key_first + KEYS - 1 > highest)
    return partial


@gluon.jit
def _mask_scores(s, partial, key_first, visible, KEY_AXIS: gl.constexpr, MASKS: gl.constexpr):
    """s (queries x keys [HALF_M, BLOCK_N] with KEY_AXIS 1, keys x queries with KEY_AXIS 0)
    of the keys from position key_first, with -inf where a query must not see a key
    (visible: see _visible_keys, its bounds along the other axis), if the block is partial."""
    lower, upper, _, _ = visible
    if partial:
        KEYS: gl.constexpr = s.type.shape[KEY_AXIS]
        keys = key_first + gl.arange(0, KEYS, layout=gl.SliceLayout(1 - KEY_AXIS, s.type.layout))
        keys = gl.expand_dims(keys, 1 - KEY_AXIS)
        keep = True
        if MASKS.upper:
            keep = keep & (keys <= gl.expand_dims(upper, KEY_AXIS))
        if MASKS.lower:
            keep = keep & (keys >= gl.expand_dims(lower, KEY_AXIS))
        s = gl.where(keep, s, float("-inf"))
    return s


@gluon.jit
def _query_word(words, step, partial, ROWS: gl.constexpr, PACK: gl.constexpr):
    """The word of row bits of the row's entry `step` and whether the block is partial for
    these ROWS rows (ROWS / PACK tokens): partial already, or one of their tokens does not
    read it. words = (row_masks, first_token): the row's int64 words (bit t: token t of the
    query block reads the entry's kv block) and the bit of the rows' first token."""
    row_masks, first_token = words
    word = gl.load(row_masks + step)
    ALL: gl.constexpr = (1 << (ROWS // PACK)) - 1  # the rows' tokens, from first_token
    return word, partial | (((word >> first_token) & ALL) != ALL)


@gluon.jit
def _mask_rows(s, partial, word, words, PACK: gl.constexpr):
    """s [HALF_M, BLOCK_N] with -inf on the rows whose token's bit of `word` is unset, if
    the block is partial (words: see _query_word; row r is token r // PACK)."""
    if partial:
        ROWS: gl.constexpr = s.type.shape[0]
        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, s.type.layout))  # [HALF_M]
        bits = (words[1] + rows // PACK).to(gl.int64)  # [HALF_M]
        reads = ((word >> bits) & 1) != 0  # [HALF_M]
        s = gl.where(gl.expand_dims(reads, 1), s, float("-inf"))
    return s


@gluon.constexpr_function
def mma_layout(columns, dtype):
    """The accumulator layout of a [64, columns] warpgroup MMA over one warpgroup."""
    instr_k = 256 // dtype.primitive_bitwidth
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, columns, instr_k]
    )


@gluon.jit
def _kv_step(
    step, count, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, mine, theirs, s, acc,
    p_op, m_i, l_i, use_acc, qk_scale, row_blocks, visible, words, PINGPONG: gl.constexpr,
    MASKS: gl.constexpr, PACK: gl.constexpr,
):  # fmt: skip
    """Block `step` (> 0) of the row, the program's block `count` (the ring's and the turns'
    position): S of this block and P V of the block before it run together, the mask and
    softmax of this block beside that P V; returns the new S, O, P (input dtype, operand
    layout) and softmax state. row_blocks points at the row's kv block indices; visible:
    see _visible_keys; words: see _query_word."""
    NUM_STAGES: gl.constexpr = k_smem.type.shape[0]
    KV_ROWS: gl.constexpr = k_smem.type.shape[1]
    dtype: gl.constexpr = q.dtype
    HEAD_DIM: gl.constexpr = q.type.shape[1]
    o_rows: gl.constexpr = gl.SliceLayout(1, mma_layout(HEAD_DIM, dtype))
    p_layout: gl.constexpr = p_op.type.layout
    stage = count % NUM_STAGES
    phase = (count // NUM_STAGES) & 1
    before = (count - 1) % NUM_STAGES

    if MASKS.scores:  # the load's latency hides behind the wait for K and the S matmul
        key_first = gl.load(row_blocks + step) * KV_ROWS
        partial = _partial(key_first, visible, KV_ROWS, MASKS)
    if MASKS.query:
        word, partial = _query_word(words, step, partial, q.type.shape[0], PACK)
    mbarrier.wait(k_ready.index(stage), phase)
    if PINGPONG:
        mbarrier.wait(mine, count & 1)
    s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s, use_acc=False, is_async=True)
    acc = warpgroup_mma(p_op, v_smem.index(before), acc, use_acc=use_acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(theirs)
    s = warpgroup_mma_wait(1, deps=(s,))  # S done; P V may still run
    mbarrier.arrive(k_empty.index(stage))
    if MASKS.scores:
        s = _mask_scores(s, partial, key_first, visible, 1, MASKS)
    if MASKS.query:
        s = _mask_rows(s, partial, word, words, PACK)
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, qk_scale, False, MASKS.scores)
    # This block's V (read by the next step's P V) is waited for here, between the softmax
    # and the matmul wait: the barrier's spin loop ends a basic block, which keeps ptxas
    # from hoisting the matmul wait above the exponentials.
    mbarrier.wait(v_ready.index(stage), phase)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    mbarrier.arrive(v_empty.index(before))
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
    p_next = gl.convert_layout(p.to(dtype), p_layout)  # [HALF_M, BLOCK_N]
    return s, acc, p_next, m_i, l_i


@gluon.constexpr_function
def row_layout(head_dim):
    """A [64, head_dim] tile over one warpgroup in runs of 8 elements (16 bytes) along D."""
    return gl.BlockedLayout(
        size_per_thread=[1, 8], threads_per_warp=[32 // (head_dim // 8), head_dim // 8],
        warps_per_cta=[4, 1], order=[1, 0],
    )  # fmt: skip


@gluon.jit
def _store_rows(out, tile, first_row, row_count, column, row_stride):
    """Rows 0 .. row_count - 1 of the shared-memory tile [HALF_M, D] to rows first_row.. of
    out (row_stride elements apart) from element `column` on, with masked plain stores."""
    ROWS: gl.constexpr = tile.type.shape[0]
    HEAD_DIM: gl.constexpr = tile.type.shape[1]
    layout: gl.constexpr = row_layout(HEAD_DIM)
    values = tile.load(layout)  # [HALF_M, D]
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))  # [HALF_M]
    columns = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))  # [D]
    offsets = (gl.expand_dims((first_row + rows).to(gl.int64) * row_stride, 1)
               + gl.expand_dims(column + columns, 0))  # fmt: skip  # [HALF_M, D]
    gl.store(out + offsets, values, mask=gl.expand_dims(rows < row_count, 1))


@gluon.jit
def _store_tile(o_desc, tile, row, column):
    """The shared-memory tile [HALF_M, D] to o_desc's rows row.. from element `column` on
    (TMA store)."""
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row, column], tile)


@gluon.jit
def _attend(
    q, q_ready, q_empty, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, mine, theirs,
    row_blocks, blocks, count, q_phase, qk_scale, visible, words, PINGPONG: gl.constexpr,
    MASKS: gl.constexpr, PACK: gl.constexpr,
):  # fmt: skip
    """One warpgroup's 64 rows of a tile over the `blocks` (> 0) active blocks of its row
    (row_blocks: their kv block indices; words: their row bits, see _query_word), the
    program's blocks count.. count + blocks - 1:
    O normalised [HALF_M, D] (fp32) and the log-sum-exp [HALF_M] (natural log). The query
    half is released (q_empty) once the row's last S has completed."""
    ROWS: gl.constexpr = q.type.shape[0]
    HEAD_DIM: gl.constexpr = q.type.shape[1]
    KV_ROWS: gl.constexpr = k_smem.type.shape[1]
    NUM_STAGES: gl.constexpr = k_smem.type.shape[0]
    dtype: gl.constexpr = q.dtype
    s_layout: gl.constexpr = mma_layout(KV_ROWS, dtype)
    o_layout: gl.constexpr = mma_layout(HEAD_DIM, dtype)
    p_layout: gl.constexpr = gl.DotOperandLayout(
        operand_index=0, parent=o_layout, k_width=32 // dtype.primitive_bitwidth
    )
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    stage = count % NUM_STAGES
    phase = (count // NUM_STAGES) & 1
    if MASKS.scores:
        key_first = gl.load(row_blocks) * KV_ROWS
        partial = _partial(key_first, visible, KV_ROWS, MASKS)
    if MASKS.query:
        word, partial = _query_word(words, 0, partial, ROWS, PACK)
    mbarrier.wait(q_ready, q_phase)
    # Block 0: S only; its P V runs beside the next block's S.
    mbarrier.wait(k_ready.index(stage), phase)
    if PINGPONG:
        mbarrier.wait(mine, count & 1)
    s = gl.zeros([ROWS, KV_ROWS], gl.float32, s_layout)  # [HALF_M, BLOCK_N]
    s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(theirs)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(stage))
    if MASKS.scores:
        s = _mask_scores(s, partial, key_first, visible, 1, MASKS)
    if MASKS.query:
        s = _mask_rows(s, partial, word, words, PACK)
    p, m_i, l_i, alpha = _softmax_step(s, s, s, qk_scale, True, MASKS.scores)
    mbarrier.wait(v_ready.index(stage), phase)
    p_op = gl.convert_layout(p.to(dtype), p_layout)  # [HALF_M, BLOCK_N]
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)  # [HALF_M, D]
    use_acc = False
    for step in range(1, blocks):
        s, acc, p_op, m_i, l_i = _kv_step(
            step, count + step, q, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, mine,
            theirs, s, acc, p_op, m_i, l_i, use_acc, qk_scale, row_blocks, visible, words,
            PINGPONG, MASKS, PACK,
        )  # fmt: skip
        use_acc = True
    # Every S of the row has completed: the producer may load the next tile's query half.
    mbarrier.arrive(q_empty)
    last = (count + blocks - 1) % NUM_STAGES
    acc = warpgroup_mma(p_op, v_smem.index(last), acc, use_acc=use_acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(v_empty.index(last))
    if MASKS.scores:
        # A row that saw no key has l = 0, m = -inf and O = 0: dividing by 1 leaves O = 0
        # and lse = -inf.
        l_i = gl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / gl.expand_dims(gl.convert_layout(l_i, o_rows), 1)
    return acc, (m_i + gl.log2(l_i)) * LN_2


@gluon.jit
def _attend_tile(tile, count, loaded, shared, HALF: gl.constexpr, PINGPONG: gl.constexpr,
                 MASKS: gl.constexpr, PACK: gl.constexpr):  # fmt: skip
    """A consumer's work for one tile: rows HALF * 64 .. HALF * 64 + 63 of the query tile,
    its output leaving through o_smem by TMA while the next tile runs (count: blocks
    consumed so far, the ring's position; loaded: tiles with active blocks so far, the query
    half's phase; returns both, updated). bounds = (S_kv, window_left, window_right,
    document_first, document_last) with the documents' bounds of batch element 0 (see
    _visible_keys); tail = (out, S_q, H_q * D): out's pointer, for a half that ends past
    S_q; query_masks: the layout's int64 words (MASKS.query)."""
    (q_smem, o_smem, k_smem, v_smem, o_desc, q_ready, q_empty, k_ready, k_empty, v_ready,
     v_empty, turns, lse, col_indices, query_masks, tiles, qk_scale, bounds,
     tail) = shared  # fmt: skip
    ROWS: gl.constexpr = q_smem.type.shape[1]
    TOKENS: gl.constexpr = ROWS // PACK  # positions of the half's rows
    HEAD_DIM: gl.constexpr = q_smem.type.shape[2]
    dtype: gl.constexpr = q_smem.dtype
    o_layout: gl.constexpr = mma_layout(HEAD_DIM, dtype)
    s_rows: gl.constexpr = gl.SliceLayout(1, mma_layout(k_smem.type.shape[1], dtype))
    q = q_smem.index(HALF)  # [HALF_M, D]
    o = o_smem.index(HALF)  # [HALF_M, D]
    seq_len_kv, window_left, window_right, document_first, document_last = bounds
    out, seq_len_q, row_stride = tail
    rows = gl.arange(0, ROWS, layout=s_rows)
    start, end, _, _, _, _, _, query_first, batch = _tile(tile, tiles, 2 * ROWS, HEAD_DIM, PACK)
    query_first = query_first + HALF * TOKENS
    visible = None
    if MASKS.scores:
        documents = batch * seq_len_kv
        tile_bounds = (seq_len_kv, window_left, window_right, document_first + documents,
                       document_last + documents)  # fmt: skip
        visible = _visible_keys(query_first, tile_bounds, ROWS, s_rows, MASKS, PACK)
    words = None
    if MASKS.query:
        words = (query_masks + start, HALF * TOKENS)
    if end > start:
        acc, log_sum = _attend(
            q, q_ready.index(HALF), q_empty.index(HALF), k_smem, v_smem, k_ready, k_empty,
            v_ready, v_empty, turns.index(HALF), turns.index(1 - HALF), col_indices + start,
            end - start, count, loaded & 1, qk_scale, visible, words, PINGPONG, MASKS, PACK,
        )  # fmt: skip
        count += end - start
        loaded += 1
    else:
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
        log_sum = gl.full([ROWS], float("-inf"), gl.float32, s_rows)

    # The tile's coordinates again, rather than held in registers across its blocks.
    _, _, q_row, q_col, _, _, lse_offset, _, _ = _tile(tile, tiles, 2 * ROWS, HEAD_DIM, PACK)
    row_valid = None  # every row is before S_q
    if MASKS.q_tail:
        row_valid = query_first + rows // PACK < seq_len_q  # [HALF_M]
    if PACK == 1:
        lse_rows = lse + lse_offset + HALF * ROWS + rows
    else:  # row r: head r % PACK, position r // PACK
        lse_rows = lse + lse_offset + (rows % PACK) * seq_len_q + HALF * TOKENS + rows // PACK
    gl.store(lse_rows, log_sum, mask=row_valid)
    tma.store_wait(0)  # the previous tile's output has left o
    o.store(acc.to(dtype))
    store_half(o_desc, o, out, q_row + HALF * ROWS, q_col, batch, query_first, seq_len_q,
               row_stride, MASKS, PACK)  # fmt: skip
    return count, loaded


@gluon.jit
def _consumer(
    shared, num_tiles, schedule, HALF: gl.constexpr, PINGPONG: gl.constexpr,
    MASKS: gl.constexpr, PERSISTENT: gl.constexpr, PACK: gl.constexpr,
):  # fmt: skip
    """One warpgroup over its program's tiles (see _attend_tile): PERSISTENT, those the
    producer hands it (schedule, see _take) until it hands num_tiles; else p, p + P, ..."""
    count = 0
    loaded = 0
    if PERSISTENT:
        tile = _take(0, schedule, CONSUMER_WARPS)
        taken = 1  # tile indices taken from the producer so far
        while tile < num_tiles:
            count, loaded = _attend_tile(tile, count, loaded, shared, HALF, PINGPONG, MASKS,
                                         PACK)  # fmt: skip
            tile = _take(taken, schedule, CONSUMER_WARPS)
            taken += 1
    else:
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            count, loaded = _attend_tile(tile, count, loaded, shared, HALF, PINGPONG, MASKS,
                                         PACK)  # fmt: skip
    tma.store_wait(0)


@gluon.constexpr_function
def _masks(left, right, documents, kv_tail, q_tail, query=False):
    return Masks(left, right, documents, kv_tail, q_tail, query)


@gluon.constexpr_function
def half_layout(head_dim, dtype):
    """The NVMMA shared layout of a [64, head_dim] query or output half (TMA and wgmma)."""
    return gl.NVMMASharedLayout.get_default_for([HALF_M, head_dim], dtype)


@gluon.jit
def slot_barriers(SLOTS: gl.constexpr, EMPTY_ARRIVALS: gl.constexpr):
    """The mbarriers of a ring of SLOTS shared-memory slots, initialised: "ready" [SLOTS, 1]
    (one arrival, the producer's, with the TMA bytes it expects) and "empty" [SLOTS, 1]
    (EMPTY_ARRIVALS: one per consumer that releases the slot). The forward kernel allocates
    and initialises its own in the order its pinned instructions were measured with."""
    ready = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=EMPTY_ARRIVALS)
    return ready, empty


@gluon.jit
def _forward_kernel(
    q_desc, k_desc, v_desc, o_desc, lse, row_order, next_tile, row_offsets, col_indices,
    query_masks, seq_len_q, seq_len_kv, heads_q, batch, group, stride_layout,
    layout_batch_stride, layout_head_divisor, qk_scale, out, document_first, document_last,
    window_left, window_right, NUM_STAGES: gl.constexpr, PINGPONG: gl.constexpr,
    PERSISTENT: gl.constexpr, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
    HAS_DOCUMENTS: gl.constexpr, KV_TAIL: gl.constexpr, Q_TAIL: gl.constexpr,
    HAS_QUERY_MASKS: gl.constexpr, PACK: gl.constexpr,
):  # fmt: skip
    """Grid (P,) over the ceil(S_q / q_block) x B x H_q / PACK tiles in _tile's order
    (row_order: int32 [ceil(S_q / q_block)], the query blocks heaviest first; q_block =
    128 / PACK): program p runs tile p, and PERSISTENT (P below the tile count) as long as
    tiles are left the next one of the order (next_tile: an int32 counter, 0 at launch). A
    tile's 128 rows are q_block positions x PACK query heads of one GQA group (position
    major, as [S, H, D] holds them). q_desc / o_desc: PACK 1, 2-D views [B * S_q, H_q * D]
    in blocks [64, D]; PACK > 1, the 4-D tensors [B, S_q, H_q, D] in boxes [1, 64 / PACK,
    PACK, D] (out: o_desc's tensor); k_desc / v_desc: [B * S_kv, H_kv * D] in blocks
    [128, D]. The layout row of (b, h) is b * layout_batch_stride + h //
    layout_head_divisor. qk_scale = softmax_scale * log2(e). The masks (see Masks): HAS_LEFT /
    HAS_RIGHT keep keys j with i - window_left <= j / j <= i + window_right; HAS_DOCUMENTS keeps
    the keys of the query's document, from document_first to document_last (int32 [B, S], S_q ==
    S_kv; see document_bounds); HAS_QUERY_MASKS: query_masks (int64 [nnz], aligned with
    col_indices) has bit t of an entry set when position t of its query block reads its kv
    block."""
    HALF: gl.constexpr = HALF_ROWS
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    KV_ROWS: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    MASKS: gl.constexpr = _masks(HAS_LEFT, HAS_RIGHT, HAS_DOCUMENTS, KV_TAIL, Q_TAIL,
                                 HAS_QUERY_MASKS)  # fmt: skip
    Q_BLOCK: gl.constexpr = 2 * HALF // PACK
    num_q_blocks = (seq_len_q + Q_BLOCK - 1) // Q_BLOCK
    num_tiles = num_q_blocks * (heads_q // PACK) * batch

    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], half_layout(HEAD_DIM, dtype))
    o_smem = gl.allocate_shared_memory(dtype, [2, HALF, HEAD_DIM], half_layout(HEAD_DIM, dtype))
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, KV_ROWS, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, KV_ROWS, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)  # the half's consumer warpgroup
        mbarrier.init(turns.index(i), count=1)
    schedule = (turns, turns, turns)  # stands in, never read, for a program per tile
    if PERSISTENT:
        tile_ids = gl.allocate_shared_memory(
            gl.int32, [2, 1, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        )
        tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(tile_ready.index(i), count=1)
            mbarrier.init(tile_empty.index(i), count=2)  # one arrival per consumer warpgroup
        schedule = (tile_ids, tile_ready, tile_empty)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=2)
    if PINGPONG:
        mbarrier.arrive(turns.index(0))  # the first warpgroup issues first
    fence_async_shared()

    tiles = (row_order, row_offsets, stride_layout, layout_batch_stride, layout_head_divisor,
             heads_q, group, seq_len_q, seq_len_kv, num_q_blocks)  # fmt: skip
    bounds = (seq_len_kv, window_left, window_right, document_first, document_last)
    tail = (out, seq_len_q, heads_q * HEAD_DIM)
    # A tuple bound to a name holds tensors only: the constexprs go to the partitions apart.
    shared = (q_smem, o_smem, k_smem, v_smem, o_desc, q_ready, q_empty, k_ready, k_empty,
              v_ready, v_empty, turns, lse, col_indices, query_masks, tiles, qk_scale, bounds,
              tail)  # fmt: skip
    loads = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
             v_ready, v_empty, col_indices, tiles)  # fmt: skip
    # The default partition (this kernel's 4 warps) is the first consumer.
    gl.warp_specialize(
        [(_consumer, (shared, num_tiles, schedule, UPPER, PINGPONG, MASKS, PERSISTENT, PACK)),
         (_consumer, (shared, num_tiles, schedule, LOWER, PINGPONG, MASKS, PERSISTENT, PACK)),
         (_producer, (loads, num_tiles, schedule, next_tile, PERSISTENT, PACK))],
        [CONSUMER_WARPS, PRODUCER_WARPS],
        [CONSUMER_REGISTERS, PRODUCER_REGISTERS],
    )  # fmt: skip


def padded_length(seq_len: int) -> int:
    """seq_len rounded up to whole blocks of 128: the rows the kernel's tiles address."""
    return -(-seq_len // BLOCK_M) * BLOCK_M


def shared_memory_need(head_dim: int, num_stages: int, element_size: int = 2) -> int:
    """Bytes of shared memory the kernel takes: the query and the output tile, the K and V
    rings, the mbarriers and what warp_specialize passes to its partitions (under 1 KiB)."""
    tile = BLOCK_N * head_dim * element_size
    return 2 * BLOCK_M * head_dim * element_size + 2 * num_stages * tile + 1024


def _descriptor(tensor: torch.Tensor, rows: int, columns: int | None = None) -> TensorDescriptor:
    """A 2-D TMA view [B * S, H * D] of a [B, S, H, D] tensor with contiguous rows, in
    blocks [rows, columns] (columns: D unless given)."""
    batch, seq_len, heads, head_dim = tensor.shape
    block = [rows, columns or head_dim]
    flat = tensor.view(batch * seq_len, heads * head_dim)
    layout = gl.NVMMASharedLayout.get_default_for(block, VIEW_DTYPES[tensor.dtype])
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), block, layout)


def half_block(pack: int, columns: int) -> list[int]:
    """The TMA block of a query half of `columns` columns: [64, columns] of the 2-D view for
    pack 1, else [1, 64 / pack positions, pack heads, columns] of the 4-D one."""
    return [HALF_M, columns] if pack == 1 else [1, HALF_M // pack, pack, columns]


def half_descriptor(
    tensor: torch.Tensor, pack: int, columns: int | None = None
) -> TensorDescriptor:
    """The TMA view of a [B, S, H, D] tensor with contiguous rows in query halves of pack
    heads a position (half_block; columns: D unless given): pack 1, the 2-D [B * S, H * D]
    view (_descriptor); else the 4-D tensor, where TMA fills positions from S on with zeros
    and drops them from stores."""
    if pack == 1:
        return _descriptor(tensor, HALF_M, columns)
    block = half_block(pack, columns or tensor.shape[3])
    layout = gl.NVMMASharedLayout.get_default_for(block, VIEW_DTYPES[tensor.dtype])
    return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), block, layout)


def _rows_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """tensor itself when a [B * S, H * D] view of it exists and its base is 16-byte
    aligned (what TMA needs), else a contiguous copy."""
    batch, seq_len, heads, head_dim = tensor.shape
    viewable = tensor.stride() == (seq_len * heads * head_dim, heads * head_dim, head_dim, 1)
    if viewable and tensor.data_ptr() % 16 == 0:
        return tensor
    return tensor.contiguous()


def _check(
    q, k, v, row_offsets, col_indices, softmax_scale, layout_batch, causal, window_size,
    document_ids, row_order, num_stages, programs, q_block, query_masks,
) -> tuple[int, int]:  # fmt: skip
    """ValueError / TypeError for what the kernel does not handle; returns the layout's
    (batch stride, head divisor)."""
    if not isinstance(softmax_scale, (int, float)) or not 0 < softmax_scale < float("inf"):
        raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not (
        isinstance(window_size, tuple) and len(window_size) == 2
        and all(is_int(side) for side in window_size)
    ):  # fmt: skip
        raise ValueError(f"window_size must be a tuple of two ints (left, right), got "
                         f"{window_size!r}")  # fmt: skip
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, S, H, D], got {_describe(tensor)}")
        if tensor.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor, got one on {tensor.device}")
        if tensor.dtype not in DTYPES:
            raise TypeError(f"{name} must be float16 or bfloat16, got {tensor.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share a device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    capability = _env.capability(q.device)
    if capability != (9, 0):
        raise ValueError(
            f"the Gluon forward runs on sm_90 (Hopper: H100, H200), got compute capability "
            f"{capability[0]}.{capability[1]}; use the triton backend elsewhere"
        )
    batch, seq_len_q, heads_q, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(
            f"k and v must be [B, S_kv, H_kv, D] with q's B and D, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    seq_len_kv, heads_kv = k.shape[1], k.shape[2]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim must be one of {HEAD_DIMS}, got {head_dim}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"H_q ({heads_q}) must be a multiple of H_kv ({heads_kv})")
    for name, length in (("S_q", seq_len_q), ("S_kv", seq_len_kv)):
        if length == 0:
            raise ValueError(f"{name} must be positive, got 0")
    if batch * padded_length(max(seq_len_q, seq_len_kv)) >= 2**31:
        raise ValueError(f"B * S (S rounded up to 128) must stay below 2^31 (TMA coordinates), "
                         f"got {batch} x {max(seq_len_q, seq_len_kv)}")  # fmt: skip
    for name, tensor, dim in (("row_offsets", row_offsets, 2), ("col_indices", col_indices, 1)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != dim:
            raise ValueError(f"{name} must be a {dim}-D tensor, got {_describe(tensor)}")
        if tensor.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {tensor.dtype}")
        if tensor.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {tensor.device}")
    if q_block not in QUERY_BLOCKS:
        raise ValueError(f"q_block must be one of {QUERY_BLOCKS}, got {q_block!r}")
    num_q_blocks = -(-seq_len_q // q_block)
    if row_offsets.shape[1] != num_q_blocks + 1 or row_offsets.stride(1) != 1:
        raise ValueError(
            f"row_offsets must be [L, ceil(S_q / q_block) + 1] = [L, {num_q_blocks + 1}] with "
            f"unit stride along its rows (blocks of q_block = {q_block} queries), got "
            f"{tuple(row_offsets.shape)}"
        )
    if row_order is not None and not (
        isinstance(row_order, torch.Tensor) and row_order.dtype == torch.int32
        and tuple(row_order.shape) == (num_q_blocks,) and row_order.device == q.device
    ):  # fmt: skip
        raise ValueError(
            f"row_order must be int32 [ceil(S_q / q_block)] = [{num_q_blocks}] on {q.device} "
            f"(the query blocks in launch order, as layout.heavy_rows_first() gives them), got "
            f"{_describe(row_order)}"
        )
    if query_masks is not None:
        if not isinstance(query_masks, torch.Tensor) or query_masks.dtype != torch.int64:
            raise TypeError(f"query_masks must be an int64 tensor, got {_describe(query_masks)}")
        if tuple(query_masks.shape) != (col_indices.numel(),) or query_masks.device != q.device:
            raise ValueError(
                f"query_masks must be int64 [nnz] = [{col_indices.numel()}] on {q.device} (a "
                f"word per entry of col_indices), got {_describe(query_masks)}"
            )
        if q_block > 64:
            raise ValueError(f"query_masks hold 64 bits a word: q_block must be at most 64, got "
                             f"{q_block}")  # fmt: skip
    if document_ids is not None:
        if not isinstance(document_ids, torch.Tensor):
            raise TypeError(f"document_ids must be a tensor or None, got {_describe(document_ids)}")
        if document_ids.dtype != torch.int32:
            raise TypeError(f"document_ids must be int32, got {document_ids.dtype}")
        if seq_len_q != seq_len_kv:
            raise ValueError(f"document_ids needs S_q == S_kv, got {seq_len_q} and {seq_len_kv}")
        if tuple(document_ids.shape) != (batch, seq_len_q) or document_ids.device != q.device:
            raise ValueError(
                f"document_ids must be [B, S] = [{batch}, {seq_len_q}] on {q.device}, got "
                f"{_describe(document_ids)} on {document_ids.device}"
            )
    if layout_batch not in (1, batch):
        raise ValueError(f"layout_batch must be 1 or B ({batch}), got {layout_batch}")
    rows = row_offsets.shape[0]
    layout_heads = rows // layout_batch
    if rows % layout_batch or layout_heads not in {1, heads_kv, heads_q}:
        raise ValueError(
            f"row_offsets has {rows} rows: it must have layout_batch ({layout_batch}) x "
            f"layout_heads rows, layout_heads in {{1, H_kv = {heads_kv}, H_q = {heads_q}}}"
        )
    reason = packing_refusal(q_block, heads_q, heads_kv, layout_heads)
    if reason is not None:
        raise ValueError(reason)
    if programs is not None and not (is_int(programs) and programs > 0):
        raise ValueError(f"programs must be a positive int or None, got {programs!r}")
    if num_stages not in (2, 3, 4):
        raise ValueError(f"num_stages must be 2, 3 or 4, got {num_stages}")
    need = shared_memory_need(head_dim, num_stages, q.element_size())
    available = _env.shared_memory(q.device)
    if need > available:
        raise ValueError(
            f"num_stages={num_stages} at D={head_dim} needs {need} bytes of shared memory, "
            f"the device gives {available}: use fewer stages"
        )
    return (layout_heads if layout_batch > 1 else 0), heads_q // layout_heads


def packing_refusal(q_block: int, heads_q: int, heads_kv: int, layout_heads: int) -> str | None:
    """Why tiles of q_block positions x 128 / q_block query heads cannot pack these heads
    (they must share a kv head and a layout row), or None if they can."""
    pack = BLOCK_M // q_block
    for name, heads in (("H_kv", heads_kv), ("layout_heads", layout_heads)):
        if (heads_q // heads) % pack:
            return (
                f"q_block {q_block} packs {pack} query heads into a tile's 128 rows, which "
                f"must share a kv head and a layout row: H_q / {name} = {heads_q // heads} is "
                f"not a multiple of {pack} (use q_block {BLOCK_M} or the triton backend)"
            )
    return None


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def document_bounds(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 [B, S] each: the first and the last position of each token's document, from
    document ids [B, S] that are non-decreasing along S (each document one run of tokens)."""
    ids = document_ids.contiguous()
    first = torch.searchsorted(ids, ids, out_int32=True)
    last = torch.searchsorted(ids, ids, right=True, out_int32=True) - 1
    return first, last


def kernel_masks(
    causal: bool, window_size: tuple[int, int], documents: bool, seq_len_q: int, seq_len_kv: int,
    q_block: int = BLOCK_M,
) -> tuple[Masks, int, int]:
    """The kernel's masks and window bounds (window_left, window_right) for a call over
    tiles of q_block positions: causal is the right bound 0, a negative side is unbounded, a
    side past the longer sequence is cut to it (which keeps what it masks and fits int32)."""
    longest = max(seq_len_q, seq_len_kv)
    window = mask_arguments(causal, tuple(min(side, longest) for side in window_size))
    masks = Masks(
        left=window["HAS_LEFT"], right=window["HAS_RIGHT"], documents=documents,
        kv_tail=seq_len_kv % BLOCK_N != 0, q_tail=seq_len_q % q_block != 0,
    )  # fmt: skip
    return masks, window["window_left"], window["window_right"]


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    row_offsets: torch.Tensor,
    col_indices: torch.Tensor,
    *,
    softmax_scale: float,
    layout_batch: int = 1,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    document_ids: torch.Tensor | None = None,
    row_order: torch.Tensor | None = None,
    num_stages: int = 2,
    pingpong: bool = True,
    programs: int | None = None,
    q_block: int = BLOCK_M,
    query_masks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention forward on Hopper over blocks of q_block queries x 128 keys,
    with element masks on the blocks they cut.

    Args:
        q: [B, S_q, H_q, D]; k, v: [B, S_kv, H_kv, D]; float16 or bfloat16 on an sm_90
            GPU, D in {64, 128}, H_q a multiple of H_kv, finite (the rows past a batch
            element's end that a block reads are the next one's, masked). Tensors whose
            [B * S, H * D] view does not exist are copied first.
        row_offsets: int32 [L, ceil(S_q / q_block) + 1], CSR row pointers into col_indices
            (as BlockLayout holds them, kv_block = 128); L = layout_batch x layout_heads,
            layout_heads in {1, H_kv, H_q}.
        col_indices: int32 [nnz], the active kv blocks of each row (valid indices).
        softmax_scale: the factor of Q K^T before the softmax (positive).
        layout_batch: 1 (one layout for every batch element) or B.
        causal: query i sees keys j <= i only.
        window_size: (left, right): query i sees keys i - left <= j <= i + right; -1 leaves
            a side unbounded.
        document_ids: int32 [B, S] (S_q == S_kv, non-decreasing along S: each document one
            run of tokens): keys of another document are never seen.
        row_order: int32 [ceil(S_q / q_block)], the query blocks in launch order (all of them,
            once each); None: heaviest first, as layout.heavy_rows_first() (which caches
            it) gives them.
        num_stages: depth of the K/V shared-memory ring.
        pingpong: the two consumer warpgroups take turns to issue their matmuls.
        programs: None, one program per tile of 128 queries and one head (the GPU hands
            the tiles out in launch order as SMs free up); a number, that many persistent
            programs (at most one per tile), each starting on the tile of its index and
            taking the next one of the order from a counter, its loads running under the
            last one's end.
        q_block: the layout's query block, one of QUERY_BLOCKS: a tile is q_block positions
            x 128 / q_block query heads (they must share a kv head and a layout row), so
            its K and V tiles serve 128 rows.
        query_masks: None, or int64 [nnz] aligned with col_indices (q_block <= 64): bit t
            set when position t of the entry's query block reads its kv block (per-token
            selections); a row reads only its token's blocks.

    Returns:
        out like q (contiguous, q's dtype) and lse fp32 [B, H_q, S_q] (natural log; -inf
        where a row sees no key, whose output is zero).

    Examples:
        >>> layout = patterns.causal(S, device="cuda")
        >>> out, lse = attention_forward(q, k, v, layout.row_offsets, layout.col_indices,
        ...                              softmax_scale=q.shape[-1] ** -0.5, causal=True)
    """
    layout_batch_stride, layout_head_divisor = _check(
        q, k, v, row_offsets, col_indices, softmax_scale, layout_batch, causal, window_size,
        document_ids, row_order, num_stages, programs, q_block, query_masks,
    )  # fmt: skip
    q, k, v = (_rows_contiguous(tensor) for tensor in (q, k, v))
    batch, seq_len_q, heads_q, head_dim = q.shape
    seq_len_kv = k.shape[1]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, heads_q, seq_len_q, dtype=torch.float32, device=q.device)
    masks, window_left, window_right = kernel_masks(
        causal, window_size, document_ids is not None, seq_len_q, seq_len_kv, q_block
    )
    pack = BLOCK_M // q_block
    document_first, document_last = (
        (row_offsets, row_offsets) if document_ids is None else document_bounds(document_ids)
    )  # row_offsets stands in (never read) without documents
    if row_order is None:
        row_order = heavy_rows_first(row_offsets)
    tiles = -(-seq_len_q // q_block) * (heads_q // pack) * batch
    grid = (tiles if programs is None else min(tiles, programs),)
    # The counter persistent programs take their next tiles from (row_order stands in, never
    # read, for a program per tile).
    next_tile = row_order if programs is None else torch.zeros(1, dtype=torch.int32,
                                                               device=q.device)  # fmt: skip
    q_desc, o_desc = half_descriptor(q, pack), half_descriptor(out, pack)
    _forward_kernel[grid](
        q_desc=q_desc, k_desc=_descriptor(k, BLOCK_N), v_desc=_descriptor(v, BLOCK_N),
        o_desc=o_desc, lse=lse, row_order=row_order, next_tile=next_tile,
        row_offsets=row_offsets, col_indices=col_indices,
        # col_indices stands in (never read) without query masks
        query_masks=col_indices if query_masks is None else query_masks,
        seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, heads_q=heads_q, batch=batch,
        group=heads_q // k.shape[2],
        stride_layout=row_offsets.stride(0), layout_batch_stride=layout_batch_stride,
        layout_head_divisor=layout_head_divisor, qk_scale=softmax_scale * _env.LOG2_E, out=out,
        document_first=document_first, document_last=document_last,
        window_left=window_left, window_right=window_right, **masks.constexprs(),
        HAS_QUERY_MASKS=query_masks is not None, PACK=pack, NUM_STAGES=num_stages,
        PINGPONG=pingpong, PERSISTENT=programs is not None,
        num_warps=4, maxnreg=MAX_REGISTERS,
    )  # fmt: skip
    return out, lse
