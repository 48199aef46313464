"""block_scores' kernel for Hopper (sm_90) in Gluon: the same scores as the Triton kernel of
block_scores.py, with the proxy products on asynchronous warpgroup MMAs that run while the
consumers take the maxima of the block before.

A program owns one query block of 64 positions for two proxy heads that share a proxy key
head, 128 rows, and walks the kv blocks up to the block's diagonal with proxy_walk_gluon.py's
producer warp and consumer walk. Each consumer warpgroup owns one head's 64 rows, so a
block's score is the max over its own tile: per block it takes the row maxima and keeps them
as one column of a [64, CHUNK] register tile; it walks CHUNK blocks at a time, and after
each run scales the maxima by their FP8 factors, reduces the tile over its rows (one
cross-warp reduction for CHUNK blocks) and stores CHUNK scores. The diagonal block, the one
under the causal mask, is walked alone, so the mask stays out of the other blocks' loop.
Past the diagonal it writes -inf.

Documents, q_blocks (context parallelism), q_block other than 64, kv_block other than 128,
D_p other than 64 or 128 and an odd number of proxy heads per key head take the Triton
kernel (supports says which calls this one takes).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from flash_msa import _env
from flash_msa.msa.proxy_walk_gluon import (
    CONSUMER_REGISTERS,
    CONSUMER_WARPS,
    DTYPES,
    KV_BLOCK,
    MAX_REGISTERS,
    NUM_STAGES,
    PRODUCER_REGISTERS,
    PRODUCER_WARPS,
    PROXY_DIMS,
    key_descriptor,
    key_ring,
    load_key_tiles,
    walk_blocks,
)
from flash_msa.ops.gluon.forward import mma_layout, row_layout

Q_BLOCK: gl.constexpr = gl.constexpr(64)  # positions of a program: a consumer's rows
PACK: gl.constexpr = gl.constexpr(2)  # proxy heads of a program, one a consumer
# kv blocks whose row maxima a consumer holds before it reduces and stores them: even (a walk
# that stops short of the producer's last block covers an even number, proxy_walk_gluon.py)
CHUNK: gl.constexpr = gl.constexpr(64)
TAIL_COLUMNS: gl.constexpr = gl.constexpr(128)  # -inf columns stored at a time past the diagonal


def supports(q_proxy: torch.Tensor, group: int, q_block: int, kv_block: int, documents: bool,
             q_blocks: bool) -> bool:  # fmt: skip
    """Whether this kernel takes a block_scores call (scoring in q_proxy's dtype, FP8
    included; `group` proxy heads a key head): an sm_90 GPU, fp16 / bf16 / e4m3 proxies of
    D_p 64 or 128, q_block 64, kv_block 128, an even group, no documents and no q_blocks,
    B * S below 2^31 (TMA coordinates)."""
    batch, seq_len = q_proxy.shape[:2]
    return (
        q_proxy.device.type == "cuda" and not _env.interpreting()
        and _env.capability(q_proxy.device) == (9, 0) and q_proxy.dtype in DTYPES
        and q_proxy.shape[3] in PROXY_DIMS and q_block == Q_BLOCK.value and kv_block == KV_BLOCK
        and group % PACK.value == 0 and not documents and not q_blocks and batch * seq_len < 2**31
    )  # fmt: skip


@gluon.jit
def _enter(s, block, chunk, columns):
    """Block `block`'s product s [Q_BLOCK, KV_BLOCK] (done): its row maxima as column
    block % CHUNK of the chunk tile [Q_BLOCK, CHUNK] (columns: [CHUNK], 0 .. CHUNK - 1)."""
    CHUNK: gl.constexpr = chunk.type.shape[1]
    row_max = gl.convert_layout(gl.max(s, axis=1), gl.SliceLayout(1, chunk.type.layout))
    column = gl.expand_dims(columns == block % CHUNK, 0)  # [1, CHUNK]
    return gl.where(column, gl.expand_dims(row_max, 1), chunk)


@gluon.jit
def _enter_diagonal(s, block, chunk, values):
    """_enter for the diagonal block: keys after a row's position masked first."""
    columns, first = values
    KEYS: gl.constexpr = s.type.shape[1]
    ROWS: gl.constexpr = s.type.shape[0]
    keys = block * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(0, s.type.layout))
    rows = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s.type.layout))  # [Q_BLOCK]
    visible = gl.expand_dims(keys, 0) <= gl.expand_dims(rows, 1)  # [Q_BLOCK, KEYS]
    return _enter(gl.where(visible, s, float("-inf")), block, chunk, columns)


