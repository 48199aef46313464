"""What the forward and backward kernels share: jit helpers (tile rows, loads, masks, CSR
steps, dropout bits) and the launch arguments computed in Python.

Tiles follow FlashAttention's names: a query tile is BLOCK_M = ROWS * PACK rows (ROWS
positions x PACK query heads of one GQA group), a key tile BLOCK_N rows, both D_PAD wide.

Rows are where a tile sits in memory (loads, stores, descriptors); positions are where it
sits in the sequence (element masks, documents, dropout bits). They are the same unless the
call has block positions (HAS_POSITIONS: context parallelism), where a block of rows of q or
of the K/V buffer is a block of a longer sequence (global_positions).

Per-token selections (HAS_QUERY_MASKS) come as one int64 word per active pair, bit r for row
r of the query block: a tile some of whose rows do not read the block takes the masked path.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from flash_msa import _env
from flash_msa.layout import BlockLayout, BlockPositions, derived_from
from flash_msa.ops.registry import QueryMasks
from flash_msa.ops.triton import configs

LOG2_E: tl.constexpr = tl.constexpr(_env.LOG2_E)
LN_2: tl.constexpr = tl.constexpr(_env.LN_2)

# Constexprs that select a compiled variant: the autotuner keeps one choice per value.
AUTOTUNE_KEY = [
    "HEAD_DIM_PAD", "Q_BLOCK", "KV_BLOCK", "ROWS", "PACK", "HAS_LEFT", "HAS_RIGHT", "HAS_DOCUMENTS",
    "HAS_DROPOUT", "HAS_POSITIONS", "HAS_QUERY_MASKS", "TMA",
]  # fmt: skip


# ---- tile rows and loads ---------------------------------------------------------------------
@triton.jit
def packed_rows(first_row, first_head, ROWS: tl.constexpr, PACK: tl.constexpr):
    """Rows along S and query heads of the BLOCK_M = ROWS * PACK rows of a packed tile.

    Heads vary fastest: the PACK heads of one position are adjacent in memory ([S, H, D]).
    """
    rows = tl.arange(0, ROWS * PACK)  # [BLOCK_M]
    return first_row + rows // PACK, first_head + rows % PACK  # [BLOCK_M], [BLOCK_M]


@triton.jit
def global_positions(first_row, rows, BLOCK: tl.constexpr, block_positions,
                     HAS_POSITIONS: tl.constexpr):  # fmt: skip
    """Sequence positions of a tile's first row and of its rows (any shape), all in one block
    of BLOCK rows: with block positions, block b of the tensor is block block_positions[b] of
    the sequence (BlockPositions.q_blocks for q, kv_blocks for the K/V buffer); without
    them rows are positions."""
    if HAS_POSITIONS:
        block = first_row // BLOCK
        shift = (tl.load(block_positions + block) - block) * BLOCK
        return first_row + shift, rows + shift
    return first_row, rows


@triton.jit
def first_at_least(values, low, high, bound):
    """The first index in [low, high) of ascending values whose value is at least bound
    (high if none): a binary search, in Triton and Gluon kernels alike."""
    while low < high:
        middle = (low + high) // 2
        if tl.load(values + middle) < bound:
            low = middle + 1
        else:
            high = middle
    return low


@triton.jit
def element_offsets(rows, heads, stride_s, stride_h):
    """int64 element offsets of (row, head) rows: S * H * D may pass 2^31."""
    return rows.to(tl.int64) * stride_s + heads.to(tl.int64) * stride_h  # [R]


@triton.jit
def load_rows(base, offsets, row_valid, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Load a [R, D_PAD] tile of rows at element offsets; invalid rows and padded dims read 0."""
    dims = tl.arange(0, HEAD_DIM_PAD)  # [D_PAD]
    mask = row_valid[:, None] & (dims[None, :] < HEAD_DIM)  # [R, D_PAD]
    return tl.load(base + offsets[:, None] + dims[None, :], mask=mask, other=0.0)


