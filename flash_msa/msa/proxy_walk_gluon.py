"""The walk over proxy key blocks that MSA's scoring kernels for Hopper (sm_90, Gluon) share:
per-token selection (token_selection_gluon.py) and block scores (block_scores_gluon.py).

A program holds its proxy query rows in shared memory, a consumer warpgroup for each 64 of
them, and walks kv blocks 0 .. blocks - 1 of one proxy key head:

- TMA loads of the key tiles [128, D_p] fill a NUM_STAGES-deep shared-memory ring, each
  slot guarded by a "ready" and an "empty" mbarrier: issued by a producer warp
  (load_key_tiles; block scores, two consumers) or by the first consumer within its walk
  (per-token selection, three consumers: a producer warp beside them does not fit the
  register file);
- each consumer (walk_blocks, over all of the blocks or over consecutive runs of them)
  issues the product of the next block ([64, 128] fp32, an async
  warpgroup MMA) before it hands this block's product to its kernel's ENTER function, so the
  tensor cores work while the consumer takes maxima.
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
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flash_msa.msa.fp8 import FP8
from flash_msa.ops.gluon.forward import mma_layout

KV_BLOCK = 128  # keys of a proxy key tile
DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, FP8: gl.float8e4nv}
PROXY_DIMS = (64, 128)
NUM_STAGES = 4  # key tiles in flight (deeper rings measured no faster: docs/performance.md)
CONSUMER_WARPS: gl.constexpr = gl.constexpr(4)  # one warpgroup per consumer
PRODUCER_WARPS: gl.constexpr = gl.constexpr(1)
# 64K registers over three warpgroups (384 threads), rounded down to 8: a thread's average in
# block scores (two consumers and the producer's warpgroup, split by setmaxnreg as below) and
# every thread's in per-token selection (three consumers).
MAX_REGISTERS = 168
CONSUMER_REGISTERS: gl.constexpr = gl.constexpr(240)
PRODUCER_REGISTERS: gl.constexpr = gl.constexpr(24)


def key_descriptor(k_proxy: torch.Tensor) -> TensorDescriptor:
    """The TMA view of the proxy keys k_proxy [B, S, H_pk, D_p] that load_key_tiles reads:
    [B * S, H_pk * D_p] in blocks [KV_BLOCK, D_p] (over a copy where TMA cannot read
    k_proxy as it is: rows not dense or not 16-byte aligned)."""
    if not k_proxy.is_contiguous() or k_proxy.data_ptr() % 16:
        k_proxy = k_proxy.clone(memory_format=torch.contiguous_format)
    batch, seq_len, key_heads, proxy_dim = k_proxy.shape
    flat = k_proxy.view(batch * seq_len, key_heads * proxy_dim)
    block = [KV_BLOCK, proxy_dim]
    layout = gl.NVMMASharedLayout.get_default_for(block, DTYPES[k_proxy.dtype])
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), block, layout)


@gluon.jit
def key_ring(k_desc, NUM_STAGES: gl.constexpr, CONSUMERS: gl.constexpr = 2):
    """The ring of key tiles (k_desc's blocks) and its "ready" and "empty" mbarriers (a slot
    freed by one arrival per consumer warpgroup), set up and fenced (with the shared-memory
    stores before it) for the async proxy: (k_smem, k_ready, k_empty)."""
    KEYS: gl.constexpr = k_desc.block_type.shape[0]
    PROXY_DIM: gl.constexpr = k_desc.block_type.shape[1]
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, KEYS, PROXY_DIM], k_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
    fence_async_shared()
    return k_smem, k_ready, k_empty


@gluon.jit
def load_key_tile(k_desc, k_smem, k_ready, k_empty, key_row, key_column, block):
    """Key tile `block` (rows key_row + 128 * block of k_desc's view, from column
    key_column) into its slot of the ring, once every consumer has freed the slot's
    previous tile."""
    NUM_STAGES: gl.constexpr = k_smem.type.shape[0]
    KEYS: gl.constexpr = k_desc.block_type.shape[0]
    stage = block % NUM_STAGES
    # A fresh barrier counts as having completed the phase before 0: the first waits pass
    # at once.
    mbarrier.wait(k_empty.index(stage), ((block // NUM_STAGES) & 1) ^ 1)
    mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(
        k_desc, [key_row + block * KEYS, key_column], k_ready.index(stage), k_smem.index(stage)
    )


@gluon.jit
def load_key_tiles(k_desc, k_smem, k_ready, k_empty, key_row, key_column, blocks):
    """The producer warp: proxy key tiles 0 .. blocks - 1 into the ring (load_key_tile)."""
    for block in range(blocks):
        load_key_tile(k_desc, k_smem, k_ready, k_empty, key_row, key_column, block)


@gluon.jit
def _refill(loads, k_smem, k_ready, k_empty, block):
    """A consumer that loads the ring itself (loads = (k_desc, key_row, key_column, blocks),
    else None): key tile `block`, if there is one."""
    if loads is not None:
        k_desc, key_row, key_column, blocks = loads
        if block < blocks:
            load_key_tile(k_desc, k_smem, k_ready, k_empty, key_row, key_column, block)


@gluon.jit
def _issue(q, k_smem, k_ready, block, acc):
    """The async product [64, 128] of block `block` (once its keys have landed), into acc's
    registers (its values are not read)."""
    NUM_STAGES: gl.constexpr = k_smem.type.shape[0]
    stage = block % NUM_STAGES
    mbarrier.wait(k_ready.index(stage), (block // NUM_STAGES) & 1)
    return warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), acc, use_acc=False,
                         is_async=True)  # fmt: skip


@gluon.jit
def walk_blocks(q, k_smem, k_ready, k_empty, first, end, state, values, ENTER: gl.constexpr,
                loads=None):  # fmt: skip
    """One consumer warpgroup's walk over blocks first .. end - 1 with q [64, D_p] (shared
    memory): state = ENTER(s, block, state, values) for each block's product s [64, 128]
    (done), in block order; returns the last state. The products alternate between two
    register tiles, even and odd steps (a walk of two blocks a step), so that no copy of a
    tile in flight makes the next product wait; where the walk has no next block, the last
    one's product runs again, unread. A walk over an even number of blocks issues that
    product before it frees the last block's slot; an odd one issues it after, so the
    producer must then load fewer than NUM_STAGES more blocks (else the product could wait
    for that slot's next keys, which this consumer has yet to free): walks followed by
    NUM_STAGES or more blocks cover an even number. With loads (see _refill) this consumer
    also fills the ring: it loads blocks first .. first + NUM_STAGES - 2 before the walk,
    and having freed block b, block b + NUM_STAGES - 1 into the slot of block b - 1 (which
    every consumer has most likely freed by then)."""
    ROWS: gl.constexpr = q.type.shape[0]
    KEYS: gl.constexpr = k_smem.type.shape[1]
    NUM_STAGES: gl.constexpr = k_smem.type.shape[0]
    s_layout: gl.constexpr = mma_layout(KEYS, k_smem.dtype)
    for block in gl.static_range(NUM_STAGES - 1):
        _refill(loads, k_smem, k_ready, k_empty, first + block)
    if end > first:
        last = end - 1
        even = _issue(q, k_smem, k_ready, first, gl.zeros([ROWS, KEYS], gl.float32, s_layout))
        odd = gl.zeros([ROWS, KEYS], gl.float32, s_layout)  # [HALF_M, KV_BLOCK]
        for pair in range(first, end, 2):
            done = warpgroup_mma_wait(0, deps=(even,))
            mbarrier.arrive(k_empty.index(pair % NUM_STAGES))
            _refill(loads, k_smem, k_ready, k_empty, pair + NUM_STAGES - 1)
            odd = _issue(q, k_smem, k_ready, gl.minimum(pair + 1, last), odd)
            state = ENTER(done, pair, state, values)
            odd = warpgroup_mma_wait(0, deps=(odd,))
            even = _issue(q, k_smem, k_ready, gl.minimum(pair + 2, last), done)
            if pair + 1 < end:
                mbarrier.arrive(k_empty.index((pair + 1) % NUM_STAGES))
                _refill(loads, k_smem, k_ready, k_empty, pair + NUM_STAGES)
                state = ENTER(odd, pair + 1, state, values)
        warpgroup_mma_wait(0, deps=(even,))
    return state
