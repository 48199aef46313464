"""Block-sparse attention forward: FlashAttention-2 over the active blocks of a BlockLayout.

One program owns a query tile of ROWS positions x PACK query heads (PACK > 1 packs the
heads of a GQA group that share a layout row, so each K/V tile is loaded once for all of
them) and walks that q block's CSR row: only active blocks cost work. Online softmax in
fp32 with exp2; element masks (causal, window, ragged kv end) only on partial tiles.
On Hopper, K/V tiles (and unpacked query tiles) load through 2-D tensor descriptors (TMA)
built by each program; elsewhere through pointers (use_tma decides).

The jit helpers here (tile rows, masks, loads, launch arguments) are shared with the
backward kernels.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from flash_msa.layout import BlockLayout
from flash_msa.ops.triton import configs

LOG2_E = 1.4426950408889634
LN_2: tl.constexpr = tl.constexpr(0.6931471805599453)


# ---- shared jit helpers ------------------------------------------------------------------
@triton.jit
def _packed_rows(first_position, first_head, ROWS: tl.constexpr, PACK: tl.constexpr):
    """Positions and query heads of the BLOCK_M = ROWS * PACK rows of a packed tile.

    Heads vary fastest: the PACK heads of one position are adjacent in memory ([S, H, D]).
    """
    rows = tl.arange(0, ROWS * PACK)  # [BLOCK_M]
    return first_position + rows // PACK, first_head + rows % PACK  # [BLOCK_M], [BLOCK_M]


@triton.jit
def _row_offsets(positions, heads, stride_s, stride_h):
    """int64 element offsets of (position, head) rows: S * H * D may pass 2^31."""
    return positions.to(tl.int64) * stride_s + heads.to(tl.int64) * stride_h  # [R]


@triton.jit
def _load_rows(base, row_offsets, row_valid, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Load a [R, HEAD_DIM_PAD] tile; invalid rows and padded dims read as 0."""
    dims = tl.arange(0, HEAD_DIM_PAD)  # [D_PAD]
    mask = row_valid[:, None] & (dims[None, :] < HEAD_DIM)  # [R, D_PAD]
    return tl.load(base + row_offsets[:, None] + dims[None, :], mask=mask, other=0.0)


