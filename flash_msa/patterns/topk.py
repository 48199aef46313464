"""Top-k layout from block scores (learned or heuristic selection).

Query block b has its diagonal kv block d(b) = (min((b + 1) * q_block, S_q) - 1) // kv_block,
the block of its last query and the last holding a causal pair. With q_blocks (context
parallelism: some query blocks of a sequence of S_kv tokens) row i is global query block
q_blocks[i], its diagonal d(q_blocks[i]) with S_kv as the length. Scores are ranked through
int64 keys, distinct within a row and ordered as (score, -column), so ties go to the lower
block index whatever order the device's top-k returns equal values in.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from flash_msa.layout import BlockLayout, layout_device
from flash_msa.patterns._build import (
    check_flags,
    diagonal_total,
    diagonals,
    fixed_rows,
    grid_meta,
    is_int,
)

CHUNK_ELEMENTS = 1 << 26  # scores ranked at a time: 512 MiB of int64 keys
_INT64_MAX = torch.iinfo(torch.int64).max
_INT64_MIN = torch.iinfo(torch.int64).min
_NAN_BITS = torch.iinfo(torch.int32).max  # ordered bits of every NaN: above +inf (0x7F800000)
_MINUS_INF_BITS = -(0x7F800000 + 1)  # ordered bits of -inf: 0xFF800000 with bits 0-30 flipped
MAX_KERNEL_PICKS = 64  # blocks a row keeps that _top_blocks_kernel ranks (its tiles' top-k)
_RANK_TILE = 1024  # scores a program of _top_blocks_kernel ranks at a time


def _ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys, one per score of scores [..., nk]: an int32 whose order is the float32
    order (every NaN above +inf), shifted above the reversed column index."""
    # + 0.0 turns -0.0 into +0.0: equal scores must get equal bits.
    scores = scores.float() + 0.0
    bits = scores.view(torch.int32)
    # Negative floats order backwards as integers; flipping all but the sign bit fixes that.
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).masked_fill(scores.isnan(), _NAN_BITS)
    num_kv_blocks = scores.shape[-1]
    reversed_index = num_kv_blocks - 1 - torch.arange(num_kv_blocks, device=scores.device)
    return ordered.long() * (1 << 32) + reversed_index


@triton.jit
def _top_blocks_kernel(scores, diagonal, chosen, num_kv_blocks, stride_l, stride_r,
                       PICKS: tl.constexpr, TILE: tl.constexpr, CAUSAL: tl.constexpr,
                       INCLUDE_DIAGONAL: tl.constexpr):  # fmt: skip
    """Grid (nq, L): the PICKS best columns of row r of layout l's scores [L, nq, nk] (last
    stride 1), best first, into chosen [L, nq, PICKS] (contiguous), in _ordered_keys' order:
    the diagonal first with INCLUDE_DIAGONAL, no column past it with CAUSAL. Slots past the
    row's candidates hold columns of no meaning (the caller drops them). A running top-PICKS
    over tiles of TILE scores up to the last candidate, of int64 keys (the score's ordered
    int32 bits, offset to be non-negative, times 2^31, plus the reversed column), where NaN
    ranks above +inf and the kept diagonal above NaN."""
    row = tl.program_id(0)
    layout = tl.program_id(1)
    base = scores + layout.to(tl.int64) * stride_l + row.to(tl.int64) * stride_r
    kept = tl.load(diagonal + row)
    last = tl.minimum(kept, num_kv_blocks - 1) if CAUSAL else num_kv_blocks - 1
    best = tl.full([PICKS], -1, tl.int64)  # [PICKS]: below every candidate's key
    for start in range(0, last + 1, TILE):
        columns = start + tl.arange(0, TILE)  # [TILE]
        candidate = columns <= last
        values = tl.load(base + columns, mask=candidate, other=0.0).to(tl.float32)
        bits = tl.where(values == 0.0, 0, values.to(tl.int32, bitcast=True))  # -0.0 as 0.0
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        ordered = tl.where(values != values, 0x7FFFFFFE, ordered)  # NaN above +inf
        if INCLUDE_DIAGONAL:
            ordered = tl.where(columns == kept, 0x7FFFFFFF, ordered)
        keys = (ordered.to(tl.int64) + 2**31) * 2**31 + (num_kv_blocks - 1 - columns)
        keys = tl.where(candidate, keys, -1)  # [TILE]
        both = tl.reshape(tl.join(best, tl.topk(keys, PICKS)), [2 * PICKS])
        best = tl.topk(both, PICKS)  # [PICKS], descending
    out = chosen + (layout.to(tl.int64) * tl.num_programs(0) + row) * PICKS
    tl.store(out + tl.arange(0, PICKS), num_kv_blocks - 1 - (best & (2**31 - 1)))