@gluon.jit
def _store_chunk(chunk, start, last, row_values, out_row, k_scales, scale,
                 SCALED: gl.constexpr):  # fmt: skip
    """Scores of kv blocks start .. last from their columns of the chunk tile: the max over
    the query rows (those past the sequence left out), each row maximum times its row's and
    its block's FP8 factors first (as the Triton kernel rounds them), times the softmax
    scale."""
    row_valid, row_scales, columns = row_values  # [Q_BLOCK], [Q_BLOCK], [CHUNK]
    CHUNK: gl.constexpr = chunk.type.shape[1]
    if SCALED:  # positive factors: the max of the scaled logits is the scaled max
        block_scales = gl.load(k_scales + start + columns, mask=start + columns <= last,
                               other=1.0)  # fmt: skip
        chunk = chunk * (gl.expand_dims(row_scales, 1) * gl.expand_dims(block_scales, 0))
    chunk = gl.where(gl.expand_dims(row_valid, 1), chunk, float("-inf"))
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    maxima = gl.convert_layout(gl.max(chunk, axis=0), layout)  # [CHUNK]
    blocks = start + gl.arange(0, CHUNK, layout=layout)  # [CHUNK]
    gl.store(out_row + blocks, maxima * scale, mask=blocks <= last)


@gluon.jit
def _consumer(q_smem, k_smem, k_ready, k_empty, q_scales, k_scales, tile_values,
              HALF: gl.constexpr, SCALED: gl.constexpr):  # fmt: skip
    """One warpgroup: head first_head + HALF's scores of this query block, blocks
    0 .. diagonal from the walk, -inf past it. q_scales: this batch row's fp32 [S, H_p]
    factors from column first_head on (SCALED), k_scales: the key head's [num_kv_blocks]."""
    first, seq_len, diagonal, num_kv_blocks, out_row, stride_o_h, stride_qs_s, scale = (
        tile_values
    )
    ROWS: gl.constexpr = q_smem.type.shape[1]
    chunk_layout: gl.constexpr = mma_layout(CHUNK, q_smem.dtype)
    positions = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, chunk_layout))  # [Q_BLOCK]
    row_valid = positions < seq_len
    row_scales = gl.full([ROWS], 1.0, gl.float32, positions.type.layout)  # [Q_BLOCK]
    if SCALED:
        row_scales = gl.load(q_scales + positions.to(gl.int64) * stride_qs_s + HALF,
                             mask=row_valid, other=1.0)  # fmt: skip
    out_row += HALF * stride_o_h
    q = q_smem.index(HALF)
    columns = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, chunk_layout))  # [CHUNK]
    chunk = gl.full([ROWS, CHUNK], float("-inf"), gl.float32, chunk_layout)
    # Runs of CHUNK blocks (even: proxy_walk_gluon.py), each reduced and stored after it: a
    # store inside the walk's loop, beside its warpgroup MMAs, does not compile (Triton 3.6:
    # an assertion in the conversion to LLVM). The diagonal block, the one a mask applies
    # to, is walked alone, last.
    for start in range(0, diagonal + 1, CHUNK):
        end = gl.minimum(start + CHUNK, diagonal)
        chunk = walk_blocks(q, k_smem, k_ready, k_empty, start, end, chunk, columns, _enter)
        if diagonal < start + CHUNK:  # the diagonal is in this run: walked after the rest
            chunk = walk_blocks(q, k_smem, k_ready, k_empty, diagonal, diagonal + 1, chunk,
                                (columns, first), _enter_diagonal)  # fmt: skip
        row_values = (row_valid, row_scales, columns)
        _store_chunk(chunk, start, gl.minimum(start + CHUNK - 1, diagonal), row_values,
                     out_row, k_scales, scale, SCALED)  # fmt: skip
    tail_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    for start in range(diagonal + 1, num_kv_blocks, TAIL_COLUMNS):
        blocks = start + gl.arange(0, TAIL_COLUMNS, layout=tail_layout)  # [TAIL_COLUMNS]
        gl.store(out_row + blocks, gl.full([TAIL_COLUMNS], float("-inf"), gl.float32,
                                           tail_layout), mask=blocks < num_kv_blocks)  # fmt: skip