@triton.jit
def store_rows(base, offsets, row_valid, tile, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Store a [R, D_PAD] tile, cast to the buffer's dtype, skipping padding."""
    dims = tl.arange(0, HEAD_DIM_PAD)  # [D_PAD]
    mask = row_valid[:, None] & (dims[None, :] < HEAD_DIM)  # [R, D_PAD]
    tl.store(base + offsets[:, None] + dims[None, :], tile.to(base.dtype.element_ty), mask=mask)


@triton.jit
def tile_source(
    base, head, stride_s, stride_h, seq_len, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """Where a program's [ROWS, D_PAD] tiles of one head come from; base points at this batch
    row of a [B, S, H, D] tensor. TMA: a 2-D [S, D] tensor descriptor of the head, built on
    the device once per program outside the loops (rows past S and dims past D read as 0);
    otherwise base itself, for load_tile's pointer loads."""
    if TMA:
        return tl.make_tensor_descriptor(
            base + head.to(tl.int64) * stride_h, shape=[seq_len, HEAD_DIM], strides=[stride_s, 1],
            block_shape=[ROWS, HEAD_DIM_PAD],
        )  # fmt: skip
    else:
        return base


@triton.jit
def load_tile(
    source, first_row, rows, heads, row_valid, stride_s, stride_h,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """[R, D_PAD] tile of the rows (rows, heads) from a tile_source; with TMA those are the
    R rows from first_row of the source's head. Invalid rows read as 0 (with TMA: rows past
    the tensor's end)."""
    if TMA:
        return source.load([first_row, 0])
    else:
        offsets = element_offsets(rows, heads, stride_s, stride_h)  # [R]
        return load_rows(source, offsets, row_valid, HEAD_DIM, HEAD_DIM_PAD)


@triton.jit
def load_query_tile(
    base, first_head, first_row, rows, heads, row_valid, stride_s, stride_h, seq_len,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, ROWS: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """[BLOCK_M, D_PAD] rows of a query-side tensor (q, out, dout) held for a whole program."""
    source = tile_source(base, first_head, stride_s, stride_h, seq_len, HEAD_DIM, ROWS,
                         HEAD_DIM_PAD, TMA)  # fmt: skip
    return load_tile(source, first_row, rows, heads, row_valid, stride_s, stride_h,
                     HEAD_DIM, HEAD_DIM_PAD, TMA)  # fmt: skip


# ---- programs over query tiles (forward and dQ) ----------------------------------------------
@triton.jit
def query_program(tile_order, seq_len_q, group, ROWS: tl.constexpr, PACK: tl.constexpr):
    """The query tile of this program of the grid (tiles, H_q // PACK, B): its batch, first
    query head, kv head, first row, and its rows, heads and validity."""
    tile = tl.load(tile_order + tl.program_id(0))  # heavy rows first
    first_head = tl.program_id(1) * PACK
    batch = tl.program_id(2).to(tl.int64)
    first_row = tile * ROWS
    rows, heads = packed_rows(first_row, first_head, ROWS, PACK)  # [BLOCK_M] x2
    row_valid = rows < seq_len_q  # [BLOCK_M]
    return batch, first_head, first_head // group, first_row, rows, heads, row_valid


@triton.jit
def row_steps(row_offsets, layout, stride_layout, row, STEPS_PER_BLOCK: tl.constexpr):
    """[start, end) steps of a CSR row; a block is walked in STEPS_PER_BLOCK sub-tiles."""
    pointer = row_offsets + layout * stride_layout + row
    return tl.load(pointer) * STEPS_PER_BLOCK, tl.load(pointer + 1) * STEPS_PER_BLOCK


@triton.jit
def step_first(indices, step, STEPS_PER_BLOCK: tl.constexpr, BLOCK: tl.constexpr, TILE):
    """First row of a step's sub-tile: block indices[step // STEPS] of BLOCK rows, then TILE
    rows per step within it."""
    block = tl.load(indices + step // STEPS_PER_BLOCK)
    return block * BLOCK + (step % STEPS_PER_BLOCK) * TILE


@triton.jit
def kv_step(
    q_tile, k_source, v_source, col_indices, kv_block_positions, query_masks, step, kv_head,
    query_positions, query_first, query_last, query_documents, documents, stride_ks, stride_kh,
    stride_vs, stride_vh, key_end, qk_scale, window_left, window_right,
    STEPS_PER_BLOCK: tl.constexpr, Q_BLOCK: tl.constexpr, ROWS: tl.constexpr,
    KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    HAS_DOCUMENTS: tl.constexpr, HAS_POSITIONS: tl.constexpr, HAS_QUERY_MASKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """One step of a query program along its CSR row: the step's K and V tiles [BLOCK_N, D_PAD],
    its key positions [BLOCK_N] and the masked scores [BLOCK_M, BLOCK_N] in log2 units.
    Keys from position key_end on are masked and read as 0 (see padding_rows); with
    HAS_QUERY_MASKS, every key is masked for the rows (of a tile of ROWS positions) whose bit
    in the word of the step's block is unset."""
    key_row_first = step_first(col_indices, step, STEPS_PER_BLOCK, KV_BLOCK, BLOCK_N)
    key_rows = key_row_first + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    key_first, key_positions = global_positions(key_row_first, key_rows, KV_BLOCK,
                                                kv_block_positions, HAS_POSITIONS)  # fmt: skip
    key_valid = key_positions < key_end  # [BLOCK_N]
    k_tile = load_tile(k_source, key_row_first, key_rows, kv_head, key_valid, stride_ks,
                       stride_kh, HEAD_DIM, HEAD_DIM_PAD, TMA)  # fmt: skip  # [BLOCK_N, D_PAD]
    v_tile = load_tile(v_source, key_row_first, key_rows, kv_head, key_valid, stride_vs,
                       stride_vh, HEAD_DIM, HEAD_DIM_PAD, TMA)  # fmt: skip  # [BLOCK_N, D_PAD]
    scores = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION)
    scores *= qk_scale  # [BLOCK_M, BLOCK_N], log2 units
    query_mask = query_mask_word(query_masks, step // STEPS_PER_BLOCK, HAS_QUERY_MASKS)
    scores = mask_scores(
        scores, query_positions[:, None], key_positions[None, :], query_first, query_last,
        key_first, BLOCK_N, key_end, window_left, window_right, HAS_LEFT, HAS_RIGHT, documents,
        query_documents, HAS_DOCUMENTS, query_mask, Q_BLOCK, ROWS, HAS_QUERY_MASKS,
    )  # fmt: skip
    return k_tile, v_tile, key_positions, scores


# ---- masks, softmax statistics, dropout -------------------------------------------------------
@triton.jit
def documents_of(documents, positions, seq_len, HAS_DOCUMENTS: tl.constexpr):
    """Document ids of positions (-1 past seq_len); without documents, the positions
    themselves (never read)."""
    if HAS_DOCUMENTS:
        return tl.load(documents + positions, mask=positions < seq_len, other=-1)
    return positions


@triton.jit
def query_mask_word(query_masks, entry, HAS_QUERY_MASKS: tl.constexpr):
    """The int64 word of layout entry `entry` (bit r: row r of its query block reads its kv
    block), one load per block; without query masks 0, never read."""
    if HAS_QUERY_MASKS:
        return tl.load(query_masks + entry)
    return tl.full([], 0, tl.int64)


@triton.jit
def mask_scores(
    scores, query_positions, key_positions, query_first, query_last, key_first,
    KEY_ROWS: tl.constexpr, key_end, window_left, window_right, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, documents, query_documents, HAS_DOCUMENTS: tl.constexpr,
    query_mask, Q_BLOCK: tl.constexpr, QUERY_ROWS: tl.constexpr, HAS_QUERY_MASKS: tl.constexpr,
):  # fmt: skip
    """Set scores of keys a query must not see to -inf (reference.visible, plus keys from
    position key_end on, plus keys of another document when HAS_DOCUMENTS: `documents` points
    at this batch row's int32 [S] document ids, query_documents holds the queries'; plus, when
    HAS_QUERY_MASKS, every key for the queries whose bit (position % Q_BLOCK) in the block's
    word query_mask is unset). Whether the tile (queries [query_first, query_last], QUERY_ROWS
    of them, x KEY_ROWS keys from key_first) needs it at all is decided from its bounds and
    the word by scalar operations, so full tiles skip all element-mask work. Causal arrives
    folded into the right window (right = 0). Positions broadcast to the scores' shape:
    [M, 1] x [1, N] in the forward and dQ, [1, M] x [N, 1] in dK/dV."""
    key_last = key_first + KEY_ROWS - 1
    partial = key_last >= key_end
    if HAS_QUERY_MASKS:  # the tile's QUERY_ROWS bits of ~word, shifted to the top: 0 iff all set
        unread = ((~query_mask) >> (query_first % Q_BLOCK)) << (64 - QUERY_ROWS)
        partial = partial | (unread != 0)
    if HAS_RIGHT:
        partial = partial | (key_last > query_first + window_right)
    if HAS_LEFT:
        partial = partial | (key_first < query_last - window_left)
    if HAS_DOCUMENTS:  # documents are contiguous runs: one spans the tile iff its ends agree
        first = tl.minimum(query_first, key_first)
        last = tl.minimum(tl.maximum(query_last, key_last), key_end - 1)
        partial = partial | (tl.load(documents + first) != tl.load(documents + last))
    if partial:
        keep = key_positions < key_end
        if HAS_RIGHT:
            keep = keep & (key_positions <= query_positions + window_right)
        if HAS_LEFT:
            keep = keep & (key_positions >= query_positions - window_left)
        if HAS_DOCUMENTS:
            key_documents = documents_of(documents, key_positions, key_end, HAS_DOCUMENTS)
            keep = keep & (key_documents == query_documents)
        if HAS_QUERY_MASKS:
            keep = keep & (((query_mask >> (query_positions % Q_BLOCK)) & 1) != 0)
        scores = tl.where(keep, scores, float("-inf"))
    return scores


@triton.jit
def log2_lse(lse_base, lse_offsets, row_valid):
    """lse in log2 units [R]; +inf for rows that saw nothing (and padding rows), so that
    exp2(scores - lse) is 0 there instead of NaN."""
    lse = tl.load(lse_base + lse_offsets, mask=row_valid, other=float("inf"))  # [R]
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2_E)


@triton.jit
def dropout_scale(seed, batch, heads, query_positions, key_positions, dropout_p):
    """Inverted-dropout factor of each score: 0 where dropped, 1 / (1 - p) where kept.
    The bits come from Philox under `seed` with counter (key, query, head, batch), so the
    backward regenerates them exactly and no mask is stored. Positions and heads broadcast
    to the scores' shape."""
    zero = 0 * query_positions + 0 * key_positions  # [scores shape]
    keys = (key_positions + zero).to(tl.uint32)
    queries = (query_positions + zero).to(tl.uint32)
    head_ids = (heads + zero).to(tl.uint32)
    batch_ids = (batch + zero).to(tl.uint32)
    random, _, _, _ = tl.philox(seed, keys, queries, head_ids, batch_ids)
    keep = tl.uint_to_uniform_float(random) >= dropout_p
    return tl.where(keep, 1.0 / (1.0 - dropout_p), 0.0)


# ---- launch arguments (Python) ----------------------------------------------------------------
def strides(name: str, tensor: torch.Tensor, dims: str = "bsh") -> dict[str, int]:
    """Keyword strides of a kernel argument: strides("q", q) -> stride_q_b, stride_q_s,
    stride_q_h (the unit last stride is implied)."""
    return {f"stride_{name}_{dim}": tensor.stride(index) for index, dim in enumerate(dims)}


def layout_arguments(layout: BlockLayout, heads_q: int) -> dict[str, int]:
    """The layout row of (b, h) is b * layout_batch_stride + h // layout_head_divisor."""
    return dict(
        layout_batch_stride=layout.layout_heads if layout.layout_batch > 1 else 0,
        layout_head_divisor=heads_q // layout.layout_heads,
    )


def mask_arguments(causal: bool, window_size: tuple[int, int]) -> dict:
    """Causal is the right window 0 (j <= i); a negative bound is unbounded."""
    left, right = window_size
    if causal:
        right = 0  # j <= i and j <= i + right (right >= 0) is j <= i
    return dict(
        window_left=max(left, 0),
        window_right=max(right, 0),
        HAS_LEFT=left >= 0,
        HAS_RIGHT=right >= 0,
    )


def padding_rows(positions: BlockPositions | None, kv_block: int) -> bool:
    """Whether a K/V buffer of block positions may hold padding rows: the sequence ends inside
    a kv block, whose slot is whole. They may hold anything, even NaN, and must read as 0
    (a NaN value times a zero probability is NaN): pointer loads mask them, TMA would read
    them."""
    return positions is not None and positions.seq_len % kv_block != 0


def position_arguments(positions: BlockPositions | None, placeholder: torch.Tensor) -> dict:
    """Pointers, sequence length and flag of the optional block positions (int32 tensors);
    the placeholder stands in (never read) when there are none."""
    if positions is None:
        return dict(q_block_positions=placeholder, kv_block_positions=placeholder,
                    position_seq_len=0, HAS_POSITIONS=False)  # fmt: skip
    return dict(
        q_block_positions=positions.q_blocks, kv_block_positions=positions.kv_blocks,
        position_seq_len=positions.seq_len, HAS_POSITIONS=True,
    )  # fmt: skip


def query_mask_arguments(
    query_masks: QueryMasks | None, order: str, placeholder: torch.Tensor
) -> dict:
    """Pointer and flag of the optional query masks in the order a kernel walks the layout
    ("csr": rows, "csc": the transposed layout's rows); the placeholder stands in (never
    read) when there are none."""
    if query_masks is None:
        return dict(query_masks=placeholder, HAS_QUERY_MASKS=False)
    return dict(query_masks=getattr(query_masks, order), HAS_QUERY_MASKS=True)


def document_arguments(document_ids: torch.Tensor | None, placeholder: torch.Tensor) -> dict:
    """Pointer, batch stride and flag of the optional int32 [B, S] document ids; the
    placeholder stands in (never read) when there are none."""
    if document_ids is None:
        return dict(documents=placeholder, stride_documents_b=0, HAS_DOCUMENTS=False)
    return dict(
        documents=document_ids, **strides("documents", document_ids, "b"), HAS_DOCUMENTS=True
    )


def packing(layout: BlockLayout, max_rows: int, heads_q: int, heads_kv: int) -> configs.RowTile:
    """Query tile shape: heads packed together must share a kv head and a layout row."""
    shared_heads = math.gcd(heads_q // heads_kv, heads_q // layout.layout_heads)
    return configs.row_tile(layout.q_block, max_rows, shared_heads)


def tile_order(layout: BlockLayout, rows: int) -> torch.Tensor:
    """int32 [num_q_blocks * q_block // rows]: the query tiles of `rows` positions in the order
    of layout.heavy_rows_first() (tiles past the sequence end only write nothing); cached
    with the layout's row_offsets."""
    per_block = layout.q_block // rows

    def compute():
        within = torch.arange(per_block, device=layout.device)
        return (layout.heavy_rows_first()[:, None] * per_block + within).flatten().int()

    return derived_from(layout.row_offsets, ("tile_order", per_block), compute)


def use_tma(*tensors: torch.Tensor) -> bool:
    """Whether tiles can load through tensor descriptors (TMA): on Hopper and newer GPUs, and
    under the interpreter, when every tensor's base address and row strides are multiples of
    16 bytes, as TMA requires, and no dimension is broadcast (stride 0, e.g. an expanded dout)."""
    capability = _env.capability(tensors[0].device)
    if not (_env.interpreting() or (capability is not None and capability[0] >= 9)):
        return False
    return all(
        tensor.data_ptr() % 16 == 0
        and all(
            stride * tensor.element_size() % 16 == 0 and (stride > 0 or size == 1)
            for size, stride in zip(tensor.shape[:-1], tensor.stride()[:-1], strict=True)
        )
        for tensor in tensors
    )


def resolve_tma(tma: bool | None, *tensors: torch.Tensor, kv_padding: bool = False) -> bool:
    """The launchers' `tma` option: None uses TMA wherever use_tma allows and k, v hold no
    padding rows (kv_padding, see padding_rows); True asks for it and fails where it cannot
    work; False keeps pointer loads."""
    possible = use_tma(*tensors) and not kv_padding
    if tma and not possible:
        raise ValueError(
            "tma=True needs a Hopper GPU (or the interpreter), 16-byte aligned, non-broadcast "
            "strides and no padding rows in k, v (block positions of a sequence that ends "
            "inside a kv block); pass tma=None to fall back to pointer loads"
        )
    return possible if tma is None else tma


def config_arguments(config: triton.Config | None) -> dict:
    """Launch keywords of an explicit config (the launchers' `config` options), which then
    runs instead of the autotuned choice."""
    if config is None:
        return {}
    return dict(**config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


@contextlib.contextmanager
def descriptor_scratch(device: torch.device):
    """Descriptors made in a kernel live in global scratch memory that Triton asks its
    allocator for at launch: lend PyTorch's caching allocator, unless the caller has set an
    allocator. Set around each launch, on the launching thread (autograd's backward runs on
    its own)."""
    if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        yield
        return

    def allocate(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int8, device=device)

    token = _allocation._allocator.set(allocate)
    try:
        yield
    finally:
        _allocation._allocator.reset(token)