def _rank_in_kernel(scores: torch.Tensor, picks: int) -> bool:
    """Whether _top_blocks_kernel ranks topk's scores (fixed_counts): on CUDA tensors, for at
    most MAX_KERNEL_PICKS blocks a row, outside torch.compile's tracing (which takes the
    torch ranking). The CPU ranks with torch.topk (Triton's interpreter would take seconds
    over the kernel)."""
    return (scores.device.type == "cuda" and picks <= MAX_KERNEL_PICKS
            and not torch.compiler.is_compiling())  # fmt: skip


def kernel_tiles(picks: int, num_kv_blocks: int) -> tuple[int, int]:
    """(PICKS, TILE) of the _top_blocks_kernel launch that ranks `picks` blocks a row of
    num_kv_blocks scores: powers of two, PICKS at least 2 (tl.topk of one element does not
    compile for the GPU: its last max reduces the tile to a scalar) and TILE at least PICKS."""
    slots = max(2, triton.next_power_of_2(picks))
    return slots, max(slots, min(_RANK_TILE, triton.next_power_of_2(num_kv_blocks)))


def _top_blocks(scores: torch.Tensor, diagonal: torch.Tensor, picks: int, *, causal: bool,
                include_diagonal: bool) -> torch.Tensor:  # fmt: skip
    """int64 [L, nq, picks]: each row's best columns of scores [L, nq, nk] from
    _top_blocks_kernel (topk's torch ranking, in one launch)."""
    num_layouts, num_q_blocks, num_kv_blocks = scores.shape
    scores = scores.contiguous()
    slots, tile = kernel_tiles(picks, num_kv_blocks)
    chosen = torch.empty(num_layouts, num_q_blocks, slots, dtype=torch.int64,
                         device=scores.device)  # fmt: skip
    if chosen.numel():
        _top_blocks_kernel[(num_q_blocks, num_layouts)](
            scores=scores, diagonal=diagonal, chosen=chosen,
            num_kv_blocks=num_kv_blocks, stride_l=scores.stride(0), stride_r=scores.stride(1),
            PICKS=slots, TILE=tile, CAUSAL=causal, INCLUDE_DIAGONAL=include_diagonal,
        )  # fmt: skip
    return chosen[..., :picks]


def check_query_blocks(
    q_blocks, *, seq_len_q: int, seq_len: int, q_block: int, device
) -> torch.Tensor:
    """Check q_blocks, the global query block of each local block of q_block rows (a rank's
    query rows in context parallelism), and return it as int64.

    The seq_len_q local rows sit back to back: local block i holds rows [i * q_block,
    min((i + 1) * q_block, seq_len_q)), global positions q_blocks[i] * q_block onward in a
    sequence of seq_len tokens. So every local block is whole but a last one that is the
    ragged global last block. Its values are checked with one read from the device, but not
    while torch.compile traces (where nothing is read).

    Args:
        q_blocks: int [ceil(seq_len_q / q_block)] on device, any order.
        seq_len_q, seq_len: local rows and global tokens; q_block: the block size.

    Returns:
        q_blocks as int64.
    """
    if not isinstance(q_blocks, torch.Tensor):
        raise TypeError(f"q_blocks must be a torch.Tensor, got {type(q_blocks).__name__}")
    if q_blocks.is_floating_point() or q_blocks.is_complex() or q_blocks.dtype == torch.bool:
        raise TypeError(
            f"q_blocks must hold integer block indices, got {q_blocks.dtype}; convert with .int()"
        )
    if q_blocks.device != device:
        raise ValueError(f"q_blocks is on {q_blocks.device} but the tensors on {device}; move it")
    num_local = math.ceil(seq_len_q / q_block)
    if tuple(q_blocks.shape) != (num_local,):
        raise ValueError(
            f"q_blocks must be 1-D with the global block of each local query block: "
            f"{num_local} for {seq_len_q} local rows in blocks of {q_block}, got shape "
            f"{list(q_blocks.shape)}"
        )
    q_blocks = q_blocks.long()
    if num_local == 0 or torch.compiler.is_compiling():  # torch.compile traces no values
        return q_blocks
    local = torch.arange(num_local, device=device)
    local_rows = (seq_len_q - local * q_block).clamp(max=q_block)  # [num_local]
    global_rows = (seq_len - q_blocks * q_block).clamp(max=q_block)  # [num_local]
    first_mismatch = torch.where(local_rows != global_rows, local, num_local).min()
    low, high, mismatch = torch.stack([q_blocks.min(), q_blocks.max(), first_mismatch]).tolist()
    count = math.ceil(seq_len / q_block)
    if low < 0 or high >= count:
        raise ValueError(
            f"q_blocks must lie in [0, {count}) (the {q_block}-token query blocks of "
            f"seq_len={seq_len}), got values from {low} to {high}"
        )
    if mismatch < num_local:
        raise ValueError(
            f"local query block {mismatch} holds {int(local_rows[mismatch])} rows but global "
            f"query block {int(q_blocks[mismatch])} of seq_len={seq_len} has "
            f"{int(global_rows[mismatch])}: each local block holds its global block's rows "
            f"(whole blocks of {q_block}; the ragged global last block only as the last one)"
        )
    return q_blocks


