"""Top-k layout from block scores (learned or heuristic selection).

Query block b has its diagonal kv block d(b) = (min((b + 1) * q_block, S_q) - 1) // kv_block,
the block of its last query and the last holding a causal pair. Scores are ranked through
int64 keys, distinct within a row and ordered as (score, -column), so ties go to the lower
block index whatever order the device's top-k returns equal values in.
"""

from __future__ import annotations

import torch

from flash_msa.layout import BlockLayout
from flash_msa.patterns._build import diagonal_total, diagonals, fixed_rows, grid_meta, is_int

CHUNK_ELEMENTS = 1 << 26  # scores ranked at a time: 512 MiB of int64 keys
_INT64_MAX = torch.iinfo(torch.int64).max
_INT64_MIN = torch.iinfo(torch.int64).min
_NAN_BITS = torch.iinfo(torch.int32).max  # ordered bits of every NaN: above +inf (0x7F800000)
_MINUS_INF_BITS = -(0x7F800000 + 1)  # ordered bits of -inf: 0xFF800000 with bits 0-30 flipped


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

    Args:
        block_scores: float32, float16 or bfloat16 [nq, nk], [H, nq, nk] or [B, H, nq, nk].
        k: blocks per row (larger than nk: all of them).
        seq_len_q, seq_len_kv: tokens of queries and keys (seq_len_kv defaults to seq_len_q).
        block_size: q_block and kv_block when they are not given.
        chunk_elements: scores ranked at a time (their int64 keys and temporaries are the
            memory the ranking takes; whole rows, at least one).

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
    scores = block_scores.to(device) if device is not None else block_scores
    num_q_blocks, num_kv_blocks = scores.shape[-2:]
    scores = scores.reshape(-1, num_q_blocks, num_kv_blocks)  # [L, nq, nk]
    num_layouts = scores.shape[0]
    diagonal = diagonals(torch.arange(num_q_blocks, device=scores.device), meta)  # [nq]
    columns = torch.arange(num_kv_blocks, device=scores.device)
    picks = min(k, num_kv_blocks)
    # Keys above this belong to scores > -inf (or the kept diagonal).
    minus_inf = _MINUS_INF_BITS * (1 << 32) + num_kv_blocks - 1
    nan_found = torch.zeros((), dtype=torch.bool, device=scores.device)
    # Rows in chunks: the int64 keys and their temporaries stay near chunk_elements each.
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
    chosen = torch.cat(chosen, dim=1)  # [L, nq, picks]

    if not fixed_counts:
        if bool(nan_found):
            raise ValueError(
                "block_scores contains NaN; replace it (e.g. with -inf to exclude a block)"
            )
        chosen = chosen.sort(dim=-1).values  # the dropped blocks (nk) last
        flat_rows = torch.arange(num_layouts * num_q_blocks, device=scores.device)
        keys = flat_rows.view(num_layouts, num_q_blocks, 1) * num_kv_blocks + chosen
        return BlockLayout.from_keys(keys[chosen < num_kv_blocks], **meta)

    if causal:
        counts = (diagonal + 1).clamp(max=picks)  # [nq]
        per_layout = diagonal_total(meta, picks)
    else:
        counts = torch.full_like(diagonal, picks)
        per_layout = num_q_blocks * picks
    # Slots past a row's count hold ignored blocks: push them to the end, then sort ascending.
    beyond = torch.arange(picks, device=scores.device) >= counts[:, None]  # [nq, picks]
    chosen = chosen.masked_fill(beyond, num_kv_blocks).sort(dim=-1).values
    row_offsets, rows, slots = fixed_rows(counts, num_layouts, per_layout)
    col_indices = chosen.reshape(-1, picks)[rows, slots]  # [nnz]
    return BlockLayout(row_offsets.int(), col_indices.int(), **meta, validate=False)