@gluon.jit
def _block_scores_kernel(
    q_proxy, k_desc, scores, q_scales, k_scales, stride_q_b, stride_q_s, stride_q_h,
    stride_o_b, stride_o_h, stride_o_q, stride_qs_b, stride_qs_s, stride_ks_b, stride_ks_h,
    seq_len, num_kv_blocks, proxy_group, scale, PROXY_DIM: gl.constexpr,
    SCALED: gl.constexpr, NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """Grid (nq, H_p / 2, B), the longest walks first. k_desc: a TMA view [B * S, H_pk * D_p]
    of the proxy keys in blocks [128, D_p]; q_scales fp32 [B, S, H_p] and k_scales fp32
    [B, H_pk, num_kv_blocks] with SCALED (FP8), else unread."""
    KEYS: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = k_desc.dtype
    ROWS: gl.constexpr = Q_BLOCK
    q_block = gl.num_programs(0) - 1 - gl.program_id(0)
    first_head = gl.program_id(1) * PACK
    batch = gl.program_id(2).to(gl.int64)
    key_head = first_head // proxy_group  # PACK divides the group: one key head for both
    first = q_block * ROWS
    diagonal = (gl.minimum(first + ROWS, seq_len) - 1) // KEYS

    # Each head's query rows, once, into shared memory: its consumer's A operand.
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, PROXY_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [PACK, ROWS, PROXY_DIM], q_layout)
    load_layout: gl.constexpr = row_layout(PROXY_DIM)  # [Q_BLOCK, D_p] over 4 warps
    dims = gl.arange(0, PROXY_DIM, layout=gl.SliceLayout(0, load_layout))  # [D_p]
    positions = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, load_layout))  # [Q_BLOCK]
    for head in gl.static_range(PACK):
        offsets = (batch * stride_q_b + positions.to(gl.int64) * stride_q_s
                   + (first_head + head) * stride_q_h)  # fmt: skip
        q_head = gl.load(q_proxy + gl.expand_dims(offsets, 1) + gl.expand_dims(dims, 0),
                         mask=gl.expand_dims(positions < seq_len, 1), other=0.0)  # fmt: skip
        q_smem.index(head).store(q_head)  # [Q_BLOCK, D_p]
    k_smem, k_ready, k_empty = key_ring(k_desc, NUM_STAGES)

    q_scales += batch * stride_qs_b + first_head
    k_scales += batch * stride_ks_b + key_head * stride_ks_h
    out_row = scores + batch * stride_o_b + first_head * stride_o_h + q_block * stride_o_q
    tile_values = (first, seq_len, diagonal, num_kv_blocks, out_row, stride_o_h, stride_qs_s,
                   scale)  # fmt: skip
    # The default partition (this kernel's 4 warps) is the first consumer.
    gl.warp_specialize(
        [(_consumer, (q_smem, k_smem, k_ready, k_empty, q_scales, k_scales, tile_values, 0,
                      SCALED)),
         (_consumer, (q_smem, k_smem, k_ready, k_empty, q_scales, k_scales, tile_values, 1,
                      SCALED)),
         (load_key_tiles, (k_desc, k_smem, k_ready, k_empty, gl.program_id(2) * seq_len,
                           key_head * PROXY_DIM, diagonal + 1))],
        [CONSUMER_WARPS, PRODUCER_WARPS],
        [CONSUMER_REGISTERS, PRODUCER_REGISTERS],
    )  # fmt: skip


def scores(q_proxy, k_proxy, q_scales, k_scales, out, *, scale: float) -> None:
    """Fill out (fp32 [B, H_p, nq, nk]) with the block scores of q_proxy [B, S, H_p, D_p] over
    k_proxy [B, S, H_pk, D_p] (both in the scoring dtype; for FP8 their factors q_scales fp32
    [B, S, H_p] and k_scales fp32 [B, H_pk, nk], else None), times `scale`. The caller
    checked the call (supports)."""
    batch, seq_len, heads, proxy_dim = q_proxy.shape
    key_heads = k_proxy.shape[2]
    k_desc = key_descriptor(k_proxy)
    scaled = k_scales is not None
    grid = (triton.cdiv(seq_len, Q_BLOCK.value), heads // PACK.value, batch)
    _block_scores_kernel[grid](
        q_proxy=q_proxy, k_desc=k_desc, scores=out, q_scales=q_scales if scaled else out,
        k_scales=k_scales if scaled else out, stride_q_b=q_proxy.stride(0),
        stride_q_s=q_proxy.stride(1), stride_q_h=q_proxy.stride(2), stride_o_b=out.stride(0),
        stride_o_h=out.stride(1), stride_o_q=out.stride(2),
        stride_qs_b=q_scales.stride(0) if scaled else 0,
        stride_qs_s=q_scales.stride(1) if scaled else 0,
        stride_ks_b=k_scales.stride(0) if scaled else 0,
        stride_ks_h=k_scales.stride(1) if scaled else 0, seq_len=seq_len,
        num_kv_blocks=out.shape[3], proxy_group=heads // key_heads, scale=scale,
        PROXY_DIM=proxy_dim, SCALED=scaled, NUM_STAGES=NUM_STAGES, num_warps=4,
        maxnreg=MAX_REGISTERS,
    )  # fmt: skip


def compile_for_sm90(workdir: str, scores: str = "bf16", proxy_dim: int = 128) -> dict:
    """Compile the kernel for sm_90a without a GPU (scores "bf16", "fp16" or "fp8e4nv") and
    report as ops.gluon.codegen.compile_forward does, plus "maxima_under_products": the most
    FMNMX (row maxima) between a product's issue and the next MMA wait (0 if they do not
    overlap)."""
    from flash_msa.ops.gluon import codegen

    types = dict(q_proxy=f"*{scores}", k_desc=codegen.descriptor_type(scores, KV_BLOCK, proxy_dim),
                 scores="*fp32", q_scales="*fp32", k_scales="*fp32", scale="fp32")  # fmt: skip
    constexprs = dict(PROXY_DIM=proxy_dim, SCALED=scores == "fp8e4nv", NUM_STAGES=NUM_STAGES)
    report = codegen.compile_kernel(_block_scores_kernel, types, constexprs, workdir,
                                    f"block_scores_{scores}_d{proxy_dim}")  # fmt: skip
    with open(report["sass"]) as handle:
        report["maxima_under_products"] = codegen.instructions_under_mma(handle.read(), "FMNMX")
    return report
