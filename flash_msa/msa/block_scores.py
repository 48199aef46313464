"""MSA block scores: the max causal proxy logit of every (query block, kv block) pair.

score(b, c) = proxy_softmax_scale * max over i in query block b, j in kv block c, j <= i of
q_proxy[i] . k_proxy[j]; -inf where no pair exists (c past the diagonal). One program owns
one query block of one batch for PACK proxy heads that share a proxy key head (so each key
tile is loaded once for them, and a 64-position query block still makes a 128-row tile), and
walks the kv blocks c <= diagonal: S = Q K^T per tile, reduced by max, never exponentiated
and never written. Memory: the [B, H_p, nq, nk] output only. With q_blocks (context
parallelism) q_proxy holds some query blocks of the sequence k_proxy holds whole, and row i of
the scores is global query block q_blocks[i]: masks and documents see global positions.
With score_dtype float8_e4m3fn the products run in FP8 (msa/fp8.py): each row's maximum over
a kv block is multiplied by its query row's and the block's factors before the max over the
query block's rows, so the scores approximate the proxies' own. On sm_90 the calls
block_scores_gluon.py takes run its kernel instead (the same scores, the products on
asynchronous warpgroup MMAs).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from flash_msa import _env
from flash_msa.layout import check_block_size
from flash_msa.msa import block_scores_gluon
from flash_msa.msa.fp8 import FP8, check_score_dtype, quantize_proxies
from flash_msa.ops.interface import check_softmax_scale
from flash_msa.ops.triton.common import strides
from flash_msa.patterns.topk import check_query_blocks
from flash_msa.sequences import check_document_ids

MAX_TILE_ROWS = 128  # query rows (positions x packed heads) of one program
TAIL_COLUMNS = 64  # -inf columns written per store past the diagonal


@triton.jit
def _kv_block_max(
    q_tile,
    k_base,
    stride_k_s,
    positions,
    kv_first,
    kv_end,
    documents,
    row_documents,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    HAS_DOCUMENTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Max over keys [kv_first, kv_end) of each row's logit: [BLOCK_M] fp32. Without
    CAUSAL_MASK every key is visible to every row (whole blocks before the first query);
    with it keys after a row's position, or at kv_end and past, count as -inf, and with
    HAS_DOCUMENTS also keys of another document (documents: int32 [S] of this batch row,
    row_documents [BLOCK_M] those of the rows)."""
    dims = tl.arange(0, HEAD_DIM_PAD)  # [D_PAD]
    row_max = tl.full(positions.shape, float("-inf"), tl.float32)  # [BLOCK_M]
    for start in range(kv_first, kv_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        k_pointers = k_base + keys.to(tl.int64)[:, None] * stride_k_s + dims[None, :]
        if CAUSAL_MASK:
            key_valid = keys < kv_end
            k_tile = tl.load(
                k_pointers, mask=key_valid[:, None] & (dims[None, :] < HEAD_DIM), other=0.0
            )  # [BLOCK_N, D_PAD]
            logits = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION)  # [M, N]
            visible = (keys[None, :] <= positions[:, None]) & key_valid[None, :]  # [M, N]
            if HAS_DOCUMENTS:
                key_documents = tl.load(documents + keys, mask=key_valid, other=-1)  # [N]
                visible &= key_documents[None, :] == row_documents[:, None]
            logits = tl.where(visible, logits, float("-inf"))
        else:
            k_tile = tl.load(k_pointers, mask=dims[None, :] < HEAD_DIM, other=0.0)  # [N, D_PAD]
            logits = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION)  # [M, N]
        row_max = tl.maximum(row_max, tl.max(logits, axis=1))  # [BLOCK_M]
    return row_max