@triton.jit
def _tile_source(
    base, head, stride_s, stride_h, seq_len, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """Where a program's [ROWS, D_PAD] tiles of one head come from; base points at this batch
    row of a [B, S, H, D] tensor. TMA: a 2-D [S, D] tensor descriptor of the head, built on
    the device once per program outside the loops (rows past S and dims past D read as 0);
    otherwise base itself, for _load_tile's pointer loads."""
    if TMA:
        return tl.make_tensor_descriptor(
            base + head.to(tl.int64) * stride_h, shape=[seq_len, HEAD_DIM], strides=[stride_s, 1],
            block_shape=[ROWS, HEAD_DIM_PAD],
        )  # fmt: skip
    else:
        return base


@triton.jit
def _load_tile(
    source, first_position, positions, heads, row_valid, stride_s, stride_h,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """[R, D_PAD] tile of the rows (positions, heads) from a _tile_source; with TMA those are
    the R positions from first_position of the source's head. Invalid rows read as 0."""
    if TMA:
        return source.load([first_position, 0])
    else:
        rows = _row_offsets(positions, heads, stride_s, stride_h)  # [R]
        return _load_rows(source, rows, row_valid, HEAD_DIM, HEAD_DIM_PAD)


@triton.jit
def _store_rows(
    base, row_offsets, row_valid, tile, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr
):
    """Store a [R, HEAD_DIM_PAD] tile, cast to the buffer's dtype, skipping padding."""
    dims = tl.arange(0, HEAD_DIM_PAD)  # [D_PAD]
    mask = row_valid[:, None] & (dims[None, :] < HEAD_DIM)  # [R, D_PAD]
    tl.store(base + row_offsets[:, None] + dims[None, :], tile.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _documents_of(documents, positions, seq_len, HAS_DOCUMENTS: tl.constexpr):
    """Document ids of positions (-1 past seq_len); without documents, the positions
    themselves (never read)."""
    if HAS_DOCUMENTS:
        return tl.load(documents + positions, mask=positions < seq_len, other=-1)
    return positions


@triton.jit
def _dropout_scale(seed, batch, heads, query_positions, key_positions, dropout_p):
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


@triton.jit
def _mask_scores(
    scores,
    query_positions,
    key_positions,
    query_first,
    query_last,
    key_first,
    KEY_ROWS: tl.constexpr,
    seq_len_kv,
    window_left,
    window_right,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    documents,
    query_documents,
    HAS_DOCUMENTS: tl.constexpr,
):
    """Set scores of keys a query must not see to -inf (reference.visible, plus keys past
    seq_len_kv, plus keys of another document when HAS_DOCUMENTS: `documents` points at
    this batch row's int32 [S] document ids, query_documents holds the queries'). Whether
    the tile (queries [query_first, query_last] x KEY_ROWS keys from key_first) needs it at
    all is decided from its bounds by scalar comparisons, so full tiles skip all
    element-mask work. Causal arrives folded into the right window
    (right = 0). Positions broadcast to the scores' shape: [M, 1] x [1, N] in the forward
    and dQ, [1, M] x [N, 1] in dK/dV."""
    key_last = key_first + KEY_ROWS - 1
    partial = key_last >= seq_len_kv
    if HAS_RIGHT:
        partial = partial | (key_last > query_first + window_right)
    if HAS_LEFT:
        partial = partial | (key_first < query_last - window_left)
    if HAS_DOCUMENTS:  # documents are contiguous runs: one spans the tile iff its ends agree
        first = tl.minimum(query_first, key_first)
        last = tl.minimum(tl.maximum(query_last, key_last), seq_len_kv - 1)
        partial = partial | (tl.load(documents + first) != tl.load(documents + last))
    if partial:
        keep = key_positions < seq_len_kv
        if HAS_RIGHT:
            keep = keep & (key_positions <= query_positions + window_right)
        if HAS_LEFT:
            keep = keep & (key_positions >= query_positions - window_left)
        if HAS_DOCUMENTS:
            key_documents = _documents_of(documents, key_positions, seq_len_kv, HAS_DOCUMENTS)
            keep = keep & (key_documents == query_documents)
        scores = tl.where(keep, scores, float("-inf"))
    return scores


@triton.jit
def _row_steps(row_offsets, layout, stride_layout, row, STEPS_PER_BLOCK: tl.constexpr):
    """[start, end) steps of a CSR row; a block is walked in STEPS_PER_BLOCK sub-tiles."""
    pointer = row_offsets + layout * stride_layout + row
    return tl.load(pointer) * STEPS_PER_BLOCK, tl.load(pointer + 1) * STEPS_PER_BLOCK


@triton.jit
def _step_first(indices, step, STEPS_PER_BLOCK: tl.constexpr, BLOCK: tl.constexpr, TILE):
    """First position of a step's sub-tile: block indices[step // STEPS] of BLOCK positions,
    then TILE positions per step within it."""
    block = tl.load(indices + step // STEPS_PER_BLOCK)
    return block * BLOCK + (step % STEPS_PER_BLOCK) * TILE


# ---- forward kernel ----------------------------------------------------------------------
@triton.jit
def _forward_kernel(
    q,
    k,
    v,
    out,
    lse,
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
    """Grid (num_q_blocks * Q_BLOCK // ROWS, H_q // PACK, B); tile_order maps program 0..
    to the query tile it runs (heavy rows first). qk_scale = softmax_scale * log2(e).
    TMA: K/V tiles (and unpacked Q tiles) load through tensor descriptors."""
    tile = tl.load(tile_order + tl.program_id(0))
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
    documents += batch * stride_documents_b
    query_documents = _documents_of(documents, positions, seq_len_q, HAS_DOCUMENTS)[:, None]

    k_source = _tile_source(k + batch * stride_kb, kv_head, stride_ks, stride_kh, seq_len_kv,
                            HEAD_DIM, BLOCK_N, HEAD_DIM_PAD, TMA)  # fmt: skip
    v_source = _tile_source(v + batch * stride_vb, kv_head, stride_vs, stride_vh, seq_len_kv,
                            HEAD_DIM, BLOCK_N, HEAD_DIM_PAD, TMA)  # fmt: skip
    key_range = tl.arange(0, BLOCK_N)  # [BLOCK_N]

    # The group's heads in this tile share one layout row (PACK > 1 only if they do).
    layout = batch * layout_batch_stride + first_head // layout_head_divisor
    steps_per_block: tl.constexpr = KV_BLOCK // BLOCK_N
    step_start, step_end = _row_steps(
        row_offsets, layout, stride_layout, query_first // Q_BLOCK, steps_per_block
    )

    row_max = tl.full([ROWS * PACK], float("-inf"), tl.float32)  # [BLOCK_M], log2 units
    row_sum = tl.zeros([ROWS * PACK], tl.float32)  # [BLOCK_M]
    acc = tl.zeros([ROWS * PACK, HEAD_DIM_PAD], tl.float32)  # [BLOCK_M, D_PAD]
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
        new_max = tl.maximum(row_max, tl.max(scores, 1))  # [BLOCK_M]
        # A row with nothing visible yet keeps max -inf; shift it by 0 so exp2 gives 0, not NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # [BLOCK_M]
        probs = tl.math.exp2(scores - shift[:, None])  # [BLOCK_M, BLOCK_N]
        rescale = tl.math.exp2(row_max - shift)  # [BLOCK_M]
        row_sum = row_sum * rescale + tl.sum(probs, 1)  # [BLOCK_M]
        acc = acc * rescale[:, None]  # [BLOCK_M, D_PAD]
        if HAS_DROPOUT:  # the normaliser row_sum keeps every probability
            probs *= _dropout_scale(
                dropout_seed, batch, heads[:, None], positions[:, None],
                (key_first + key_range)[None, :], dropout_p,
            )  # fmt: skip
        acc = tl.dot(probs.to(v_tile.dtype), v_tile, acc, input_precision=DOT_PRECISION)
        row_max = new_max

    empty = row_sum == 0.0  # [BLOCK_M] rows that saw no key: out 0, lse -inf
    safe_sum = tl.where(empty, 1.0, row_sum)  # [BLOCK_M]
    acc = acc / safe_sum[:, None]  # [BLOCK_M, D_PAD]
    o_rows = _row_offsets(positions, heads, stride_os, stride_oh)  # [BLOCK_M]
    _store_rows(out + batch * stride_ob, o_rows, row_valid, acc, HEAD_DIM, HEAD_DIM_PAD)
    log_sum = tl.where(empty, float("-inf"), (row_max + tl.math.log2(safe_sum)) * LN_2)
    lse_offsets = heads.to(tl.int64) * stride_lse_h + positions  # [BLOCK_M]
    tl.store(lse + batch * stride_lse_b + lse_offsets, log_sum, mask=row_valid)


# ---- launch helpers (shared with backward.py) ------------------------------------------------
def last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The kernels index rows by stride but read each row's D values contiguously."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def layout_arguments(layout: BlockLayout, heads_q: int, heads_kv: int) -> tuple[int, int]:
    """(layout_batch_stride, layout_head_divisor): layout of (b, h) = b * stride + h // divisor."""
    batch_stride = layout.layout_heads if layout.layout_batch > 1 else 0
    return batch_stride, heads_q // layout.layout_heads


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


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (tests want < 1e-4); fp16/bf16 ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def head_dim_pad(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def packing(layout: BlockLayout, block: int, max_rows: int, heads_q: int, heads_kv: int):
    """Query tile shape: heads packed together must share a kv head and a layout row."""
    shared_heads = math.gcd(heads_q // heads_kv, heads_q // layout.layout_heads)
    return configs.row_tile(block, max_rows, shared_heads)


AUTOTUNE_KEY = [
    "HEAD_DIM_PAD", "Q_BLOCK", "KV_BLOCK", "ROWS", "PACK", "HAS_LEFT", "HAS_RIGHT", "HAS_DOCUMENTS",
    "HAS_DROPOUT", "TMA",
]  # fmt: skip


def use_tma(*tensors: torch.Tensor) -> bool:
    """Whether tiles load through tensor descriptors (TMA): on Hopper and newer GPUs, and under
    the interpreter, when every tensor's base address and row strides are multiples of 16
    bytes, as TMA requires, and no dimension is broadcast (stride 0, e.g. an expanded dout)."""
    first = tensors[0]
    on_hopper = first.is_cuda and torch.cuda.get_device_capability(first.device)[0] >= 9
    if not (on_hopper or configs.interpreting()):
        return False
    return all(
        tensor.data_ptr() % 16 == 0
        and all(
            stride * tensor.element_size() % 16 == 0 and (stride > 0 or size == 1)
            for size, stride in zip(tensor.shape[:-1], tensor.stride()[:-1], strict=True)
        )
        for tensor in tensors
    )


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


def tile_order(layout: BlockLayout, rows: int) -> torch.Tensor:
    """int32 [num_q_blocks * q_block // rows]: the query tiles of `rows` positions in the order
    of layout.heavy_rows_first() (tiles past the sequence end only write nothing)."""
    per_block = layout.q_block // rows
    within = torch.arange(per_block, device=layout.device)
    return (layout.heavy_rows_first()[:, None] * per_block + within).flatten().int()


def document_arguments(document_ids: torch.Tensor | None, placeholder: torch.Tensor):
    """(pointer, batch stride, HAS_DOCUMENTS) of the optional int [B, S] document ids; the
    placeholder stands in (never read) when there are none."""
    if document_ids is None:
        return placeholder, 0, False
    documents = document_ids.to(torch.int32).contiguous()
    return documents, documents.stride(0), True


@functools.cache
def _tuned_forward(head_dim_padded: int, kv_block: int):
    configs_list = configs.forward_configs(head_dim_padded, kv_block)
    return triton.autotune(configs=configs_list, key=AUTOTUNE_KEY)(_forward_kernel)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, S_q, H_q, D], k/v [B, S_kv, H_kv, D] -> out like q, lse fp32 [B, H_q, S_q].
    document_ids int [B, S] (S_q == S_kv): keys of another document are never seen.
    dropout_p > 0 drops probabilities by Philox bits under dropout_seed (dropout.py)."""
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    batch, seq_len_q, heads_q, head_dim = q.shape
    heads_kv = k.shape[2]
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, heads_q, seq_len_q, dtype=torch.float32, device=q.device)
    padded = head_dim_pad(head_dim)
    max_rows = configs.max_query_rows(padded, "forward")
    tile = packing(layout, layout.q_block, max_rows, heads_q, heads_kv)
    layout_batch_stride, layout_head_divisor = layout_arguments(layout, heads_q, heads_kv)
    row_offsets = layout.row_offsets.contiguous()
    documents, stride_documents, has_documents = document_arguments(document_ids, row_offsets)
    order = tile_order(layout, tile.rows)
    grid = (order.numel(), heads_q // tile.pack, batch)
    with descriptor_scratch(q.device):
        _tuned_forward(padded, layout.kv_block)[grid](
            q, k, v, out, lse, row_offsets, layout.col_indices, order,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
            lse.stride(0), lse.stride(1), documents, stride_documents, dropout_p, dropout_seed,
            row_offsets.stride(0),
            seq_len_q, k.shape[1], heads_q // heads_kv, layout_batch_stride, layout_head_divisor,
            softmax_scale * LOG2_E,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=padded, Q_BLOCK=layout.q_block,
            KV_BLOCK=layout.kv_block, ROWS=tile.rows, PACK=tile.pack,
            DOT_PRECISION=dot_precision(q.dtype), TMA=use_tma(q, k, v),
            HAS_DOCUMENTS=has_documents, HAS_DROPOUT=dropout_p > 0,
            **mask_arguments(causal, window_size),
        )  # fmt: skip
    return out, lse