def _ranked_by_torch(scores: torch.Tensor, diagonal: torch.Tensor, picks: int, *, causal: bool,
                     include_diagonal: bool, fixed_counts: bool,
                     chunk_elements: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(chosen int64 [L, nq, picks], best first, whether a candidate score is NaN) of scores
    [L, nq, nk] through torch.topk over _ordered_keys, rows in chunks so that the int64 keys
    and their temporaries stay near chunk_elements each; without fixed_counts the slots of
    -inf scores hold nk."""
    num_layouts, num_q_blocks, num_kv_blocks = scores.shape
    columns = torch.arange(num_kv_blocks, device=scores.device)
    # Keys above this belong to scores > -inf (or the kept diagonal).
    minus_inf = _MINUS_INF_BITS * (1 << 32) + num_kv_blocks - 1
    nan_found = torch.zeros((), dtype=torch.bool, device=scores.device)
    rows_per_chunk = max(1, chunk_elements // (num_layouts * num_kv_blocks))
    chosen = []
    for first in range(0, num_q_blocks, rows_per_chunk):
        rows = slice(first, first + rows_per_chunk)
        keys = _ordered_keys(scores[:, rows])  # [L, rows, nk]
        if causal:
            keys.masked_fill_(columns > diagonal[rows, None], _INT64_MIN)
        if include_diagonal:
            keys.masked_fill_(columns == diagonal[rows, None], _INT64_MAX)
        values, indices = keys.topk(picks, dim=-1)  # [L, rows, picks], best first
        if not fixed_counts:
            nan_found |= ((keys >= _NAN_BITS * (1 << 32)) & (keys < _INT64_MAX)).any()
            indices = indices.masked_fill(values <= minus_inf, num_kv_blocks)
        chosen.append(indices)
    return torch.cat(chosen, dim=1), nan_found


def topk(
    block_scores: torch.Tensor,
    k: int,
    *,
    seq_len_q: int,
    seq_len_kv: int | None = None,
    include_diagonal: bool = True,
    causal: bool = True,
    block_size: int = 128,
    q_block: int | None = None,
    kv_block: int | None = None,
    fixed_counts: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
    q_blocks: torch.Tensor | None = None,
    device=None,
) -> BlockLayout:
    """The k highest-scoring blocks of each row (ties to the lower block index).

    With causal, blocks past the diagonal d(b) are never chosen; include_diagonal keeps d(b)
    as one of the k. Otherwise:
    - fixed_counts=False: blocks scored -inf are never chosen, and NaN raises ValueError
      (one host synchronisation, as the number of blocks depends on the scores).
    - fixed_counts=True: every row keeps exactly min(k, candidates) blocks (candidates =
      d(b) + 1 with causal, nk otherwise), -inf included, NaN ranked above every number.
      nnz follows from the geometry: no host synchronisation, no data-dependent shape, so
      torch.compile(fullgraph=True) traces it. With causal and include_diagonal this is
      MSA's selection (the diagonal plus the k - 1 best earlier blocks).
    With q_blocks, its checks read it once from the device (not under torch.compile), and
    fixed_counts with causal reads the sum of the rows' counts: nnz then depends on which
    global blocks the rows are, so this host synchronisation, on q_blocks and not on the
    scores, is unavoidable.

    Args:
        block_scores: float32, float16 or bfloat16 [nq, nk], [H, nq, nk] or [B, H, nq, nk].
        k: blocks per row (larger than nk: all of them).
        seq_len_q, seq_len_kv: tokens of queries and keys (seq_len_kv defaults to seq_len_q).
        block_size: q_block and kv_block when they are not given.
        chunk_elements: scores ranked at a time (their int64 keys and temporaries are the
            memory the ranking takes; whole rows, at least one).
        q_blocks: int [nq] on block_scores' device, or None (rows 0, 1, ...): the global query
            block of each row, in a sequence of seq_len_kv tokens of which the rows hold
            seq_len_q (only a last row may be short, and then it is the ragged global last
            block; see check_query_blocks). The layout is then the rows q_blocks of the
            layout the whole sequence's scores give, seq_len_q its query length.

    Returns:
        A BlockLayout with layout_batch and layout_heads from block_scores' leading sizes.
    """
    meta = grid_meta(
        block_scores, "block_scores", seq_len_q, seq_len_kv, block_size, q_block, kv_block
    )
    if block_scores.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(
            f"block_scores must be floating point (float32, float16 or bfloat16), got "
            f"{block_scores.dtype}; ranking is exact in float32, convert with .float()"
        )
    if not is_int(k) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    check_flags(include_diagonal=include_diagonal, causal=causal, fixed_counts=fixed_counts)
    if not is_int(chunk_elements) or chunk_elements < 1:
        raise ValueError(f"chunk_elements must be a positive int, got {chunk_elements!r}")
    device = layout_device(device)
    if q_blocks is not None:
        q_blocks = check_query_blocks(
            q_blocks, seq_len_q=meta["seq_len_q"], seq_len=meta["seq_len_kv"],
            q_block=meta["q_block"], device=block_scores.device,
        )  # fmt: skip
    scores = block_scores.to(device) if device is not None else block_scores
    num_q_blocks, num_kv_blocks = scores.shape[-2:]
    scores = scores.reshape(-1, num_q_blocks, num_kv_blocks)  # [L, nq, nk]
    num_layouts = scores.shape[0]
    if q_blocks is None:
        diagonal = diagonals(torch.arange(num_q_blocks, device=scores.device), meta)  # [nq]
    else:  # global blocks of the seq_len_kv-token sequence
        diagonal = diagonals(q_blocks.to(scores.device), dict(meta, seq_len_q=meta["seq_len_kv"]))
    picks = min(k, num_kv_blocks)
    ranking = dict(causal=causal, include_diagonal=include_diagonal, chunk_elements=chunk_elements)
    if not fixed_counts:
        chosen, nan_found = _ranked_by_torch(scores, diagonal, picks, **ranking, fixed_counts=False)
        if bool(nan_found):
            raise ValueError(
                "block_scores contains NaN; replace it (e.g. with -inf to exclude a block)"
            )
        chosen = chosen.sort(dim=-1).values  # the dropped blocks (nk) last
        flat_rows = torch.arange(num_layouts * num_q_blocks, device=scores.device)
        keys = flat_rows.view(num_layouts, num_q_blocks, 1) * num_kv_blocks + chosen
        return BlockLayout.from_keys(keys[chosen < num_kv_blocks], **meta, validate=False)

    if _rank_in_kernel(scores, picks):
        chosen = _top_blocks(scores, diagonal, picks, causal=causal,
                             include_diagonal=include_diagonal)  # fmt: skip
    else:
        chosen = _ranked_by_torch(scores, diagonal, picks, **ranking, fixed_counts=True)[0]
    if causal:
        counts = (diagonal + 1).clamp(max=picks)  # [nq]
        per_layout = diagonal_total(meta, picks) if q_blocks is None else int(counts.sum())
    else:
        counts = torch.full_like(diagonal, picks)
        per_layout = num_q_blocks * picks
    # Slots past a row's count hold ignored blocks: push them to the end, then sort ascending.
    beyond = torch.arange(picks, device=scores.device) >= counts[:, None]  # [nq, picks]
    chosen = chosen.masked_fill(beyond, num_kv_blocks).sort(dim=-1).values
    row_offsets, rows, slots = fixed_rows(counts, num_layouts, per_layout)
    col_indices = chosen.reshape(-1, picks)[rows, slots]  # [nnz]
    return BlockLayout(row_offsets.int(), col_indices.int(), **meta, validate=False)
