"""MSA's KL loss between the main attention (teacher) and the proxy attention (student).

For query token i and proxy head p, over the keys j the main attention used for i (the
selected blocks, causal, within i's document):
  t(i, j) = mean over the query heads h of p's group of exp(scale * q_h[i] . k[j] - lse_h[i])
  s(i, j) = softmax over the same keys of proxy_scale * q_proxy_p[i] . k_proxy[j]
  kl(i, p) = sum_j t log(t / s) = sum_j t (log t - z) + lse_proxy(i) * sum_j t
where z is the scaled proxy logit and lse_proxy its log-sum-exp over the keys. kl_loss is the
mean of kl over the N (token, proxy head) terms, or their sum. Its gradient reaches the proxy
only: d kl_loss / d z(i, j) = (s - t) / N (N = 1 for the sum). Two kernels over the block
layout: the rows kernel recomputes the teacher from q, k and the main attention's lse (never
stored) and, when the proxies need gradients, writes d kl_loss / d q_proxy and each entry's
tile of d kl_loss / d z (a first walk over the student alone finds its lse, the second
recomputes the teacher once for the loss and both gradients); dk_proxy walks the transposed
layout (per kv block, the query blocks that use it) and multiplies the tiles by q_proxy.
The tiles take at most GRAD_TILE_BYTES at a time (chunks of query blocks), so both
gradients leave the forward; the backward scales them by d loss / d kl_loss. With q_blocks (context
parallelism) the queries are some query blocks of the sequence the keys hold whole: local
query block b sits at global query block q_blocks[b], where causality and documents see it.
With query_masks (per-token selections, as the main attention's query_masks) token i sees
only the blocks its own bits select: its teacher and student are both over exactly the keys
its main attention used.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from flash_msa import _env
from flash_msa.layout import BlockLayout, check_block_size
from flash_msa.msa import kl_gluon
from flash_msa.msa.checks import check_tensors
from flash_msa.ops.interface import (
    check_layout_device,
    check_query_masks,
    check_softmax_scale,
)
from flash_msa.ops.triton.common import first_at_least, strides
from flash_msa.patterns.topk import check_query_blocks
from flash_msa.sequences import check_document_ids

LOG2_E: tl.constexpr = tl.constexpr(_env.LOG2_E)


@triton.jit
def _visible(rows, cols, seq_len, documents, HAS_DOCUMENTS: tl.constexpr):
    """bool [M, N]: key col is causal for query row, both inside the sequence and, with
    documents (int32 [S] of this batch row), in the same document."""
    visible = (cols[None, :] <= rows[:, None]) & (rows[:, None] < seq_len)
    if HAS_DOCUMENTS:
        doc_rows = tl.load(documents + rows, mask=rows < seq_len, other=-1)
        doc_cols = tl.load(documents + cols, mask=cols < seq_len, other=-2)
        visible &= doc_rows[:, None] == doc_cols[None, :]
    return visible


@triton.jit
def _selected(query_masks, entry, Q_BLOCK: tl.constexpr):
    """bool [Q_BLOCK]: the rows of an entry's query block whose bit is set in its int64 word
    (they read its kv block)."""
    word = tl.load(query_masks + entry)
    return ((word >> tl.arange(0, Q_BLOCK).to(tl.int64)) & 1) != 0


@triton.jit
def _positions(q_blocks, block, rows, Q_BLOCK: tl.constexpr, HAS_Q_BLOCKS: tl.constexpr):
    """[Q_BLOCK] global positions of local query block `block` (rows [Q_BLOCK], its rows of
    q_proxy, q and lse): rows themselves without q_blocks."""
    positions = rows
    if HAS_Q_BLOCKS:
        positions = tl.load(q_blocks + block) * Q_BLOCK + tl.arange(0, Q_BLOCK)
    return positions


@triton.jit
def _load_rows(
    base, positions, stride_s, seq_len, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr
):
    """[len(positions), HEAD_DIM_PAD] tile of one head; zeros outside the sequence."""
    dims = tl.arange(0, HEAD_DIM_PAD)
    pointers = base + positions.to(tl.int64)[:, None] * stride_s + dims[None, :]
    return tl.load(
        pointers, mask=(positions[:, None] < seq_len) & (dims[None, :] < HEAD_DIM), other=0.0
    )


@triton.jit
def _teacher(
    q_group, stride_q_s, stride_q_h, lse_group, stride_lse_h, k_tile, rows, visible, seq_len,
    group, qk_scale_log2,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HEADS_AS_ROWS: tl.constexpr,
    GROUP_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """t fp32 [M, N]: the main attention probabilities averaged over the group's
    query heads (q_group, lse_group point at the group's first head), 0 where not visible;
    rows are any query rows (M >= 2). HEADS_AS_ROWS: rows is one token (M = 1; queries as
    rows), whose group's heads make the rows of the products."""
    if HEADS_AS_ROWS:
        row = tl.max(rows, axis=0)  # the token
        heads = tl.arange(0, GROUP_PAD)  # [G_PAD]
        valid = (heads < group) & (row < seq_len)  # [G_PAD]
        q_heads = _load_rows(
            q_group + row.to(tl.int64) * stride_q_s, heads, stride_q_h, group, HEAD_DIM,
            HEAD_DIM_PAD,
        )  # fmt: skip  # [G_PAD, D_PAD]
        lse = tl.load(lse_group + heads * stride_lse_h + row, mask=valid, other=0.0)
        logits = tl.dot(q_heads, tl.trans(k_tile), input_precision=DOT_PRECISION) * qk_scale_log2
        probs = tl.where(valid[:, None], tl.exp2(logits - lse[:, None] * LOG2_E), 0.0)
        teacher = tl.sum(probs, axis=0)[None, :]  # [1, N]
    else:
        teacher = tl.zeros(visible.shape, tl.float32)
        for head in range(group):
            q_tile = _load_rows(
                q_group + head * stride_q_h, rows, stride_q_s, seq_len, HEAD_DIM, HEAD_DIM_PAD
            )
            lse = tl.load(lse_group + head * stride_lse_h + rows, mask=rows < seq_len, other=0.0)
            logits = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION)
            teacher += tl.exp2(logits * qk_scale_log2 - lse[:, None] * LOG2_E)
    return tl.where(visible, teacher / group, 0.0)


