"""Shared construction steps of the pattern builders (no Python loop over rows or blocks)."""

from __future__ import annotations

import math

import torch

from flash_msa.layout import (
    LAYOUT_BLOCK_SIZES,
    BlockLayout,
    check_block_size,
    check_entries,
    check_not_meta,
    check_seq_len,
)
from flash_msa.sequences import check_cu_seqlens


def is_int(value) -> bool:
    """A Python int that is not a bool (True is an int to isinstance)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_flags(**flags) -> None:
    """Each named option is a bool (TypeError naming it): a truthy string or None would
    silently pick a pattern."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")


def layout_meta(
    seq_len_q: int,
    seq_len_kv: int | None,
    block_size: int,
    q_block: int | None,
    kv_block: int | None,
) -> dict:
    """Metadata of a single-head layout, validated. q_block and kv_block default to
    block_size; seq_len_kv None is self-attention over seq_len_q tokens (named seq_len in
    errors, as the builders call it)."""
    if seq_len_kv is None:
        lengths = (("seq_len", seq_len_q),)
    else:
        lengths = (("seq_len_q", seq_len_q), ("seq_len_kv", seq_len_kv))
    for name, value in lengths:
        check_seq_len(name, value)
    if q_block is not None and kv_block is not None:
        check_block_size("block_size", block_size)  # unused, but still a mistake when wrong
    # A size the caller left out comes from block_size: name that in the error.
    if kv_block is None:
        kv_block = check_block_size("block_size", block_size)
    check_block_size("kv_block", kv_block)
    if q_block is None:
        q_block = block_size
    check_block_size("q_block", q_block, LAYOUT_BLOCK_SIZES)  # rows of one token too (MSA)
    return dict(
        seq_len_q=seq_len_q,
        seq_len_kv=seq_len_q if seq_len_kv is None else seq_len_kv,
        q_block=q_block,
        kv_block=kv_block,
    )


def grid_meta(
    grid: torch.Tensor,
    name: str,
    seq_len_q: int,
    seq_len_kv: int | None,
    block_size: int,
    q_block: int | None,
    kv_block: int | None,
) -> dict:
    """Metadata for a [..., nq, nk] block grid ([nq, nk], [H, nq, nk] or [B, H, nq, nk]),
    checking its last two sizes against the sequence lengths and block sizes."""
    if not isinstance(grid, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(grid).__name__}")
    check_not_meta(name, grid.device)
    if grid.dim() not in (2, 3, 4):
        raise ValueError(
            f"{name} must be [nq, nk], [heads, nq, nk] or [batch, heads, nq, nk], "
            f"got shape {list(grid.shape)}"
        )
    seq_len_kv = seq_len_q if seq_len_kv is None else seq_len_kv
    meta = layout_meta(seq_len_q, seq_len_kv, block_size, q_block, kv_block)
    expected = (
        math.ceil(seq_len_q / meta["q_block"]),
        math.ceil(seq_len_kv / meta["kv_block"]),
    )
    if tuple(grid.shape[-2:]) != expected:
        raise ValueError(
            f"{name} has {list(grid.shape[-2:])} blocks, but seq_len_q={seq_len_q}, "
            f"seq_len_kv={seq_len_kv} with q_block={meta['q_block']}, "
            f"kv_block={meta['kv_block']} need {list(expected)}"
        )
    leading = (1,) * (4 - grid.dim()) + tuple(grid.shape[:-2])
    if 0 in leading:
        raise ValueError(
            f"{name} has an empty batch or head dimension (shape {list(grid.shape)}); "
            "pass at least one layout"
        )
    return dict(**meta, layout_batch=leading[-2], layout_heads=leading[-1])


def tokens_to_blocks(name: str, tokens: int, block_size: int) -> int:
    """Blocks spanned by a non-negative token count (rounded up)."""
    if not is_int(tokens) or tokens < 0:
        raise ValueError(f"{name} must be a non-negative int number of tokens, got {tokens!r}")
    return math.ceil(tokens / block_size)


def diagonals(rows: torch.Tensor, meta: dict) -> torch.Tensor:
    """The diagonal kv block d(b) of each query block b in rows (int64): the block of b's
    last query, (min((b + 1) * q_block, seq_len_q) - 1) // kv_block, which is the last
    block holding a causal pair (positions of queries and keys both count from 0). With
    q_block == kv_block, d(b) = b."""
    last = ((rows + 1) * meta["q_block"]).clamp(max=meta["seq_len_q"]) - 1
    return last // meta["kv_block"]


