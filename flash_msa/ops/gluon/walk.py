"""Aligned column walks, for kernels whose programs each own a kv block of 128 keys and walk
its column of the transposed layout (the query blocks that use it), as the dK/dV kernel
(backward.py) does.

Walked upwards from each column's first entry, a program reaches a query position one kv
block's worth of positions (128) after its left neighbour. To read each query tile once
from memory, the L2 must hold what all running programs read in that lag: one program a
multiprocessor x 128 positions x the bytes a walk reads per position. Where that working
set exceeds half the L2 (the dK/dV kernel over MSA's 8 x 16 tiles at D 128: Q and dO of 16
heads, 138 MB on an H100), every column starts its walk at its first entry at or after the
first multiple of ALIGN positions at or after its kv block, walks to its end and wraps
around: the ALIGN / 128 neighbouring programs that share that multiple read each query tile
at about the same time.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from flash_msa import _env
from flash_msa.ops.triton.common import first_at_least

KV_BLOCK = 128  # keys of a walking program
KV_BLOCK_CONSTEXPR: gl.constexpr = gl.constexpr(KV_BLOCK)
MAX_ALIGN = 8192  # positions; a kernel is compiled per power of two from KV_BLOCK


def walk_alignment(transposed, position_bytes: int, device: torch.device) -> int:
    """ALIGN (positions) for walks over the columns of `transposed` (a layout's transpose)
    that read position_bytes per query position, or 0 (walks from each column's first
    entry) where their working set fits half of the device's L2 (an H100's on other
    devices). ALIGN is the largest power of two within the mean column's span (mean
    entries x q_block positions), from KV_BLOCK to MAX_ALIGN. Read from the tensors'
    sizes: no device work."""
    multiprocessors, l2_bytes = _env.multiprocessors_and_l2(device)
    if 2 * multiprocessors * KV_BLOCK * position_bytes <= l2_bytes:
        return 0
    rows, columns = transposed.row_offsets.shape[0], transposed.row_offsets.shape[1] - 1
    span = transposed.col_indices.numel() * transposed.kv_block // max(rows * columns, 1)
    return min(MAX_ALIGN, max(KV_BLOCK, 1 << (max(span, 1).bit_length() - 1)))


@gluon.jit
def aligned_shift(col_indices, start, end, kv_block, ALIGN: gl.constexpr,
                  QUERY_BLOCK: gl.constexpr):  # fmt: skip
    """The entries a column [start, end) of query blocks of QUERY_BLOCK positions, sorted,
    skips before its aligned first entry: the first at or after the first multiple of
    ALIGN positions at or after kv block kv_block's first key (a binary search), or 0 where
    there is none or ALIGN is 0."""
    shift = 0
    if ALIGN > 0:
        boundary = (kv_block * KV_BLOCK_CONSTEXPR + ALIGN - 1) // ALIGN * ALIGN // QUERY_BLOCK
        first = first_at_least(col_indices, start, end, boundary)
        if first < end:
            shift = first - start
    return shift


@gluon.jit
def wrapped(index, last, count, shift):
    """Step `index` (last - count .. last - 1) of a walk over the count elements before
    last that starts shift elements in and wraps around: the element it reads."""
    element = index + shift
    if element >= last:
        element -= count
    return element