@triton.jit
def _student_logits(qp_tile, kp_tile, visible, proxy_scale, DOT_PRECISION: tl.constexpr):
    """z fp32 [M, N], the scaled proxy logits; -inf where not visible."""
    if qp_tile.shape[0] > 1:  # tl.dot pads small tiles on tensor cores
        logits = tl.dot(qp_tile, tl.trans(kp_tile), input_precision=DOT_PRECISION)
    else:  # a query block of one token
        logits = tl.sum(qp_tile.to(tl.float32)[:, None, :] * kp_tile.to(tl.float32)[None, :, :], 2)
    logits *= proxy_scale
    return tl.where(visible, logits, float("-inf"))


@triton.jit
def _online_lse(running_max, running_sum, logits):
    """The running (max, sum of exp(z - max)) of rows [M] after the logits [M, N] (-inf where
    not visible)."""
    new_max = tl.maximum(running_max, tl.max(logits, axis=1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    running_sum = running_sum * tl.exp(running_max - safe_max) + tl.sum(
        tl.exp(logits - safe_max[:, None]), axis=1
    )
    return new_max, running_sum


@triton.jit
def _kl_rows_kernel(
    q_proxy, k_proxy, q, k, lse, documents, q_blocks, row_offsets, col_indices, query_masks,
    grad_scale, lse_proxy, kl_rows, grad_q_proxy, grad_tiles,
    stride_qp_b, stride_qp_s, stride_qp_h, stride_kp_b, stride_kp_s, stride_kp_h,
    stride_q_b, stride_q_s, stride_q_h, stride_k_b, stride_k_s, stride_k_h,
    stride_lse_b, stride_lse_h, stride_doc_b,
    seq_len, seq_len_q, heads_proxy, proxy_group, kv_group, group, heads_per_layout,
    num_q_blocks, proxy_scale, qk_scale_log2, layout_row, block_start, entry_start,
    chunk_entries, batch_base, head_base,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PROXY_DIM: tl.constexpr,
    PROXY_DIM_PAD: tl.constexpr, Q_BLOCK: tl.constexpr, KV_BLOCK: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HAS_DOCUMENTS: tl.constexpr, HAS_Q_BLOCKS: tl.constexpr, HAS_QUERY_MASKS: tl.constexpr,
    GRAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (query block, copy) of a chunk (see _chunks): query block
    block_start + program_id(0) of layout row layout_row, read by copy program_id(1) (batch
    batch_base + copy // heads_per_layout, proxy head head_base + copy % heads_per_layout);
    walks its CSR row and writes kl_rows and lse_proxy [B, H_p, S_q]. With GRAD also
    grad_q_proxy = d kl_loss / d q_proxy [B, S_q, H_p, D_p] times grad_scale (d kl_loss /
    d kl(i, p): 1 / N or 1), and per entry e its tile of d kl_loss / d z, (s - t) grad_scale
    [KV_BLOCK keys, Q_BLOCK rows], at tile copy * chunk_entries + e - entry_start of
    grad_tiles (the dk_proxy kernel's input): a first walk over the student alone finds
    lse_proxy, the second recomputes the teacher once for the loss and both gradients.
    seq_len counts keys, seq_len_q queries (read with HAS_Q_BLOCKS only: else both are S).
    HAS_QUERY_MASKS: query_masks (int64 [nnz], aligned with col_indices) keep, per block, the
    rows whose bit is set."""
    block = block_start + tl.program_id(0)
    batch = batch_base + tl.program_id(1) // heads_per_layout
    head = head_base + tl.program_id(1) % heads_per_layout
    query_len = seq_len
    if HAS_Q_BLOCKS:
        query_len = seq_len_q
    rows = block * Q_BLOCK + tl.arange(0, Q_BLOCK)  # [M]
    positions = _positions(q_blocks, block, rows, Q_BLOCK, HAS_Q_BLOCKS)  # [M]
    documents += batch * stride_doc_b
    qp_base = q_proxy + batch * stride_qp_b + head * stride_qp_h
    qp_tile = _load_rows(qp_base, rows, stride_qp_s, query_len, PROXY_DIM, PROXY_DIM_PAD)
    kp_base = k_proxy + batch * stride_kp_b + (head // proxy_group) * stride_kp_h
    k_base = k + batch * stride_k_b + (head // kv_group) * stride_k_h
    q_group = q + batch * stride_q_b + head * group * stride_q_h
    lse_group = lse + batch * stride_lse_b + head * group * stride_lse_h
    row_stats = batch * heads_proxy * query_len + head * query_len + rows  # into [B, H_p, S_q]
    row = row_offsets + layout_row * (num_q_blocks + 1) + block
    start, end = tl.load(row), tl.load(row + 1)
    running_max = tl.full((Q_BLOCK,), float("-inf"), tl.float32)
    running_sum = tl.zeros((Q_BLOCK,), tl.float32)
    if GRAD:  # the student's lse first: the gradient needs it in the walk below
        for entry in range(start, end):
            cols = tl.load(col_indices + entry) * KV_BLOCK + tl.arange(0, KV_BLOCK)  # [N]
            visible = _visible(positions, cols, seq_len, documents, HAS_DOCUMENTS)
            if HAS_QUERY_MASKS:
                visible &= _selected(query_masks, entry, Q_BLOCK)[:, None]
            kp_tile = _load_rows(kp_base, cols, stride_kp_s, seq_len, PROXY_DIM, PROXY_DIM_PAD)
            logits = _student_logits(qp_tile, kp_tile, visible, proxy_scale, DOT_PRECISION)
            running_max, running_sum = _online_lse(running_max, running_sum, logits)
        seen = running_sum != 0  # != : a NaN input stays NaN
        lse_p = tl.where(seen, running_max + tl.log(tl.where(seen, running_sum, 1.0)), float("inf"))
        grad_q = tl.zeros((Q_BLOCK, PROXY_DIM_PAD), tl.float32)  # [M, D_p]
        coefficient = tl.load(grad_scale)
    cross = tl.zeros((Q_BLOCK,), tl.float32)  # sum_j t (log t - z)
    teacher_sum = tl.zeros((Q_BLOCK,), tl.float32)
    for entry in range(start, end):
        cols = tl.load(col_indices + entry) * KV_BLOCK + tl.arange(0, KV_BLOCK)  # [N]
        visible = _visible(positions, cols, seq_len, documents, HAS_DOCUMENTS)
        if HAS_QUERY_MASKS:
            visible &= _selected(query_masks, entry, Q_BLOCK)[:, None]
        kp_tile = _load_rows(kp_base, cols, stride_kp_s, seq_len, PROXY_DIM, PROXY_DIM_PAD)
        k_tile = _load_rows(k_base, cols, stride_k_s, seq_len, HEAD_DIM, HEAD_DIM_PAD)
        logits = _student_logits(qp_tile, kp_tile, visible, proxy_scale, DOT_PRECISION)
        teacher = _teacher(
            q_group, stride_q_s, stride_q_h, lse_group, stride_lse_h, k_tile, rows, visible,
            query_len, group, qk_scale_log2, HEAD_DIM, HEAD_DIM_PAD, Q_BLOCK == 1, GROUP_PAD,
            DOT_PRECISION,
        )  # fmt: skip
        if GRAD:  # lse_p is +inf on rows that see no key: their student is 0
            student = tl.exp(logits - lse_p[:, None])  # 0 where not visible
            grad_logits = ((student - teacher) * coefficient).to(kp_tile.dtype)  # [M, N]
            tile = (tl.program_id(1) * chunk_entries + entry - entry_start).to(tl.int64)
            tl.store(grad_tiles + tile * (KV_BLOCK * Q_BLOCK) + tl.arange(0, Q_BLOCK)[:, None]
                     + tl.arange(0, KV_BLOCK)[None, :] * Q_BLOCK, grad_logits)  # fmt: skip
            if Q_BLOCK > 1:
                grad_q = tl.dot(grad_logits, kp_tile, grad_q, input_precision=DOT_PRECISION)
            else:  # a query block of one token: [1, N] x [N, D_p] as a broadcast sum
                grad_q += tl.sum(grad_logits.to(tl.float32)[:, :, None]
                                 * kp_tile.to(tl.float32)[None, :, :], 1)  # fmt: skip
        else:
            running_max, running_sum = _online_lse(running_max, running_sum, logits)
        used = teacher != 0  # visible and not underflowed (or NaN, kept): elsewhere 0
        log_ratio = tl.log(tl.where(used, teacher, 1.0)) - tl.where(used, logits, 0.0)
        cross += tl.sum(tl.where(used, teacher * log_ratio, 0.0), axis=1)
        teacher_sum += tl.sum(teacher, axis=1)
    seen = running_sum != 0
    lse_p = tl.where(seen, running_max + tl.log(tl.where(seen, running_sum, 1.0)), float("-inf"))
    kl = tl.where(teacher_sum != 0, cross + lse_p * teacher_sum, 0.0)
    tl.store(lse_proxy + row_stats, lse_p, mask=rows < query_len)
    tl.store(kl_rows + row_stats, kl, mask=rows < query_len)
    if GRAD:
        dims = tl.arange(0, PROXY_DIM_PAD)
        pointers = (grad_q_proxy + batch * stride_qp_b + head * stride_qp_h
                    + rows.to(tl.int64)[:, None] * stride_qp_s + dims[None, :])  # fmt: skip
        tl.store(pointers, (grad_q * proxy_scale).to(grad_q_proxy.dtype.element_ty),
                 mask=(rows[:, None] < query_len) & (dims[None, :] < PROXY_DIM))  # fmt: skip


@triton.jit
def _kl_dk_proxy_kernel(
    grad_tiles, q_proxy, grad_k_proxy, t_row_offsets, t_col_indices, t_entries,
    stride_qp_b, stride_qp_s, stride_qp_h, stride_gk_b, stride_gk_s, stride_gk_h,
    query_len, seq_len, num_kv_blocks, layout_row, entry_start, chunk_entries, batch_base,
    head, copy_head, heads_per_layout, key_head,
    PROXY_DIM: tl.constexpr, PROXY_DIM_PAD: tl.constexpr, Q_BLOCK: tl.constexpr,
    KV_BLOCK: tl.constexpr, ENTRIES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (kv block, batch of the chunk) for proxy head `head` of a chunk of
    layout row layout_row (see _chunks): adds to grad_k_proxy (fp32 [B, S, H_pk, D_p], key
    head key_head) the tiles of d kl_loss / d z that the rows kernel wrote for the entries of
    the transposed column that lie in the chunk, times their query rows of q_proxy: ENTRIES
    query blocks a step, their rows gathered into one [KV_BLOCK, ENTRIES * Q_BLOCK] tile
    (keys as rows: the gradient is the tile times q_proxy, no transpose). t_entries: each
    transposed entry's entry of col_indices (BlockLayout.transpose_entries). Programs own
    their rows and launches of one key head run one after another: no atomics."""
    block = tl.program_id(0)
    batch = batch_base + tl.program_id(1)
    copy = tl.program_id(1) * heads_per_layout + copy_head
    column = t_row_offsets + layout_row * (num_kv_blocks + 1) + block
    first, last = tl.load(column), tl.load(column + 1)
    slots = tl.arange(0, ENTRIES * Q_BLOCK)  # [M]: rows of the gathered tile
    offsets = slots % Q_BLOCK  # [M]: each row's offset in its query block
    keys = tl.arange(0, KV_BLOCK)  # [N]
    qp_base = q_proxy + batch * stride_qp_b + head * stride_qp_h
    grad_k = tl.zeros((KV_BLOCK, PROXY_DIM_PAD), tl.float32)
    # The column lists its query blocks in order, and so their entries: the chunk's are the
    # run [start, end) that two binary searches find.
    start = first_at_least(t_entries, first, last, entry_start)
    end = first_at_least(t_entries, start, last, entry_start + chunk_entries)
    for entry in range(start, end, ENTRIES):
        entries = entry + slots // Q_BLOCK  # [M]
        taken = entries < end
        tile = tl.load(t_entries + entries, mask=taken, other=0) - entry_start  # [M]
        rows = tl.load(t_col_indices + entries, mask=taken, other=0) * Q_BLOCK + offsets
        tiles = grad_tiles + (copy * chunk_entries + tile) * (KV_BLOCK * Q_BLOCK) + offsets
        grad_z = tl.load(tiles[None, :] + keys[:, None] * Q_BLOCK, mask=taken[None, :],
                         other=0.0)  # fmt: skip  # [N, M]
        qp_tile = _load_rows(qp_base, rows, stride_qp_s, query_len, PROXY_DIM, PROXY_DIM_PAD)
        grad_k = tl.dot(grad_z, qp_tile, grad_k, input_precision=DOT_PRECISION)
    if end > start:
        dims = tl.arange(0, PROXY_DIM_PAD)
        cols = block * KV_BLOCK + keys
        pointers = (grad_k_proxy + batch * stride_gk_b + key_head * stride_gk_h
                    + cols.to(tl.int64)[:, None] * stride_gk_s + dims[None, :])  # fmt: skip
        mask = (cols[:, None] < seq_len) & (dims[None, :] < PROXY_DIM)
        tl.store(pointers, tl.load(pointers, mask=mask) + grad_k, mask=mask)


def dk_proxy_entries(q_block: int) -> int:
    """Query blocks a dk_proxy step gathers into one tile: 32 tokens for rows of one token,
    else 64 rows."""
    return 32 if q_block == 1 else max(1, 64 // q_block)


def num_warps(kernel: str, q_block: int) -> int:
    """Warps of a KL program ("rows" or "dk_proxy"), the faster choices on an H200 at 128K
    tokens (docs/performance.md): rows of one token 8, query blocks of 2 to 32 rows 4 (as
    measured at 16), of 64 rows and more 8; dk_proxy 8 for gathered tiles of 64 rows or more,
    else 4."""
    if kernel == "rows":
        return 4 if 1 < q_block < 64 else 8
    return 8 if dk_proxy_entries(q_block) * q_block >= 64 else 4


def num_stages(kernel: str, q_block: int) -> int:
    """Software-pipelining stages of a KL program, measured like num_warps at D = D_p = 128 in
    bf16: Triton then loads the next head's query rows (and dk_proxy's next query blocks)
    during this one's products. The rows kernel takes 2 (3 for 64-row blocks), rows of one
    token 1; dk_proxy 3. _launch takes fewer where the tiles do not fit."""
    if kernel == "rows":
        return 1 if q_block == 1 else 3 if q_block >= 64 else 2
    return 3


_STAGES_THAT_FIT: dict[tuple, int] = {}


def _launch(kernel, grid, stages: int, arguments: dict) -> None:
    """kernel[grid](**arguments) at `stages` pipelining stages, or the most below that whose
    buffers fit the device's shared memory (at D 256, or with fp32 inputs, 3 stages of 64-row
    tiles need more than an H200's 227 KiB); the count found is kept per kernel, tile sizes,
    dtype and device, so later calls launch at once."""
    key = (kernel.fn.__name__, stages, arguments["q_proxy"].dtype, arguments["q_proxy"].device,
           *(value for name, value in sorted(arguments.items()) if name.isupper()))  # fmt: skip
    for count in range(_STAGES_THAT_FIT.get(key, stages), 0, -1):
        try:
            kernel[grid](num_stages=count, **arguments)
        except OutOfResources:
            if count == 1:
                raise
            continue
        _STAGES_THAT_FIT[key] = count
        return


def _kernel_arguments(
    q_proxy, k_proxy, q, k, lse, documents, q_blocks, layout: BlockLayout, scales
):
    """The keyword arguments the two kernels share."""
    batch, seq_len_q, heads_proxy, proxy_dim = q_proxy.shape
    heads_q, heads_kv, dim = q.shape[2], k.shape[2], q.shape[3]
    proxy_scale, softmax_scale = scales
    has_documents = documents is not None
    documents = documents if has_documents else lse.new_zeros(1, dtype=torch.int32)
    return dict(
        q_proxy=q_proxy, k_proxy=k_proxy, q=q, k=k, lse=lse, documents=documents,
        q_blocks=documents if q_blocks is None else q_blocks,  # never read without q_blocks
        **strides("qp", q_proxy), **strides("kp", k_proxy), **strides("q", q), **strides("k", k),
        **strides("lse", lse, "bh"), stride_doc_b=documents.stride(0) if has_documents else 0,
        seq_len=k.shape[1], seq_len_q=seq_len_q, heads_proxy=heads_proxy,
        proxy_group=heads_proxy // k_proxy.shape[2],
        kv_group=heads_proxy // heads_kv, group=heads_q // heads_proxy,
        heads_per_layout=heads_proxy // layout.layout_heads, proxy_scale=proxy_scale,
        qk_scale_log2=softmax_scale * _env.LOG2_E, HEAD_DIM=dim,
        HEAD_DIM_PAD=_env.head_dim_pad(dim), PROXY_DIM=proxy_dim,
        PROXY_DIM_PAD=_env.head_dim_pad(proxy_dim), Q_BLOCK=layout.q_block,
        KV_BLOCK=layout.kv_block,
        GROUP_PAD=max(16, triton.next_power_of_2(heads_q // heads_proxy)),  # tl.dot's rows
        HAS_DOCUMENTS=has_documents, HAS_Q_BLOCKS=q_blocks is not None,
        DOT_PRECISION=_env.dot_precision(q.dtype),
    )  # fmt: skip


def _divisor(reduction: str, terms: int) -> int:
    """What the sum of the kl terms is divided by: their count for the mean (at least 1: a
    batch of 0 has a loss of 0), 1 for the sum."""
    return max(terms, 1) if reduction == "mean" else 1


GRAD_TILE_BYTES = 1 << 30  # the most memory the tiles of d kl_loss / d z take at once


class _Chunk(NamedTuple):
    """One launch of the KL's kernels: query blocks [block_start, block_end) of layout row
    layout_row, whose entries are the chunk_entries from entry_start on, for `batches` batch
    elements from batch_base and the row's proxy heads from head_base."""

    layout_row: int
    block_start: int
    block_end: int
    entry_start: int
    chunk_entries: int
    batch_base: int
    batches: int
    head_base: int

    def arguments(self) -> dict:
        """The kernels' chunk arguments."""
        return dict(layout_row=self.layout_row, block_start=self.block_start,
                    entry_start=self.entry_start, chunk_entries=self.chunk_entries,
                    batch_base=self.batch_base, head_base=self.head_base)  # fmt: skip


def _chunks(layout: BlockLayout, row_offsets: torch.Tensor, batch: int, heads_proxy: int,
            tile_bytes: int | None):  # fmt: skip
    """The KL's launches (_Chunk), chunks of a layout row's query blocks read by
    batches x H_p / layout_heads copies (the (batch, proxy head) pairs sharing the row);
    none for a batch of 0. A chunk is a whole row, its tiles indexed by the layout's entries,
    without tile_bytes (no gradient) or where the whole layout's tiles (tile_bytes each, for
    every copy) take at most GRAD_TILE_BYTES; else its tiles take at most GRAD_TILE_BYTES,
    or one query block's where one takes more (row_offsets read once on the host)."""
    if batch == 0:
        return
    num_q_blocks, per_layout = layout.num_q_blocks, heads_proxy // layout.layout_heads
    batches = batch if layout.layout_batch == 1 else 1
    most = None if tile_bytes is None else GRAD_TILE_BYTES // (batches * per_layout * tile_bytes)
    offsets = None
    if most is not None and layout.nnz > most:
        offsets = row_offsets.view(-1, num_q_blocks + 1).cpu().numpy()
    for row in range(layout.num_layouts):
        first_batch = 0 if layout.layout_batch == 1 else row // layout.layout_heads
        rows = (first_batch, batches, (row % layout.layout_heads) * per_layout)
        if offsets is None:
            yield _Chunk(row, 0, num_q_blocks, 0, layout.nnz, *rows)
            continue
        row_offsets_host, block = offsets[row], 0
        while block < num_q_blocks:
            end = int(np.searchsorted(row_offsets_host, row_offsets_host[block] + max(most, 1),
                                      "right"))  # fmt: skip
            end = min(max(end - 1, block + 1), num_q_blocks)
            first_entry = int(row_offsets_host[block])
            yield _Chunk(row, block, end, first_entry, int(row_offsets_host[end]) - first_entry,
                         *rows)  # fmt: skip
            block = end


@torch.library.custom_op("flash_msa::proxy_kl_forward", mutates_args=())
@_env.on_tensor_device
def _kl_forward(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    documents: torch.Tensor | None,
    q_blocks: torch.Tensor | None,
    query_masks: torch.Tensor | None,
    t_entries: torch.Tensor,
    row_offsets: torch.Tensor,
    col_indices: torch.Tensor,
    t_row_offsets: torch.Tensor,
    t_col_indices: torch.Tensor,
    sizes: list[int],
    proxy_softmax_scale: float,
    softmax_scale: float,
    reduction: str,
    with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kl_loss fp32 [], lse_proxy fp32 [B, H_p, S_q], and with with_grad d kl_loss /
    d q_proxy and d kl_loss / d k_proxy, like q_proxy and k_proxy, else empty): both gradients
    come from the forward's own walk, which writes each entry's d kl_loss / d z tile for the
    dk_proxy kernel, a chunk of query blocks at a time (_chunks)."""
    layout = BlockLayout.from_op_arguments(
        row_offsets, col_indices, t_row_offsets, t_col_indices, sizes
    )
    arguments = _kernel_arguments(q_proxy, k_proxy, q, k, lse, documents, q_blocks, layout,
                                  (proxy_softmax_scale, softmax_scale))  # fmt: skip
    batch, seq_len, heads_proxy, _ = q_proxy.shape
    lse_proxy = lse.new_empty(batch, heads_proxy, seq_len)
    kl_rows = torch.empty_like(lse_proxy)
    grad_q_proxy = torch.empty_like(q_proxy) if with_grad else q_proxy.new_empty(0)
    grad_k_proxy = torch.zeros_like(k_proxy, dtype=torch.float32) if with_grad else None
    divisor = _divisor(reduction, kl_rows.numel())
    grad_scale = lse.new_full((1,), 1 / divisor)  # d kl_loss / d kl(i, p)
    tile_size = layout.q_block * layout.kv_block
    chunks = list(_chunks(layout, row_offsets, batch, heads_proxy,
                          tile_size * q_proxy.element_size() if with_grad else None))
    per_layout = heads_proxy // layout.layout_heads
    # The largest chunk's tiles (one unread tile without the gradient: TMA needs a view).
    tiles = [chunk.batches * per_layout * chunk.chunk_entries for chunk in chunks]
    grad_tiles = q_proxy.new_empty(max([1, *tiles]) * tile_size if with_grad else tile_size)
    gluon_kernels = kl_gluon.supports(q, q_proxy, layout.q_block, layout.kv_block,
                                      documents is not None, q_blocks is not None)  # fmt: skip
    for chunk in chunks:
        grid = (chunk.block_end - chunk.block_start, chunk.batches * per_layout)
        if gluon_kernels:
            kl_gluon.kl_rows(
                q_proxy, k_proxy, q, k, lse, row_offsets, col_indices, query_masks, layout,
                grad_scale, (lse_proxy, kl_rows, grad_q_proxy if with_grad else None, grad_tiles),
                proxy_softmax_scale, softmax_scale, grid, chunk.arguments(),
            )  # fmt: skip
        else:
            _launch(_kl_rows_kernel, grid, num_stages("rows", layout.q_block), dict(
                row_offsets=row_offsets, col_indices=col_indices, grad_scale=grad_scale,
                lse_proxy=lse_proxy, kl_rows=kl_rows,
                grad_q_proxy=grad_q_proxy if with_grad else q_proxy, grad_tiles=grad_tiles,
                num_q_blocks=layout.num_q_blocks,
                query_masks=lse if query_masks is None else query_masks,
                HAS_QUERY_MASKS=query_masks is not None,
                GRAD=with_grad, num_warps=num_warps("rows", layout.q_block),
                **chunk.arguments(), **arguments,
            ))  # fmt: skip
        if with_grad:
            _chunk_dk_proxy(grad_tiles, q_proxy, grad_k_proxy, t_row_offsets, t_col_indices,
                            t_entries, layout, chunk, per_layout)  # fmt: skip
    if with_grad:
        grad_k_proxy = (grad_k_proxy * proxy_softmax_scale).to(k_proxy.dtype)
    else:
        grad_k_proxy = k_proxy.new_empty(0)
    return kl_rows.sum() / divisor, lse_proxy, grad_q_proxy, grad_k_proxy


def _chunk_dk_proxy(grad_tiles, q_proxy, grad_k_proxy, t_row_offsets, t_col_indices,
                    t_entries, layout: BlockLayout, chunk: _Chunk,
                    per_layout: int) -> None:  # fmt: skip
    """Add a chunk's tiles times their q_proxy rows to grad_k_proxy (fp32, unscaled): a
    launch per proxy head of the chunk's layout row, one after another (heads may share a
    key head)."""
    heads_proxy, heads_keys = q_proxy.shape[2], grad_k_proxy.shape[2]
    for copy_head in range(per_layout):
        head = chunk.head_base + copy_head
        _launch(_kl_dk_proxy_kernel, (layout.num_kv_blocks, chunk.batches),
                num_stages("dk_proxy", layout.q_block), dict(
            grad_tiles=grad_tiles, q_proxy=q_proxy, grad_k_proxy=grad_k_proxy,
            t_row_offsets=t_row_offsets, t_col_indices=t_col_indices, t_entries=t_entries,
            **strides("qp", q_proxy), **strides("gk", grad_k_proxy),
            query_len=q_proxy.shape[1], seq_len=grad_k_proxy.shape[1],
            num_kv_blocks=layout.num_kv_blocks, layout_row=chunk.layout_row,
            entry_start=chunk.entry_start, chunk_entries=chunk.chunk_entries,
            batch_base=chunk.batch_base, head=head, copy_head=copy_head,
            heads_per_layout=per_layout, key_head=head // (heads_proxy // heads_keys),
            PROXY_DIM=q_proxy.shape[3], PROXY_DIM_PAD=_env.head_dim_pad(q_proxy.shape[3]),
            Q_BLOCK=layout.q_block, KV_BLOCK=layout.kv_block,
            ENTRIES=dk_proxy_entries(layout.q_block),
            DOT_PRECISION=_env.dot_precision(q_proxy.dtype),
            num_warps=num_warps("dk_proxy", layout.q_block),
        ))  # fmt: skip


@_kl_forward.register_fake
def _(q_proxy, k_proxy, q, k, lse, *rest):
    batch, seq_len, heads_proxy, _ = q_proxy.shape
    with_grad = rest[-1]
    return (
        lse.new_empty(()), lse.new_empty(batch, heads_proxy, seq_len),
        torch.empty_like(q_proxy) if with_grad else q_proxy.new_empty(0),
        torch.empty_like(k_proxy) if with_grad else k_proxy.new_empty(0),
    )  # fmt: skip


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[2], output[3])
    ctx.mark_non_differentiable(output[1], output[2], output[3])


def _autograd_backward(ctx, grad_loss, _grad_lse_proxy, _grad_grad_q_proxy, _grad_grad_k_proxy):
    needs_q, needs_k = ctx.needs_input_grad[:2]
    grad_q_unit, grad_k_unit = ctx.saved_tensors
    return (grad_q_unit * grad_loss if needs_q else None,
            grad_k_unit * grad_loss if needs_k else None) + (None,) * 16  # fmt: skip


_kl_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def _check_kl_inputs(q_proxy, k_proxy, q, k, lse, layout, softmax_scale, proxy_softmax_scale,
                     document_ids, q_blocks) -> None:  # fmt: skip
    """proxy_kl_loss's tensors, layout and scales (TypeError / ValueError naming them)."""
    check_tensors(dict(q_proxy=q_proxy, q=q), dict(k_proxy=k_proxy, k=k),
                  same_length=q_blocks is None)  # fmt: skip
    batch, seq_len_q, heads_q, _ = q.shape
    seq_len, heads_proxy = k.shape[1], q_proxy.shape[2]
    for name, scale in (("softmax_scale", softmax_scale),
                        ("proxy_softmax_scale", proxy_softmax_scale)):  # fmt: skip
        if scale is None:
            raise ValueError(f"{name} must be a positive finite float (the attention's), got None")
        check_softmax_scale(name, scale)
    expected = (batch, heads_q, seq_len_q)
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32:
        raise TypeError(
            f"lse must be the main attention's fp32 lse [B, H_q, S_q] (return_lse=True), got "
            f"{lse.dtype if isinstance(lse, torch.Tensor) else type(lse).__name__}"
        )
    if tuple(lse.shape) != expected or lse.device != q.device:
        raise ValueError(
            f"lse must be [B, H_q, S_q] = {list(expected)} on {q.device}, got "
            f"{list(lse.shape)} on {lse.device}: the main attention's lse over these queries"
        )
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    check_layout_device(layout, q.device)
    # The kernels' products over a kv block take at least 16 keys (tl.dot's reduction).
    check_block_size("layout.kv_block", layout.kv_block)
    if (layout.seq_len_q, layout.seq_len_kv) != (seq_len_q, seq_len):
        raise ValueError(
            f"layout must have seq_len_q = {seq_len_q} (q_proxy's rows) and seq_len_kv = "
            f"{seq_len} (k_proxy's), got {layout.seq_len_q} and {layout.seq_len_kv}: pass the "
            "layout the main attention ran over (with q_blocks, the rank's local layout)"
        )
    if heads_proxy % layout.layout_heads or layout.layout_batch not in (1, batch):
        raise ValueError(
            f"layout must have layout_heads dividing H_p = {heads_proxy} and layout_batch 1 or "
            f"B = {batch}, got {layout.layout_heads} and {layout.layout_batch}"
        )
    layout.check_unchanged()
    if document_ids is not None:
        check_document_ids(document_ids, batch, seq_len, q.device)


def proxy_kl_loss(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    layout: BlockLayout,
    *,
    softmax_scale: float,
    proxy_softmax_scale: float,
    document_ids: torch.Tensor | None = None,
    q_blocks: torch.Tensor | None = None,
    query_masks: torch.Tensor | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """The KL loss of the module docstring, differentiable in q_proxy and k_proxy only.

    Every input is checked (TypeError / ValueError); this is the tensors' one boundary before
    the kernels (they are made contiguous here).

    Args:
        q_proxy: [B, S_q, H_p, D_p]; k_proxy: [B, S, H_pk, D_p]; S_q = S without q_blocks.
        q: [B, S_q, H_q, D]; k: [B, S, H_kv, D]; lse: fp32 [B, H_q, S_q] of the main
            attention over `layout` (causal; layout_heads dividing H_p, layout_batch 1 or B;
            seq_len_q S_q, seq_len_kv S).
        softmax_scale, proxy_softmax_scale: the main and the proxy attention's scales.
        document_ids: int32 [B, S] or None.
        q_blocks: int [layout.num_q_blocks] on q_proxy's device, or None (the queries are the
            whole sequence): the global query block of each block of q_block rows of q_proxy,
            q and lse (context parallelism: k_proxy and k hold the whole sequence, layout's
            rows are these blocks, its columns global kv blocks); only a last block may be
            short, and then it is the ragged global last block. Its checks read it once from
            the device (not under torch.compile).
        query_masks: the per-token selections the main attention ran with (its query_masks:
            int64 [layout.nnz], bit r of an entry set when row r of its query block reads its
            kv block; q_block <= 64), or None: each token's KL is then over exactly the keys
            its main attention used; a token no bit selects adds 0.
        reduction: "mean" over the N = B * S_q * H_p (batch, token, proxy head) terms, or
            their "sum". Over ranks whose q_blocks partition the query blocks, the sums, the
            N and the sums' gradients add up to the whole sequence's: its mean is the
            all-reduced sum over the all-reduced N.

    Returns:
        kl_loss, an fp32 scalar.
    """
    _check_kl_inputs(q_proxy, k_proxy, q, k, lse, layout, softmax_scale, proxy_softmax_scale,
                     document_ids, q_blocks)  # fmt: skip
    return checked_kl_loss(
        q_proxy, k_proxy, q, k, lse, layout, softmax_scale=softmax_scale,
        proxy_softmax_scale=proxy_softmax_scale, document_ids=document_ids, q_blocks=q_blocks,
        query_masks=query_masks, reduction=reduction,
    )  # fmt: skip


def checked_kl_loss(
    q_proxy, k_proxy, q, k, lse, layout, *, softmax_scale, proxy_softmax_scale, document_ids,
    q_blocks=None, query_masks=None, reduction="mean",
) -> torch.Tensor:  # fmt: skip
    """proxy_kl_loss on tensors, layout, scales and documents already checked (msa_func and
    msa_func_cp check them, and their document check reads the device: once a call); it
    checks q_blocks, query_masks and reduction."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if q_blocks is not None:
        lengths = (q_proxy.shape[1], k_proxy.shape[1])
        check_query_blocks(q_blocks, seq_len_q=lengths[0], seq_len=lengths[1],
                           q_block=layout.q_block, device=q_proxy.device)  # fmt: skip
        q_blocks = q_blocks.to(torch.int32).contiguous()
    if query_masks is not None:
        check_query_masks(query_masks, layout, q_proxy.device)
    q_proxy, k_proxy = q_proxy.contiguous(), k_proxy.contiguous()
    q, k, lse = (tensor.detach().contiguous() for tensor in (q, k, lse))
    if document_ids is not None:
        document_ids = document_ids.to(torch.int32).contiguous()
    loss, _, _, _ = _kl_forward(
        q_proxy, k_proxy, q, k, lse, document_ids, q_blocks, query_masks,
        layout.transpose_entries(), **layout.op_arguments(),
        proxy_softmax_scale=proxy_softmax_scale, softmax_scale=softmax_scale,
        reduction=reduction,
        with_grad=torch.is_grad_enabled() and (q_proxy.requires_grad or k_proxy.requires_grad),
    )  # fmt: skip
    return loss
