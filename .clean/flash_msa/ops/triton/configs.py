"""Tile sizes and autotune configs of the Triton kernels, keyed by head dim and block size.

Tile sizes that set the grid or the GQA packing (query rows per program, key rows of
the dK/dV program) are chosen here in Python; the inner tile (the other side of each
S = Q K^T tile), num_warps and num_stages are left to triton.autotune. Under
TRITON_INTERPRET=1 every kernel gets one config, since the interpreter cannot time them.
On a GPU the lists hold only configs whose tiles fit its shared memory.
"""

from __future__ import annotations

from typing import NamedTuple

import triton

from flash_msa._env import interpreting


class RowTile(NamedTuple):
    """A tile of ROWS positions x PACK query heads (BLOCK_M = ROWS * PACK rows)."""

    rows: int
    pack: int


def largest_power_of_two_dividing(value: int) -> int:
    return value & -value


def row_tile(block: int, max_rows: int, shared_heads: int) -> RowTile:
    """Rows of one program's query tile, within one q block of `block` positions.

    A query block smaller than max_rows leaves room for more query heads (FlashAttention-3's
    pack_gqa), which then share each K/V tile the program loads; shared_heads is how many
    consecutive query heads share both a kv head and a layout row. PACK stays a power of
    two dividing it so that BLOCK_M is a power of two.
    """
    rows = min(block, max_rows)
    pack = min(largest_power_of_two_dividing(shared_heads), max_rows // rows)
    return RowTile(rows, pack)


def max_query_rows(head_dim_pad: int, kernel: str) -> int:
    """BLOCK_M limit so that Q (and dO, dQ) tiles plus the accumulator fit in registers.

    Measured on an H200 (docs/performance.md): at D=128, 128 query rows run the forward
    1.7x and dQ 2.3x faster than 64.
    """
    if kernel in ("forward", "dq"):
        return 128 if head_dim_pad <= 128 else 64
    return 64 if head_dim_pad <= 128 else 32  # dkdv: the inner loop side (FA2 uses 64)


def dkdv_kv_rows(head_dim_pad: int, kv_block: int) -> int:
    """Key rows of one dK/dV program (they hold K, V, dK, dV on chip); at D=128, 128 rows
    ran 1.8x faster than 64 on an H200."""
    return min(kv_block, 128 if head_dim_pad <= 128 else 32)


def _configs(inner_sizes: list[int | None], warps: tuple, stages: tuple) -> list[triton.Config]:
    return [
        triton.Config({} if size is None else {"BLOCK_N": size}, num_warps=w, num_stages=s)
        for size in inner_sizes
        for w in warps
        for s in stages
    ]


def _inner_sizes(kv_block: int, candidates: tuple[int, ...]) -> list[int]:
    return sorted({min(kv_block, size) for size in candidates})


class Launch(NamedTuple):
    """What decides which configs of a kernel can launch, beside the configs themselves."""

    head_dim_pad: int
    block_m: int  # query rows of a program's tile (ROWS * PACK)
    element_size: int  # bytes of the inputs' dtype
    tma: bool  # TMA loads are multi-buffered in shared memory; pointer loads are not
    shared_memory: int  # bytes one program may use on the device


BARRIERS = 1024  # bytes of mbarriers and alignment beside the tiles (at most 1 KiB measured)


def shared_memory_need(config: triton.Config, kernel: str, launch: Launch, block_n: int) -> int:
    """Bytes of shared memory a config takes: the tiles a program holds for its whole life,
    plus the tiles each loop step loads (num_stages copies with TMA: the software pipeline's
    ring), plus the P tile when the warpgroups split BLOCK_N rather than BLOCK_M and the
    second matmul reads P re-laid out through shared memory. Forward: Q held, K and V
    streamed; dQ: Q and dO held, K and V streamed; dK/dV: K and V held, Q and dO streamed.
    An upper bound of Triton 3.6's own count for sm_90 (tests/ops/triton/test_configs.py)."""
    block_n = config.kwargs.get("BLOCK_N", block_n)
    held, streamed = {
        "forward": (launch.block_m, 2 * block_n),
        "dq": (2 * launch.block_m, 2 * block_n),
        "dkdv": (2 * block_n, 2 * launch.block_m),
    }[kernel]
    copies = config.num_stages if launch.tma else 1
    rows_per_warpgroup = 64  # wgmma: each warpgroup (4 warps) takes 64 rows of its tile
    split = launch.block_m < rows_per_warpgroup * config.num_warps // 4
    p_tile = launch.block_m * block_n if split else 0
    tiles = (held + copies * streamed) * launch.head_dim_pad + p_tile
    return tiles * launch.element_size + BARRIERS


def _launchable(
    choices: list[triton.Config], kernel: str, launch: Launch, block_n: int | None = None
) -> list[triton.Config]:
    """The configs whose tiles fit the device's shared memory (never empty: the smallest
    stays, for a clear launch error rather than none)."""
    need = [shared_memory_need(config, kernel, launch, block_n) for config in choices]
    fitting = [config for config, bytes_ in zip(choices, need, strict=True)
               if bytes_ <= launch.shared_memory]  # fmt: skip
    return fitting or [choices[need.index(min(need))]]


# Warps and stages below were pruned by compiling every config for sm_90 with the ptxas
# bundled with Triton 3.6 (no GPU needed) and dropping those that spill registers heavily:
# 4 warps spill at D >= 128 in every kernel (and in dK/dV at D = 64).


def forward_configs(launch: Launch, kv_block: int) -> list[triton.Config]:
    """Forward: BLOCK_N (key rows per step, dividing kv_block), warps and stages."""
    if interpreting():  # 64 < kv_block 128 keeps the sub-block steps under test
        return _configs([min(kv_block, 64)], (4,), (1,))
    if launch.head_dim_pad > 128:
        choices = _configs(_inner_sizes(kv_block, (32,)), (8,), (2,))
    else:
        warps = (4, 8) if launch.head_dim_pad <= 64 else (8,)
        choices = _configs(_inner_sizes(kv_block, (64, 128)), warps, (2, 3, 4))
    return _launchable(choices, "forward", launch)


def dq_configs(launch: Launch, kv_block: int) -> list[triton.Config]:
    """dQ: BLOCK_N per step (K and V tiles, plus P and dP of BLOCK_M x BLOCK_N)."""
    if interpreting():
        return _configs([min(kv_block, 64)], (4,), (1,))
    if launch.head_dim_pad > 128:
        choices = _configs(_inner_sizes(kv_block, (16,)), (8,), (1,))
    else:
        warps = (4, 8) if launch.head_dim_pad <= 64 else (8,)
        choices = _configs(_inner_sizes(kv_block, (32, 64)), warps, (2, 3))
    return _launchable(choices, "dq", launch)


def dkdv_configs(launch: Launch, block_n: int) -> list[triton.Config]:
    """dK/dV: both tile sides are fixed by row_tile / dkdv_kv_rows (block_n); warps, stages."""
    if interpreting():
        return _configs([None], (4,), (1,))
    choices = _configs([None], (8,), (2, 3) if launch.head_dim_pad <= 128 else (1, 2))
    return _launchable(choices, "dkdv", launch, block_n)