def diagonal_total(meta: dict, limit: int) -> int:
    """Sum over the query blocks b of min(limit, d(b) + 1), from the geometry alone: no
    device value is read and the cost does not grow with the length (torch.compile traces it
    at once). q_block and kv_block are powers of two, so one divides the other."""
    seq_len, q_block, kv_block = meta["seq_len_q"], meta["q_block"], meta["kv_block"]
    full_rows = math.ceil(seq_len / q_block) - 1  # rows b that end at (b + 1) * q_block
    if q_block <= kv_block:  # d(b) + 1 = b // ratio + 1: `ratio` rows per value 1, 2, ...
        ratio = kv_block // q_block
        groups, rest = divmod(full_rows, ratio)
        ramp = min(groups, limit)  # groups whose value is at most limit
        total = ratio * (ramp * (ramp + 1) // 2 + limit * (groups - ramp))
        total += rest * min(limit, groups + 1)
    else:  # d(b) + 1 = (b + 1) * ratio
        ratio = q_block // kv_block
        ramp = min(full_rows, limit // ratio)
        total = ratio * ramp * (ramp + 1) // 2 + limit * (full_rows - ramp)
    return total + min(limit, (seq_len - 1) // kv_block + 1)  # the last (maybe ragged) row


def fixed_rows(counts: torch.Tensor, num_layouts: int, per_layout: int):
    """CSR of num_layouts layouts whose rows hold counts [nq] entries each (per_layout =
    counts.sum(), known on the host): row_offsets int64 [L, nq + 1], and for each of the nnz
    entries its flat row (layout * nq + row) and its slot within that row, int64 [nnz]."""
    device = counts.device
    nnz = num_layouts * per_layout
    check_entries(nnz)
    row_offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # [nq + 1]
    row_offsets = torch.arange(num_layouts, device=device)[:, None] * per_layout + row_offsets
    rows = torch.repeat_interleave(
        torch.arange(num_layouts * counts.numel(), device=device),
        counts.repeat(num_layouts),
        output_size=nnz,
    )  # [nnz]
    slots = torch.arange(nnz, device=device) - row_offsets[:, :-1].flatten()[rows]
    return row_offsets, rows, slots


def progression_rows(
    start: torch.Tensor, count: torch.Tensor, step: int, meta: dict
) -> BlockLayout:
    """Row r holds blocks start[r], start[r] + step, ... (count[r] of them), ascending.

    start, count: int64 [num_q_blocks]; memory O(nnz).
    """
    count = count.clamp(min=0)
    offsets = torch.zeros(count.numel() + 1, dtype=torch.int64, device=count.device)
    torch.cumsum(count, 0, out=offsets[1:])
    nnz = int(offsets[-1])
    check_entries(nnz)
    # col = start[r] + step * (entry - offsets[r]): one repeat of a per-row base, in int32.
    base = (start - step * offsets[:-1]).int()
    cols = torch.repeat_interleave(base, count, output_size=nnz)
    cols += step * torch.arange(nnz, dtype=torch.int32, device=count.device)
    return BlockLayout(offsets.int()[None], cols, **meta, validate=False)


def band_rows(lower: torch.Tensor, upper: torch.Tensor, meta: dict) -> BlockLayout:
    """Row r holds the contiguous blocks lower[r]..upper[r] (clipped to the kv range)."""
    num_kv_blocks = math.ceil(meta["seq_len_kv"] / meta["kv_block"])
    lower = lower.clamp(min=0)
    upper = upper.clamp(max=num_kv_blocks - 1)
    return progression_rows(lower, upper - lower + 1, 1, meta)


def query_blocks(meta: dict, device) -> torch.Tensor:
    """int64 [num_q_blocks]: 0, 1, ..."""
    return torch.arange(math.ceil(meta["seq_len_q"] / meta["q_block"]), device=device)


def row_documents(meta: dict, cu_seqlens, device):
    """Per query block r (int64 [nq] each): its first and last token, the start of the
    document of its first token and the end (exclusive) of the document of its last token.
    Without cu_seqlens the whole sequence is one document."""
    seq_len, q_block = meta["seq_len_q"], meta["q_block"]
    first = query_blocks(meta, device) * q_block
    last = (first + q_block - 1).clamp(max=seq_len - 1)
    if cu_seqlens is None:
        return first, last, torch.zeros_like(first), torch.full_like(first, seq_len)
    check_cu_seqlens(cu_seqlens, total_tokens=seq_len)
    bounds = cu_seqlens.to(device=first.device, dtype=torch.int64)
    first_document = torch.searchsorted(bounds, first, right=True) - 1
    last_document = torch.searchsorted(bounds, last, right=True) - 1
    return first, last, bounds[first_document], bounds[last_document + 1]


def rectangles(
    row_low: torch.Tensor,
    row_high: torch.Tensor,
    col_low: torch.Tensor,
    col_high: torch.Tensor,
    meta: dict,
    causal: bool,
) -> BlockLayout:
    """Union of block rectangles [row_low[k], row_high[k]] x [col_low[k], col_high[k]]
    (int64 [K] each, inclusive); with causal only blocks c <= d(r), the diagonal."""
    heights = (row_high - row_low + 1).clamp(min=0)
    rect = torch.repeat_interleave(torch.arange(heights.numel(), device=heights.device), heights)
    row = (
        row_low[rect]
        + torch.arange(rect.numel(), device=rect.device)
        - (torch.cumsum(heights, 0) - heights)[rect]
    )  # [R] one row of one rectangle each
    high = torch.minimum(col_high[rect], diagonals(row, meta)) if causal else col_high[rect]
    widths = (high - col_low[rect] + 1).clamp(min=0)
    entry = torch.repeat_interleave(torch.arange(row.numel(), device=row.device), widths)
    col = (
        col_low[rect][entry]
        + torch.arange(entry.numel(), device=entry.device)
        - (torch.cumsum(widths, 0) - widths)[entry]
    )
    num_kv_blocks = math.ceil(meta["seq_len_kv"] / meta["kv_block"])
    keys = torch.unique(row[entry] * num_kv_blocks + col)
    return BlockLayout.from_keys(keys, **meta, validate=False)
