"""select_tokens' kernel for Hopper (sm_90) in Gluon: the same selection as the Triton
kernel of token_selection.py (the same running top-k, running_top_k.py, so the same
choices), with the proxy products on asynchronous warpgroup MMAs that run under the top-k
work.

A program owns 192 rows, ROWS tokens x PACK proxy heads sharing a proxy key head, and walks
the kv blocks before its last token's own block. Three consumer warpgroups share it
(gl.warp_specialize), each owning 64 of the rows: each issues the product of the next block
([64, 128] fp32, an async warpgroup MMA) before it takes the row maxima of this block and
enters them into the running top-(top_k - 1), so the tensor cores work while it does. The
first also issues the TMA loads of the proxy key tiles [128, D_p] into a NUM_STAGES-deep
shared-memory ring, each slot guarded by a "ready" and an "empty" mbarrier: a producer warp
beside three warpgroups does not fit the register file (Triton pads it to a warpgroup),
where the 12 warps alone take 168 registers a thread without spills.

The query rows are loaded once, by the default warps before the partitions split, and kept
in shared memory; the ring and the consumers' walk are proxy_walk_gluon.py's.
Documents, q_blocks (context parallelism), kv blocks other than 128, D_p other than 64 or
128 and more than MAX_KEPT blocks a token take the Triton kernel (supports says which calls
this one takes).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from flash_msa import _env
from flash_msa.msa.proxy_walk_gluon import (
    CONSUMER_WARPS,
    DTYPES,
    KV_BLOCK,
    MAX_REGISTERS,
    NUM_STAGES,
    PROXY_DIMS,
    key_descriptor,
    key_ring,
    walk_blocks,
)
from flash_msa.msa.running_top_k import empty_slots, enter_block, ranked_blocks
from flash_msa.ops.gluon.forward import row_layout

CONSUMERS: gl.constexpr = gl.constexpr(3)  # consumer warpgroups a program
HALF_M: gl.constexpr = gl.constexpr(64)  # rows of one consumer warpgroup
BLOCK_M = CONSUMERS.value * HALF_M.value  # rows of a program (192)
REGISTERS: gl.constexpr = gl.constexpr(MAX_REGISTERS)  # a thread, in every partition
# Slots of the running top-k a row holds at most (compiled for sm_90 at 168 registers: 16
# slots without spills, 32 spill 96 bytes, 64 2,628); calls keeping more take the Triton kernel.
MAX_KEPT = 64


def supports(q_proxy: torch.Tensor, kv_block: int, kept: int, documents: bool,
             q_blocks: bool) -> bool:  # fmt: skip
    """Whether this kernel takes a select_tokens call (scoring in q_proxy's dtype, FP8
    included, `kept` blocks a token): an sm_90 GPU, fp16 / bf16 / e4m3 proxies of D_p 64 or
    128, kv_block 128, at most MAX_KEPT blocks kept, no documents and no q_blocks, B * S
    below 2^31 (TMA coordinates)."""
    batch, seq_len = q_proxy.shape[:2]
    return (
        q_proxy.device.type == "cuda" and not _env.interpreting()
        and _env.capability(q_proxy.device) == (9, 0) and q_proxy.dtype in DTYPES
        and q_proxy.shape[3] in PROXY_DIMS and kv_block == KV_BLOCK and kept <= MAX_KEPT
        and not documents and not q_blocks and batch * seq_len < 2**31
    )  # fmt: skip


def slot_count(kept: int) -> int:
    """Columns of the running top-k's tiles: a power of two holding the kept blocks, at least
    8 (the narrowest the GPU tests run: top_k 4); the slots past top_k - 1 stay empty."""
    return max(8, triton.next_power_of_2(kept))


@gluon.constexpr_function
def slot_tile_layout(slots):
    """The running top-k's [HALF_M, slots] tiles: a row in one pair of lanes, slots / 2 slots
    a thread, so a row's reductions take one shuffle. The pair is among the lanes holding the
    row's maximum in the products' accumulator layout (rows g and g + 8 of a warp's 16 in
    lanes 4 g .. 4 g + 3); the conversion still compiles to one shuffle and two selects."""
    registers = [[0, 1 << bit] for bit in range((slots // 2).bit_length() - 1)]
    lanes = [[0, slots // 2], [8, 0], [1, 0], [2, 0], [4, 0]]  # lane bits, lowest first
    return gl.DistributedLinearLayout(
        reg_bases=registers, lane_bases=lanes, warp_bases=[[16, 0], [32, 0]], block_bases=[],
        shape=[HALF_M.value, slots],
    )  # fmt: skip


@gluon.jit
def _enter(s, block, top_k, values):
    """The running top-k after block `block`'s product s [HALF_M, KV_BLOCK] (done): its row
    maxima, for the rows that rank the block. top_k = (slot_scores, slot_blocks, worst);
    values = (own_blocks, row_valid, slots, k_scales, TOP_K, SCALED)."""
    slot_scores, slot_blocks, worst = top_k
    own_blocks, row_valid, slots, k_scales, TOP_K, SCALED = values
    block_max = gl.convert_layout(gl.max(s, axis=1), own_blocks.type.layout)  # [HALF_M]
    if SCALED:  # a positive factor: the max of the scaled logits is the scaled max
        block_max = block_max * gl.load(k_scales + block)
    score = gl.where((block < own_blocks) & row_valid, block_max, float("-inf"))
    return enter_block(slot_scores, slot_blocks, worst, score, block, slots, TOP_K)


@gluon.jit
def _consumer(q_smem, k_smem, k_ready, k_empty, k_scales, tile_values, HALF: gl.constexpr,
              TOP_K: gl.constexpr, SLOTS: gl.constexpr, PACK: gl.constexpr,
              SCALED: gl.constexpr, loads=None):  # fmt: skip
    """One warpgroup's 64 rows: the walk (each block's product runs while the block before
    it enters the top-k), then its rows of the output (see ranked_blocks). With loads
    (k_desc, key_row, key_column, blocks), this consumer also fills the ring (no producer
    warp)."""
    first, first_head, seq_len, blocks, out_base, stride_o_h, stride_o_s = tile_values
    ROWS: gl.constexpr = q_smem.type.shape[1]
    KEYS: gl.constexpr = k_smem.type.shape[1]
    slot_layout: gl.constexpr = slot_tile_layout(SLOTS)
    rows_layout: gl.constexpr = gl.SliceLayout(1, slot_layout)
    q = q_smem.index(HALF)  # [HALF_M, D_p]
    rows = HALF * ROWS + gl.arange(0, ROWS, layout=rows_layout)  # [HALF_M] of the tile's 192
    tokens = first + rows // PACK  # [HALF_M]
    heads = first_head + rows % PACK  # [HALF_M]
    row_valid = tokens < seq_len
    own_blocks = tokens // KEYS  # [HALF_M]
    slots = gl.arange(0, SLOTS, layout=gl.SliceLayout(0, slot_layout))  # [SLOTS]
    top_k = empty_slots(slots, gl.zeros([ROWS, SLOTS], gl.float32, slot_layout), TOP_K)
    values = (own_blocks, row_valid, slots, k_scales, TOP_K, SCALED)
    top_k = walk_blocks(q, k_smem, k_ready, k_empty, 0, blocks, top_k, values, _enter, loads)
    ranked, columns = ranked_blocks(top_k[1], own_blocks, slots, TOP_K)
    out_rows = out_base + heads.to(gl.int64) * stride_o_h + tokens.to(gl.int64) * stride_o_s
    gl.store(gl.expand_dims(out_rows, 1) + columns, gl.where(ranked < 0, -1, ranked),
             mask=gl.expand_dims(row_valid, 1) & (columns < TOP_K))  # fmt: skip


@gluon.jit
def _selection_kernel(
    q_proxy, k_desc, selected, k_scales, stride_q_b, stride_q_s, stride_q_h, stride_ks_b,
    stride_ks_h, stride_o_b, stride_o_h, stride_o_s, seq_len, proxy_group,
    PROXY_DIM: gl.constexpr, PACK: gl.constexpr, TOP_K: gl.constexpr, SLOTS: gl.constexpr,
    SCALED: gl.constexpr, NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """Grid (ceil(S / ROWS), H_p / PACK, B), ROWS = BLOCK_M / PACK tokens a program, the
    longest walks first. k_desc: a TMA view [B * S, H_pk * D_p] of the proxy keys in blocks
    [128, D_p]; k_scales: fp32 [B, H_pk, num_kv_blocks] with SCALED (FP8), else unread."""
    KEYS: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = k_desc.dtype
    ROWS: gl.constexpr = HALF_M * CONSUMERS // PACK
    tile = (seq_len + ROWS - 1) // ROWS - 1 - gl.program_id(0)
    first_head = gl.program_id(1) * PACK
    batch = gl.program_id(2).to(gl.int64)
    key_head = first_head // proxy_group  # PACK divides the group: one key head for all
    first = tile * ROWS
    blocks = (gl.minimum(first + ROWS, seq_len) - 1) // KEYS  # those before the last own block

    # The tile's query rows, once, into shared memory: each consumer's A operand.
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, PROXY_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, HALF_M, PROXY_DIM], q_layout)
    load_layout: gl.constexpr = row_layout(PROXY_DIM)  # [HALF_M, D_p] over 4 warps
    dims = gl.arange(0, PROXY_DIM, layout=gl.SliceLayout(0, load_layout))  # [D_p]
    for half in gl.static_range(CONSUMERS):
        rows = half * HALF_M + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, load_layout))
        tokens = first + rows // PACK  # [HALF_M]
        offsets = (batch * stride_q_b + tokens.to(gl.int64) * stride_q_s
                   + (first_head + rows % PACK).to(gl.int64) * stride_q_h)  # fmt: skip
        q_half = gl.load(q_proxy + gl.expand_dims(offsets, 1) + gl.expand_dims(dims, 0),
                         mask=gl.expand_dims(tokens < seq_len, 1), other=0.0)  # fmt: skip
        q_smem.index(half).store(q_half)  # [HALF_M, D_p]
    k_smem, k_ready, k_empty = key_ring(k_desc, NUM_STAGES, CONSUMERS)

    k_scales += batch * stride_ks_b + key_head * stride_ks_h
    out_base = selected + batch * stride_o_b
    tile_values = (first, first_head, seq_len, blocks, out_base, stride_o_h, stride_o_s)
    # The default partition (this kernel's 4 warps) is the first consumer, which fills the ring.
    loads = (k_desc, gl.program_id(2) * seq_len, key_head * PROXY_DIM, blocks)
    gl.warp_specialize(
        [(_consumer, (q_smem, k_smem, k_ready, k_empty, k_scales, tile_values, 0, TOP_K,
                      SLOTS, PACK, SCALED, loads)),
         (_consumer, (q_smem, k_smem, k_ready, k_empty, k_scales, tile_values, 1, TOP_K,
                      SLOTS, PACK, SCALED)),
         (_consumer, (q_smem, k_smem, k_ready, k_empty, k_scales, tile_values, 2, TOP_K,
                      SLOTS, PACK, SCALED))],
        [CONSUMER_WARPS, CONSUMER_WARPS],
        [REGISTERS, REGISTERS],
    )  # fmt: skip


def select(q_proxy, k_proxy, k_scales, selected, *, kept: int, pack: int) -> None:
    """Fill selected (int32 [B, H_p, S, top_k], its columns from `kept` on already -1) with
    the selection of q_proxy [B, S, H_p, D_p] over k_proxy [B, S, H_pk, D_p] (both in the
    scoring dtype; k_scales fp32 [B, H_pk, num_kv_blocks] for FP8, else None), `pack` proxy
    heads a program. The caller checked the call (supports)."""
    batch, seq_len, heads, proxy_dim = q_proxy.shape
    key_heads = k_proxy.shape[2]
    k_desc = key_descriptor(k_proxy)
    scaled = k_scales is not None
    rows = BLOCK_M // pack
    grid = (triton.cdiv(seq_len, rows), heads // pack, batch)
    _selection_kernel[grid](
        q_proxy=q_proxy, k_desc=k_desc, selected=selected,
        k_scales=k_scales if scaled else selected,
        stride_q_b=q_proxy.stride(0), stride_q_s=q_proxy.stride(1), stride_q_h=q_proxy.stride(2),
        stride_ks_b=k_scales.stride(0) if scaled else 0,
        stride_ks_h=k_scales.stride(1) if scaled else 0,
        stride_o_b=selected.stride(0), stride_o_h=selected.stride(1),
        stride_o_s=selected.stride(2), seq_len=seq_len, proxy_group=heads // key_heads,
        PROXY_DIM=proxy_dim, PACK=pack, TOP_K=kept, SLOTS=slot_count(kept),
        SCALED=scaled, NUM_STAGES=NUM_STAGES, num_warps=4, maxnreg=MAX_REGISTERS,
    )  # fmt: skip


def compile_for_sm90(workdir: str, scores: str = "bf16", proxy_dim: int = 128) -> dict:
    """Compile the kernel for sm_90a without a GPU (scores "bf16", "fp16" or "fp8e4nv"; 4
    proxy heads a key head, top_k 16) and report as ops.gluon.codegen.compile_forward does,
    plus "maxima_under_products": the most FMNMX (row maxima, top-k) between a product's
    issue and the next MMA wait (0 if they do not overlap)."""
    from flash_msa.ops.gluon import codegen

    types = dict(q_proxy=f"*{scores}", k_desc=codegen.descriptor_type(scores, KV_BLOCK, proxy_dim),
                 selected="*i32", k_scales="*fp32")  # fmt: skip
    constexprs = dict(PROXY_DIM=proxy_dim, PACK=4, TOP_K=16, SLOTS=16,
                      SCALED=scores == "fp8e4nv", NUM_STAGES=NUM_STAGES)  # fmt: skip
    report = codegen.compile_kernel(_selection_kernel, types, constexprs, workdir,
                                    f"token_selection_{scores}_d{proxy_dim}")  # fmt: skip
    with open(report["sass"]) as handle:
        report["maxima_under_products"] = codegen.instructions_under_mma(handle.read(), "FMNMX")
    return report