@triton.jit
def _store_block_max(
    out_row, c, row_max, row_valid, scale, row_scales, k_scales, Q_BLOCK: tl.constexpr,
    PACK: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """Reduce [BLOCK_M] row maxima to one score per packed head and store column c. SCALED:
    the rows' and kv block c's FP8 factors (row_scales [BLOCK_M], k_scales fp32
    [num_kv_blocks] of this key head) turn them into the proxies' maxima first."""
    if SCALED:  # positive factors: the max of the scaled logits is the scaled max
        row_max *= row_scales * tl.load(k_scales + c)
    # Rows past the sequence end hold zero queries: drop them before the max over rows.
    row_max = tl.where(row_valid, row_max, float("-inf"))  # [BLOCK_M]
    head_max = tl.max(tl.reshape(row_max, (Q_BLOCK, PACK)), axis=0)  # [PACK]
    tl.store(out_row + c, head_max * scale)


@triton.jit
def _block_scores_kernel(
    q_proxy,
    k_proxy,
    scores,
    stride_q_b,
    stride_q_s,
    stride_q_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_o_b,
    stride_o_h,
    stride_o_q,
    q_scales,
    stride_qs_b,
    stride_qs_s,
    k_scales,
    stride_ks_b,
    stride_ks_h,
    documents,
    stride_doc_b,
    q_blocks,
    seq_len,
    num_kv_blocks,
    proxy_group,
    scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    PACK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TAIL: tl.constexpr,
    HAS_DOCUMENTS: tl.constexpr,
    HAS_Q_BLOCKS: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    q_block_id = tl.program_id(0)  # the row of scores and the block of q_proxy
    first_head = tl.program_id(1) * PACK
    batch = tl.program_id(2).to(tl.int64)
    key_head = first_head // proxy_group  # PACK divides the group: one key head for all

    # Rows: Q_BLOCK positions x PACK heads, heads fastest (adjacent in [S, H, D] memory).
    rows = tl.arange(0, Q_BLOCK * PACK)  # [BLOCK_M]
    q_rows = q_block_id * Q_BLOCK + rows // PACK  # [BLOCK_M]: rows of q_proxy
    first = q_block_id * Q_BLOCK  # global position of the block's first query
    if HAS_Q_BLOCKS:
        first = tl.load(q_blocks + q_block_id) * Q_BLOCK
    positions = first + rows // PACK  # [BLOCK_M]
    row_valid = positions < seq_len  # a short local block is the ragged global last one
    dims = tl.arange(0, HEAD_DIM_PAD)  # [D_PAD]
    q_offsets = q_rows.to(tl.int64) * stride_q_s + (first_head + rows % PACK) * stride_q_h
    q_tile = tl.load(
        q_proxy + batch * stride_q_b + q_offsets[:, None] + dims[None, :],
        mask=row_valid[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )  # [BLOCK_M, D_PAD]
    k_base = k_proxy + batch * stride_k_b + key_head * stride_k_h
    row_scales = tl.full((Q_BLOCK * PACK,), 1.0, tl.float32)  # [BLOCK_M]
    if SCALED:
        row_scales = tl.load(
            q_scales + batch * stride_qs_b + q_rows.to(tl.int64) * stride_qs_s + first_head
            + rows % PACK, mask=row_valid, other=1.0,
        )  # fmt: skip
        k_scales += batch * stride_ks_b + key_head * stride_ks_h

    heads = first_head + tl.arange(0, PACK)  # [PACK]
    out_row = (
        scores + batch * stride_o_b + heads.to(tl.int64) * stride_o_h + q_block_id * stride_o_q
    )
    last = tl.minimum(first + Q_BLOCK, seq_len) - 1
    diagonal = last // KV_BLOCK
    documents += batch * stride_doc_b
    row_documents = positions  # unused without documents
    if HAS_DOCUMENTS:
        row_documents = tl.load(documents + positions, mask=row_valid, other=-2)  # [BLOCK_M]
    # kv blocks wholly at or before the first query need no causal mask (but documents do).
    unmasked_end = 0 if HAS_DOCUMENTS else (first + 1) // KV_BLOCK
    for c in range(0, unmasked_end):
        row_max = _kv_block_max(
            q_tile, k_base, stride_k_s, positions, c * KV_BLOCK, (c + 1) * KV_BLOCK, documents,
            row_documents, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, False, False, DOT_PRECISION,
        )  # fmt: skip
        _store_block_max(
            out_row, c, row_max, row_valid, scale, row_scales, k_scales, Q_BLOCK, PACK, SCALED
        )
    for c in range(unmasked_end, diagonal + 1):  # one block unless q_block > kv_block
        row_max = _kv_block_max(
            q_tile, k_base, stride_k_s, positions, c * KV_BLOCK,
            tl.minimum((c + 1) * KV_BLOCK, last + 1), documents, row_documents,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, True, HAS_DOCUMENTS, DOT_PRECISION,
        )  # fmt: skip
        _store_block_max(
            out_row, c, row_max, row_valid, scale, row_scales, k_scales, Q_BLOCK, PACK, SCALED
        )
    for start in range(diagonal + 1, num_kv_blocks, TAIL):
        columns = start + tl.arange(0, TAIL)  # [TAIL]
        tail = tl.full((PACK, TAIL), float("-inf"), tl.float32)  # [PACK, TAIL]
        tl.store(out_row[:, None] + columns[None, :], tail, mask=columns[None, :] < num_kv_blocks)


def _configs(kv_block: int, block_m: int) -> list[triton.Config]:
    """BLOCK_N (key rows per dot, dividing kv_block), warps and stages; one under the
    interpreter, which cannot time them (BLOCK_N 32 < kv_block keeps sub-block steps tested).
    Compiled for sm_90 with Triton 3.6's ptxas (bf16, D_p = 128): every config uses wgmma;
    4 warps spill on 128 x 128 tiles, so they only get smaller ones."""
    if _env.interpreting():
        return [triton.Config({"BLOCK_N": min(kv_block, 32)}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_N": size}, num_warps=warps, num_stages=stages)
        for size in sorted({min(kv_block, 64), min(kv_block, 128)})
        for warps in ((4, 8) if block_m * size < 128 * 128 else (8,))
        for stages in (2, 3, 4)
    ]


@functools.cache
def _tuned_kernel(kv_block: int, block_m: int):
    return triton.autotune(
        configs=_configs(kv_block, block_m),
        key=["HEAD_DIM_PAD", "Q_BLOCK", "KV_BLOCK", "PACK", "SCALED"],
    )(_block_scores_kernel)


def _pack(q_block: int, group: int) -> int:
    """Proxy heads per program: a power of two dividing the group, up to MAX_TILE_ROWS rows."""
    return min(group & -group, max(MAX_TILE_ROWS // q_block, 1))


def _check(q_proxy, k_proxy, q_block, kv_block, proxy_softmax_scale, q_blocks, out) -> tuple:
    """Validate block_scores' arguments; returns the scores' shape [B, H_p, nq, nk]."""
    for name, tensor in (("q_proxy", q_proxy), ("k_proxy", k_proxy)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, S, H, D_p], got shape {list(tensor.shape)}")
        if tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(
                f"{name} must be float16, bfloat16 or float32, got {tensor.dtype}; "
                "block_scores_reference handles float64"
            )
    if q_proxy.dtype != k_proxy.dtype or q_proxy.device != k_proxy.device:
        raise ValueError(
            f"q_proxy ({q_proxy.dtype}, {q_proxy.device}) and k_proxy ({k_proxy.dtype}, "
            f"{k_proxy.device}) must share dtype and device"
        )
    q_shape, k_shape = q_proxy.shape, k_proxy.shape
    batch, seq_len_q, heads = q_shape[:3]
    matching = (0, 1, 3) if q_blocks is None else (0, 3)  # with q_blocks k_proxy is global
    if any(k_shape[axis] != q_shape[axis] for axis in matching):
        sizes = "B, S and D_p" if q_blocks is None else "B and D_p (it holds the whole sequence)"
        raise ValueError(f"k_proxy {list(k_shape)} must match q_proxy {list(q_shape)} in {sizes}")
    if min(heads, k_shape[2], q_shape[3], seq_len_q, k_shape[1]) < 1:
        raise ValueError(
            f"q_proxy {list(q_shape)} and k_proxy {list(k_shape)} need at least one position, "
            "head and head dim each"
        )
    if heads % k_shape[2] != 0:
        raise ValueError(
            f"proxy heads H_p = {heads} must be a multiple of proxy key heads H_pk = {k_shape[2]}"
        )
    check_block_size("q_block", q_block)
    check_block_size("kv_block", kv_block)
    check_softmax_scale("proxy_softmax_scale", proxy_softmax_scale)  # > 0: a max comes first
    seq_len = k_shape[1]
    if q_blocks is not None:
        check_query_blocks(q_blocks, seq_len_q=seq_len_q, seq_len=seq_len, q_block=q_block,
                           device=q_proxy.device)  # fmt: skip
    shape = (batch, heads, math.ceil(seq_len_q / q_block), math.ceil(seq_len / kv_block))
    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out is not None and (
        tuple(out.shape) != shape
        or out.dtype != torch.float32
        or out.device != q_proxy.device
        or out.stride(-1) != 1
        or any(step == 0 and size > 1
               for step, size in zip(out.stride(), out.shape, strict=True))
    ):
        raise ValueError(
            f"out must be a float32 {list(shape)} tensor on {q_proxy.device} with unit last "
            f"stride and no expanded dimension, got {out.dtype} {list(out.shape)} stride "
            f"{out.stride()} on {out.device}"
        )
    return shape


@torch.library.custom_op("flash_msa::block_scores", mutates_args={"out"})
@_env.on_tensor_device
def _block_scores(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    document_ids: torch.Tensor | None,
    q_blocks: torch.Tensor | None,
    q_scales: torch.Tensor | None,
    k_scales: torch.Tensor | None,
    out: torch.Tensor,
    q_block: int,
    kv_block: int,
    scale: float,
) -> None:
    batch, _, heads, dim = q_proxy.shape
    group = heads // k_proxy.shape[2]
    if block_scores_gluon.supports(q_proxy, group, q_block, kv_block, document_ids is not None,
                                   q_blocks is not None):  # fmt: skip
        block_scores_gluon.scores(q_proxy, k_proxy, q_scales, k_scales, out, scale=scale)
        return
    pack = _pack(q_block, group)
    # Without documents or q_blocks, out stands in for their pointers (never read).
    documents = out if document_ids is None else document_ids
    _tuned_kernel(kv_block, q_block * pack)[(out.shape[2], heads // pack, batch)](
        q_proxy=q_proxy, k_proxy=k_proxy, scores=out, **strides("q", q_proxy),
        **strides("k", k_proxy), **strides("o", out, "bhq"),
        q_scales=out if q_scales is None else q_scales,
        stride_qs_b=0 if q_scales is None else q_scales.stride(0),
        stride_qs_s=0 if q_scales is None else q_scales.stride(1),
        k_scales=out if k_scales is None else k_scales,
        stride_ks_b=0 if k_scales is None else k_scales.stride(0),
        stride_ks_h=0 if k_scales is None else k_scales.stride(1), documents=documents,
        stride_doc_b=0 if document_ids is None else document_ids.stride(0),
        q_blocks=out if q_blocks is None else q_blocks, seq_len=k_proxy.shape[1],
        num_kv_blocks=out.shape[3], proxy_group=group, scale=scale, HEAD_DIM=dim,
        HEAD_DIM_PAD=max(_env.head_dim_pad(dim), 32 if k_scales is not None else 16),  # FP8 dots
        Q_BLOCK=q_block, KV_BLOCK=kv_block, PACK=pack,
        DOT_PRECISION=_env.dot_precision(q_proxy.dtype), TAIL=TAIL_COLUMNS,
        HAS_DOCUMENTS=document_ids is not None, HAS_Q_BLOCKS=q_blocks is not None,
        SCALED=k_scales is not None,
    )  # fmt: skip


@_block_scores.register_fake
def _(q_proxy, k_proxy, document_ids, q_blocks, q_scales, k_scales, out, q_block, kv_block,
      scale):
    return None


def block_scores(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    *,
    q_block: int,
    kv_block: int,
    proxy_softmax_scale: float | None = None,
    document_ids: torch.Tensor | None = None,
    q_blocks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    score_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Block scores of the module docstring; every element is written, so `out` may be
    reused across steps.

    Args:
        q_proxy: [B, S_q, H_p, D_p]; k_proxy: [B, S, H_pk, D_p]; proxy head p reads key head
            p // (H_p / H_pk). S_q = S without q_blocks.
        q_block, kv_block: the block sizes of the scores' grid.
        proxy_softmax_scale: defaults to 1 / sqrt(D_p).
        document_ids: int32 [B, S], non-decreasing along S: only pairs within one document
            count; a block sharing no document with the query block scores -inf.
        q_blocks: int [nq] on q_proxy's device, or None (q_proxy holds the whole sequence):
            the global query block of each block of q_block rows of q_proxy (context
            parallelism), any order; only a last block may be short, and then it is the
            ragged global last block. Row i of the scores is then row q_blocks[i] of the
            whole sequence's scores. Its checks read it once from the device (not under
            torch.compile).
        out: fp32 [B, H_p, nq, nk] to write into; nq = ceil(S_q / q_block).
        score_dtype: None (the proxies' dtype) or torch.float8_e4m3fn: the products in FP8
            with fp32 accumulation (quantize_proxies' scaling), on GPUs of compute
            capability 8.9 or more or under the interpreter; the scores then approximate
            the proxies' own to e4m3's rounding.

    Returns:
        fp32 [B, H_p, nq, nk] block scores (out, when given).
    """
    shape = _check(q_proxy, k_proxy, q_block, kv_block, proxy_softmax_scale, q_blocks, out)
    check_score_dtype(score_dtype, q_proxy.device)
    batch, seq_len, dim = q_proxy.shape[0], k_proxy.shape[1], q_proxy.shape[3]
    scale = 1.0 / math.sqrt(dim) if proxy_softmax_scale is None else proxy_softmax_scale
    q_proxy = q_proxy if q_proxy.stride(-1) == 1 else q_proxy.contiguous()
    k_proxy = k_proxy if k_proxy.stride(-1) == 1 else k_proxy.contiguous()
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=q_proxy.device)
    if document_ids is not None:
        check_document_ids(document_ids, batch, seq_len, q_proxy.device)
        document_ids = document_ids.to(torch.int32).contiguous()
    if q_blocks is not None:
        q_blocks = q_blocks.to(torch.int32).contiguous()
    q_scales = k_scales = None
    if score_dtype == FP8:
        q_proxy, q_scales, k_proxy, k_scales = quantize_proxies(q_proxy, k_proxy, kv_block)
    _block_scores(q_proxy, k_proxy, document_ids, q_blocks, q_scales, k_scales, out,
                  q_block=q_block, kv_block=kv_block, scale=scale)  # fmt: skip
    return out
