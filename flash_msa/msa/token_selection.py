"""MSA per-token selection: each query token keeps its own kv block plus the top_k - 1 other
visible blocks whose largest proxy logit is highest (MiniMax MSA, poolside's Flash-MSA).

score(i, c) = max over keys j of kv block c with j <= i (and j in i's document) of
q_proxy[i] . k_proxy[j] (times proxy_softmax_scale, which is positive and so leaves the order
alone). Token i's own block c_i = i // kv_block is always kept; blocks c > c_i hold no key
i sees, so the others are blocks c < c_i, whose every key is causal for i: only documents
mask inside them. Ties go to the lower block index; blocks without a visible key (another
document) are never kept.

One program owns BLOCK_M rows, ROWS tokens x PACK proxy heads that share a proxy key head
(each key tile is loaded once for them), and walks kv blocks from its first token's document
start (0 without documents) up to its tokens' own blocks: one [BLOCK_M, kv_block] dot per
block, reduced by max. A running top-(top_k - 1) per row lives in registers as a
[BLOCK_M, SLOTS] tile of (score, block); a block enters a row when its score beats the row's
worst slot, replacing that slot (the lowest score, of those the highest block index, as
blocks arrive in ascending order and ties go to the earlier one): two reductions over SLOTS
and a few selects per row and block, without a branch (a test whether any row takes the
block would synchronise the warps once per block). Nothing of size
[S, num_kv_blocks] is ever formed: memory is the [B, H_p, S, top_k] output.

With score_dtype float8_e4m3fn the products run in FP8 (msa/fp8.py): a row's own factor
leaves that row's order alone and is dropped; a kv block's is multiplied into its maximum.

The running top-k is running_top_k.py's. On sm_90 select_tokens runs the Gluon kernel of
token_selection_gluon.py instead, with the same top-k (so the same choices), where that
kernel takes the call (token_selection_gluon.supports).

token_selection_layout turns the selection into the BlockLayout of the main attention's
query tiles plus, per active block, the bit mask of the tile's queries that chose it.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from flash_msa import _env
from flash_msa.layout import LAYOUT_BLOCK_SIZES, BlockLayout, check_block_size
from flash_msa.msa import token_selection_gluon
from flash_msa.msa.fp8 import FP8, check_score_dtype, quantize_proxies
from flash_msa.msa.running_top_k import empty_slots, enter_block, ranked_blocks
from flash_msa.ops.interface import check_softmax_scale
from flash_msa.ops.triton.common import element_offsets, load_rows, packed_rows, strides
from flash_msa.patterns.topk import check_query_blocks
from flash_msa.sequences import check_document_ids, document_first_tokens

MAX_PACK = 4  # proxy heads per program: a 64-row tile still spans 16 tokens
MAX_MASK_QUERIES = 64  # query_masks are int64: one bit per query of a tile


@triton.jit
def _block_max(
    q_tile, k_base, stride_k_s, k_scales, kv_first, documents, row_documents,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, KV_BLOCK: tl.constexpr,
    HAS_DOCUMENTS: tl.constexpr, SCALED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Max over the keys [kv_first, kv_first + KV_BLOCK) of each row's logit: [BLOCK_M] fp32.
    The block lies inside the sequence and before every row that ranks it, so every key is
    causal; with HAS_DOCUMENTS keys of another document count as -inf (documents: int32 [S]
    of this batch row, row_documents [BLOCK_M] those of the rows). SCALED: the keys are
    quantized per kv block, k_scales (fp32 [num_kv_blocks] of this key head) their factors.
    One dot per block and no inner loop: the compiler pipelines the innermost loop, so the
    caller's walk over blocks loads key tiles blocks ahead (in block_scores' _kv_block_max, a
    loop over the sub-blocks of one kv block, loads overlap only within that block)."""
    keys = kv_first + tl.arange(0, KV_BLOCK)  # [KV_BLOCK]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [D_PAD]
    k_tile = tl.load(
        k_base + keys.to(tl.int64)[:, None] * stride_k_s + dims[None, :],
        mask=dims[None, :] < HEAD_DIM, other=0.0,
    )  # fmt: skip  # [KV_BLOCK, D_PAD]
    logits = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION)  # [M, KV_BLOCK]
    if HAS_DOCUMENTS:
        key_documents = tl.load(documents + keys)  # [KV_BLOCK]
        same = key_documents[None, :] == row_documents[:, None]  # [M, KV_BLOCK]
        logits = tl.where(same, logits, float("-inf"))
    block_max = tl.max(logits, axis=1)
    if SCALED:  # a positive factor: the max of the scaled logits is the scaled max
        block_max *= tl.load(k_scales + kv_first // KV_BLOCK)
    return block_max


@triton.jit
def _token_selection_kernel(
    q_proxy,
    k_proxy,
    selected,
    stride_q_b,
    stride_q_s,
    stride_q_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    k_scales,
    stride_ks_b,
    stride_ks_h,
    stride_o_b,
    stride_o_h,
    stride_o_s,
    documents,
    document_starts,
    stride_doc_b,
    q_blocks,
    seq_len,
    proxy_group,
    Q_BLOCK: tl.constexpr,
    HAS_Q_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    PACK: tl.constexpr,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_DOCUMENTS: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    ROWS: tl.constexpr = BLOCK_M // PACK
    tile = tl.cdiv(seq_len, ROWS) - 1 - tl.program_id(0)  # the longest walks first
    first_head = tl.program_id(1) * PACK
    batch = tl.program_id(2).to(tl.int64)
    key_head = first_head // proxy_group  # PACK divides the group: one key head for all
    first = tile * ROWS
    rows, heads = packed_rows(first, first_head, ROWS, PACK)  # [BLOCK_M] x2: q_proxy's rows
    row_valid = rows < seq_len  # [BLOCK_M]
    positions = rows  # [BLOCK_M]: the rows' positions in the key sequence
    if HAS_Q_BLOCKS:  # row r is position q_blocks[r // Q_BLOCK] * Q_BLOCK + r % Q_BLOCK
        blocks_of_rows = tl.load(q_blocks + rows // Q_BLOCK, mask=row_valid, other=0)
        positions = blocks_of_rows * Q_BLOCK + rows % Q_BLOCK
    q_tile = load_rows(
        q_proxy + batch * stride_q_b, element_offsets(rows, heads, stride_q_s, stride_q_h),
        row_valid, HEAD_DIM, HEAD_DIM_PAD,
    )  # fmt: skip  # [BLOCK_M, D_PAD]
    k_base = k_proxy + batch * stride_k_b + key_head * stride_k_h
    k_scales += batch * stride_ks_b + key_head * stride_ks_h
    own_blocks = positions // KV_BLOCK  # [BLOCK_M]
    last_block = tl.max(tl.where(row_valid, own_blocks, 0))  # the last row's own

    documents += batch * stride_doc_b
    row_documents = positions  # unused without documents
    start_block = 0
    if HAS_DOCUMENTS:
        row_documents = tl.load(documents + positions, mask=row_valid, other=-2)  # [BLOCK_M]
        # Blocks before the first row's document hold no key any row sees.
        row_starts = tl.load(document_starts + batch * stride_doc_b + positions,
                             mask=row_valid, other=2**30)  # fmt: skip  # [BLOCK_M]
        start_block = tl.min(row_starts) // KV_BLOCK

    slots = tl.arange(0, SLOTS)  # [SLOTS]
    slot_scores, slot_blocks, worst = empty_slots(
        slots, tl.zeros((BLOCK_M, SLOTS), tl.float32), TOP_K
    )  # [BLOCK_M, SLOTS] x2, [BLOCK_M]
    for block in range(start_block, last_block):
        block_max = _block_max(
            q_tile, k_base, stride_k_s, k_scales, block * KV_BLOCK, documents, row_documents,
            HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK, HAS_DOCUMENTS, SCALED, DOT_PRECISION,
        )  # fmt: skip  # [BLOCK_M]
        # Rows whose own block this is (or is before) do not rank it: tiles of more tokens
        # than a kv block span several own blocks.
        score = tl.where((block < own_blocks) & row_valid, block_max, float("-inf"))
        slot_scores, slot_blocks, worst = enter_block(
            slot_scores, slot_blocks, worst, score, block, slots, TOP_K
        )

    blocks, columns = ranked_blocks(slot_blocks, own_blocks, slots, TOP_K)
    out_rows = (
        selected + batch * stride_o_b + heads.to(tl.int64) * stride_o_h
        + rows.to(tl.int64) * stride_o_s
    )  # fmt: skip  # [BLOCK_M]
    tl.store(out_rows[:, None] + columns, tl.where(blocks < 0, -1, blocks),
             mask=row_valid[:, None] & (columns < TOP_K))  # fmt: skip


def _configs() -> list[triton.Config]:
    """BLOCK_M (rows of a program), warps and stages; one under the interpreter, which cannot
    time them. Compiled for sm_90 (bf16, D_p 128, kv_block 128, top_k 16) none spills, but
    128 rows on 4 warps reach 255 registers (and spill with documents): 8 warps only."""
    if _env.interpreting():
        return [triton.Config({"BLOCK_M": 128}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": rows}, num_warps=warps, num_stages=stages)
        for rows, warps in ((64, 4), (64, 8), (128, 8))
        for stages in (2, 3)
    ]


@functools.cache
def _tuned_kernel():
    return triton.autotune(
        configs=_configs(),
        key=["HEAD_DIM_PAD", "KV_BLOCK", "PACK", "SLOTS", "HAS_DOCUMENTS", "HAS_Q_BLOCKS",
             "SCALED"],
    )(_token_selection_kernel)


def _pack(group: int) -> int:
    """Proxy heads per program: a power of two dividing the group, at most MAX_PACK."""
    return min(group & -group, MAX_PACK)


def _check(q_proxy, k_proxy, top_k, kv_block, proxy_softmax_scale, local: bool) -> None:
    """Validate select_tokens' tensors and options (TypeError / ValueError naming them)."""
    for name, tensor in (("q_proxy", q_proxy), ("k_proxy", k_proxy)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, S, H, D_p], got shape {list(tensor.shape)}")
    refusal = _env.triton_refusal(q_proxy.device, q_proxy.dtype)
    if refusal is not None:
        reason, error = refusal
        raise error(f"select_tokens: {reason}; select_tokens_reference handles float64")
    if q_proxy.dtype != k_proxy.dtype or q_proxy.device != k_proxy.device:
        raise ValueError(
            f"q_proxy ({q_proxy.dtype}, {q_proxy.device}) and k_proxy ({k_proxy.dtype}, "
            f"{k_proxy.device}) must share dtype and device"
        )
    q_shape, k_shape = q_proxy.shape, k_proxy.shape
    axes = (0, 3) if local else (0, 1, 3)  # with q_blocks, k_proxy holds the whole sequence
    if any(k_shape[axis] != q_shape[axis] for axis in axes):
        raise ValueError(
            f"k_proxy {list(k_shape)} must match q_proxy {list(q_shape)} in B"
            f"{'' if local else ', S'} and D_p"
        )
    if min(q_shape[1:]) < 1 or k_shape[2] < 1:
        raise ValueError(
            f"S, heads and D_p must be at least 1, got q_proxy {list(q_shape)}, "
            f"k_proxy {list(k_shape)}"
        )
    if q_shape[2] % k_shape[2] != 0:
        raise ValueError(
            f"proxy heads H_p = {q_shape[2]} must be a multiple of proxy key heads "
            f"H_pk = {k_shape[2]}"
        )
    if type(top_k) is not int or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    check_block_size("kv_block", kv_block)
    check_softmax_scale("proxy_softmax_scale", proxy_softmax_scale)


@torch.library.custom_op("flash_msa::select_tokens", mutates_args={"selected"})
@_env.on_tensor_device
def _select_tokens(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    document_ids: torch.Tensor | None,
    starts: torch.Tensor | None,
    q_blocks: torch.Tensor | None,
    k_scales: torch.Tensor | None,
    selected: torch.Tensor,
    q_block: int,
    kv_block: int,
    kept: int,
) -> None:
    batch, seq_len, heads, dim = q_proxy.shape
    group = heads // k_proxy.shape[2]
    pack = _pack(group)
    if token_selection_gluon.supports(q_proxy, kv_block, kept, document_ids is not None,
                                      q_blocks is not None):  # fmt: skip
        token_selection_gluon.select(q_proxy, k_proxy, k_scales, selected, kept=kept, pack=pack)
        return

    def grid(meta):
        return (triton.cdiv(seq_len, meta["BLOCK_M"] // pack), heads // pack, batch)

    # Without documents, selected stands in for their pointers (never read).
    _tuned_kernel()[grid](
        q_proxy=q_proxy, k_proxy=k_proxy, selected=selected, **strides("q", q_proxy),
        **strides("k", k_proxy), **strides("o", selected, "bhs"),
        k_scales=selected if k_scales is None else k_scales,
        stride_ks_b=0 if k_scales is None else k_scales.stride(0),
        stride_ks_h=0 if k_scales is None else k_scales.stride(1),
        documents=selected if document_ids is None else document_ids,
        document_starts=selected if starts is None else starts,
        stride_doc_b=0 if document_ids is None else document_ids.stride(0),
        q_blocks=selected if q_blocks is None else q_blocks, seq_len=seq_len,
        proxy_group=group, Q_BLOCK=q_block, HAS_Q_BLOCKS=q_blocks is not None, HEAD_DIM=dim,
        HEAD_DIM_PAD=max(_env.head_dim_pad(dim), 32 if k_scales is not None else 16),  # FP8 dots
        KV_BLOCK=kv_block, PACK=pack, TOP_K=kept,
        SLOTS=triton.next_power_of_2(kept),
        DOT_PRECISION=_env.dot_precision(q_proxy.dtype), HAS_DOCUMENTS=document_ids is not None,
        SCALED=k_scales is not None,
    )  # fmt: skip


@_select_tokens.register_fake
def _(q_proxy, k_proxy, document_ids, starts, q_blocks, k_scales, selected, q_block, kv_block,
      kept):
    return None


def select_tokens(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    *,
    top_k: int,
    kv_block: int,
    proxy_softmax_scale: float | None = None,
    document_ids: torch.Tensor | None = None,
    q_blocks: torch.Tensor | None = None,
    q_block: int | None = None,
    score_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-token kv-block selection of the module docstring.

    Args:
        q_proxy: [B, S, H_p, D_p]; k_proxy: [B, S, H_pk, D_p], H_p a multiple of H_pk; proxy
            head p reads key head p // (H_p / H_pk). float16, bfloat16 or float32.
        top_k: blocks kept per (token, proxy head), its own block included.
        kv_block: key block size (64 or 128 for speed; 16 and 32 allowed).
        proxy_softmax_scale: a positive scale of the logits (None: 1 / sqrt(D_p)); it does not
            change the order, so the selection does not depend on it.
        document_ids: int [B, S], non-decreasing along S: keys of another document are not
            visible.
        q_blocks, q_block: q_proxy holds some blocks of q_block queries of the sequence
            k_proxy holds (context parallelism): local block i is global query block
            q_blocks[i] (int [ceil(S_q / q_block)], whole blocks but a ragged global last
            one; see patterns.topk.check_query_blocks); document_ids are then the whole
            sequence's [B, S].
        score_dtype: None (the proxies' dtype) or torch.float8_e4m3fn: the products in FP8
            with fp32 accumulation (quantize_proxies' scaling), on GPUs of compute
            capability 8.9 or more or under the interpreter. It approximates the proxies'
            own logits, so near ties may go the other way.

    Returns:
        int32 [B, H_p, S, top_k]: each token's kept block indices, ascending, padded at the
        end with -1 where fewer than top_k blocks are visible.

    Examples:
        >>> selected = select_tokens(q_proxy, k_proxy, top_k=16, kv_block=128)
        >>> layout, query_masks = token_selection_layout(
        ...     selected, seq_len=S, q_block=64, kv_block=128)
    """
    if (q_blocks is None) != (q_block is None):
        raise ValueError("pass q_blocks and q_block together (or neither)")
    _check(q_proxy, k_proxy, top_k, kv_block, proxy_softmax_scale, q_blocks is not None)
    check_score_dtype(score_dtype, q_proxy.device)
    batch, seq_len, heads = q_proxy.shape[:3]
    seq_len_kv = k_proxy.shape[1]
    if q_blocks is not None:
        check_block_size("q_block", q_block, LAYOUT_BLOCK_SIZES)  # 1: q_blocks name tokens
        q_blocks = check_query_blocks(
            q_blocks, seq_len_q=seq_len, seq_len=seq_len_kv, q_block=q_block,
            device=q_proxy.device,
        ).to(torch.int32)  # fmt: skip
    q_proxy = q_proxy if q_proxy.stride(-1) == 1 else q_proxy.contiguous()
    k_proxy = k_proxy if k_proxy.stride(-1) == 1 else k_proxy.contiguous()
    starts = None
    if document_ids is not None:
        check_document_ids(document_ids, batch, seq_len_kv, q_proxy.device)
        document_ids = document_ids.to(torch.int32).contiguous()
        starts = document_first_tokens(document_ids).int()  # [B, S]
    k_scales = None
    if score_dtype == FP8:
        q_proxy, _, k_proxy, k_scales = quantize_proxies(q_proxy, k_proxy, kv_block)
    selected = torch.empty(batch, heads, seq_len, top_k, dtype=torch.int32, device=q_proxy.device)
    # No token sees more than every block: columns past that are padding.
    kept = min(top_k, math.ceil(seq_len_kv / kv_block))
    selected[..., kept:] = -1
    if batch:
        _select_tokens(q_proxy, k_proxy, document_ids, starts, q_blocks, k_scales, selected,
                       q_block=q_block or 1, kv_block=kv_block, kept=kept)  # fmt: skip
    return selected


def _check_selection(selected, seq_len, seq_len_kv, q_block, kv_block) -> None:
    """Validate token_selection_layout's arguments."""
    if not isinstance(selected, torch.Tensor):
        raise TypeError(f"selected must be a torch.Tensor, got {type(selected).__name__}")
    if selected.dtype != torch.int32:
        raise TypeError(f"selected must be int32 (select_tokens' output), got {selected.dtype}")
    for name, value in (("seq_len", seq_len), ("seq_len_kv", seq_len_kv)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if selected.dim() != 4 or selected.shape[2] != seq_len or 0 in selected.shape:
        raise ValueError(
            f"selected must be [B, H_p, seq_len, top_k] = [B, H_p, {seq_len}, top_k] with no "
            f"empty size, got {list(selected.shape)}"
        )
    check_block_size("q_block", q_block, LAYOUT_BLOCK_SIZES)
    check_block_size("kv_block", kv_block)
    if q_block > MAX_MASK_QUERIES:
        raise ValueError(
            f"q_block must be at most {MAX_MASK_QUERIES} (query_masks hold one bit per query "
            f"of a tile in an int64), got {q_block}"
        )
    num_kv_blocks = math.ceil(seq_len_kv / kv_block)
    kept = selected >= 0
    ascending = (selected[..., 1:] > selected[..., :-1]) | ~kept[..., 1:]
    padding_last = kept[..., :-1] | ~kept[..., 1:]
    disordered = ~(ascending & padding_last)  # [B, H_p, S, top_k - 1]
    low, high = torch.aminmax(selected)
    low, high, any_disordered = torch.stack([low, high, disordered.any()]).tolist()
    if low < -1 or high >= num_kv_blocks:
        raise ValueError(
            f"selected must hold kv blocks in [0, {num_kv_blocks}) (seq_len_kv={seq_len_kv}, "
            f"kv_block={kv_block}) or -1 for padding, got values from {low} to {high}"
        )
    if any_disordered:
        batch, head, token = disordered.any(-1).nonzero()[0].tolist()
        raise ValueError(
            f"each row of selected must be ascending without repeats and padded with -1 at "
            f"the end only (select_tokens' format); batch {batch}, head {head}, token {token} "
            f"holds {selected[batch, head, token].tolist()}"
        )


def _token_rows_layout(selected: torch.Tensor, seq_len_kv: int, kv_block: int) -> BlockLayout:
    """The layout of q_block 1: row t of layout (b, p) holds token t's kept blocks (already
    ascending, the padding -1 at the end of each row)."""
    batch, heads, seq_len, _ = selected.shape
    if selected.numel() > torch.iinfo(torch.int32).max:  # entries the int32 offsets can count
        raise ValueError(
            f"rows of one token hold up to B * H_p * S * top_k = {selected.numel():,} entries, "
            "more than int32 layout offsets count: split the batch"
        )
    kept = selected >= 0  # [B, H_p, S, top_k]
    ends = kept.sum(-1, dtype=torch.int32).flatten().cumsum(0, dtype=torch.int32)  # [L * S]
    offsets = torch.cat([ends.new_zeros(1), ends])  # [L * S + 1]
    row_offsets = offsets.as_strided((batch * heads, seq_len + 1), (seq_len, 1))
    return BlockLayout(
        row_offsets, selected[kept], seq_len_q=seq_len, seq_len_kv=seq_len_kv, q_block=1,
        kv_block=kv_block, layout_batch=batch, layout_heads=heads, validate=False,
    )  # fmt: skip


MAX_UNION_CANDIDATES = 1024  # q_block x top_k a program of _tile_union_kernel sorts
_NO_BLOCK: tl.constexpr = tl.constexpr(1 << 62)  # a padding candidate's key: after every real one


def _unions_in_kernel(selected: torch.Tensor, q_block: int) -> bool:
    """Whether _tile_union_kernel builds token_selection_layout's unions: on CUDA tensors,
    for tiles of at most MAX_UNION_CANDIDATES choices. The CPU interpreter takes seconds over
    a kernel whose unions one sort gives in milliseconds there, so CPU tensors take the
    sort (the tests run the kernel on the CPU on purpose)."""
    return selected.is_cuda and q_block * selected.shape[-1] <= MAX_UNION_CANDIDATES


@triton.jit
def _or_runs(start_a, bits_a, start_b, bits_b):
    """Segmented OR of a scan: a run starts again where start is set."""
    return start_a | start_b, tl.where(start_b != 0, bits_b, bits_a | bits_b)


@triton.jit
def _tile_union_kernel(selected, counts, row_offsets, col_indices, query_masks, seq_len,
                       num_q_blocks, stride_l, stride_s, Q_BLOCK: tl.constexpr,
                       TOP_K: tl.constexpr, CANDIDATES: tl.constexpr,
                       WRITE: tl.constexpr):  # fmt: skip
    """Grid (query tiles, B * H_p): the union of the blocks the tile's Q_BLOCK tokens chose
    (selected [L, S, TOP_K], rows ascending, -1 padding), as keys block x 64 + token sorted
    in registers: a run of one block's keys is one entry, its tokens' bits OR-ed over the
    run. Without WRITE each tile's entry count goes to counts [L, nq]; with it the entries
    go to col_indices and query_masks from the tile's offset on (row_offsets [L * nq + 1]:
    the counts' exclusive sums), ascending."""
    tile = tl.program_id(0)
    layout = tl.program_id(1)
    candidate = tl.arange(0, CANDIDATES)  # [CANDIDATES]: token x TOP_K + slot
    token = candidate // TOP_K  # the tile's
    position = tile * Q_BLOCK + token
    valid = (candidate < Q_BLOCK * TOP_K) & (position < seq_len)
    blocks = tl.load(selected + layout.to(tl.int64) * stride_l + position.to(tl.int64) * stride_s
                     + candidate % TOP_K, mask=valid, other=-1)  # fmt: skip
    keys = tl.sort(tl.where(blocks >= 0, blocks.to(tl.int64) * 64 + token, _NO_BLOCK))
    real = keys < _NO_BLOCK
    previous = tl.gather(keys, tl.maximum(candidate - 1, 0), 0)
    starts = real & ((candidate == 0) | ((previous >> 6) != (keys >> 6)))  # a block's first
    if WRITE:
        following = tl.gather(keys, tl.minimum(candidate + 1, CANDIDATES - 1), 0)
        ends = real & ((candidate == CANDIDATES - 1) | ((following >> 6) != (keys >> 6)))
        entry = tl.cumsum(starts.to(tl.int32), 0) - 1  # [CANDIDATES]: the run's, in the row
        bits = tl.full([CANDIDATES], 1, tl.int64) << (keys & 63)
        _, words = tl.associative_scan((starts.to(tl.int32), bits), 0, _or_runs)
        first = tl.load(row_offsets + layout * num_q_blocks + tile).to(tl.int64)
        tl.store(col_indices + first + entry, (keys >> 6).to(tl.int32), mask=ends)
        tl.store(query_masks + first + entry, words, mask=ends)
    else:
        tl.store(counts + layout * num_q_blocks + tile, tl.sum(starts.to(tl.int32), 0))


def _tile_union_layout(selected: torch.Tensor, seq_len: int, seq_len_kv: int, q_block: int,
                       kv_block: int) -> tuple[BlockLayout, torch.Tensor]:  # fmt: skip
    """token_selection_layout's result from two launches of _tile_union_kernel (the entry
    counts, then the entries at their row offsets) and one read of the total from the device."""
    batch, heads, _, top_k = selected.shape
    layouts, num_q_blocks = batch * heads, math.ceil(seq_len / q_block)
    rows = selected.reshape(layouts, -1, top_k).contiguous()
    options = dict(selected=rows, seq_len=seq_len, num_q_blocks=num_q_blocks,
                   stride_l=rows.stride(0), stride_s=rows.stride(1), Q_BLOCK=q_block,
                   TOP_K=top_k, CANDIDATES=triton.next_power_of_2(q_block * top_k))  # fmt: skip
    counts = torch.empty(layouts, num_q_blocks, dtype=torch.int32, device=selected.device)
    grid = (num_q_blocks, layouts)
    if counts.numel():
        _tile_union_kernel[grid](counts=counts, row_offsets=counts, col_indices=counts,
                                 query_masks=counts, WRITE=False, **options)  # fmt: skip
    offsets = torch.cat([counts.new_zeros(1), counts.flatten().cumsum(0, dtype=torch.int32)])
    nnz = int(offsets[-1])
    # Row l is offsets[l * nq : (l + 1) * nq + 1]: consecutive rows share their boundary.
    row_offsets = offsets.as_strided((layouts, num_q_blocks + 1), (num_q_blocks, 1))
    col_indices = torch.empty(nnz, dtype=torch.int32, device=selected.device)
    query_masks = torch.empty(nnz, dtype=torch.int64, device=selected.device)
    if nnz:
        _tile_union_kernel[grid](counts=counts, row_offsets=offsets, col_indices=col_indices,
                                 query_masks=query_masks, WRITE=True, **options)  # fmt: skip
    layout = BlockLayout(
        row_offsets, col_indices, seq_len_q=seq_len, seq_len_kv=seq_len_kv, q_block=q_block,
        kv_block=kv_block, layout_batch=batch, layout_heads=heads, validate=False,
    )  # fmt: skip
    return layout, query_masks


def token_selection_layout(
    selected: torch.Tensor,
    *,
    seq_len: int,
    q_block: int,
    kv_block: int,
    seq_len_kv: int | None = None,
    check: bool = True,
) -> tuple[BlockLayout, torch.Tensor | None]:
    """The blocks a query tile's tokens selected, as the main attention's layout.

    Args:
        selected: int32 [B, H_p, S, top_k] from select_tokens: rows ascending without repeats,
            padded with -1 at the end (checked, with one read from the device).
        seq_len: S; q_block: query tile size, at most 64 (1: a row per token, holding
            exactly its choices); kv_block: the selection's block.
        seq_len_kv: the keys' length (None: seq_len), longer when the queries are some
            blocks of the sequence (select_tokens' q_blocks): the rows are then those blocks.
        check: validate selected (one pass and one read from the device); False for
            select_tokens' own output, which has the format by construction.

    Returns:
        layout: row r of layout (b, p) (layout_batch B, layout_heads H_p) holds the union of
            the blocks tokens [r * q_block, (r + 1) * q_block) selected, ascending.
        query_masks: int64 [nnz] aligned with layout.col_indices: bit t set when token
            r * q_block + t of the row selected that block; None for q_block 1 (every row
            is one token and reads all of its blocks).

    Memory is O(B * H_p * S * top_k). On CUDA tensors, where a tile holds at most
    MAX_UNION_CANDIDATES choices, _tile_union_kernel sorts each tile's choices in registers
    (two launches, and the entry count read once from the device); elsewhere one sort of
    every choice ranks them (for q_block 1 they are the layout as they are).
    """
    seq_len_kv = seq_len if seq_len_kv is None else seq_len_kv
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {check!r}")
    if check:
        _check_selection(selected, seq_len, seq_len_kv, q_block, kv_block)
    num_kv_blocks = math.ceil(seq_len_kv / kv_block)
    batch, heads, _, top_k = selected.shape
    if q_block == 1:
        return _token_rows_layout(selected, seq_len_kv, kv_block), None
    if _unions_in_kernel(selected, q_block):
        return _tile_union_layout(selected, seq_len, seq_len_kv, q_block, kv_block)
    num_q_blocks = math.ceil(seq_len / q_block)
    device = selected.device
    layouts = torch.arange(batch * heads, device=device)[:, None]  # [L, 1]
    tokens = torch.arange(seq_len, device=device)  # [S]
    row_keys = (layouts * num_q_blocks + tokens // q_block) * num_kv_blocks  # [L, S]
    # Padding maps past every real key, so it sorts last and is dropped below.
    padding = batch * heads * num_q_blocks * num_kv_blocks
    keys = selected.reshape(batch * heads, seq_len, top_k).long()  # [L, S, top_k]: blocks
    unused = keys < 0
    keys += row_keys[..., None]  # in place: at 1M tokens every copy is hundreds of MiB
    keys.masked_fill_(unused, padding)
    unique_keys, inverse = torch.unique(keys.flatten(), sorted=True, return_inverse=True)
    # A token selects a block at most once, so the bits of one key are distinct: adding
    # them is OR-ing them (bit 63 is the sign bit, and no carry ever reaches it).
    bits = torch.bitwise_left_shift(torch.ones((), dtype=torch.int64, device=device),
                                    tokens % q_block)  # fmt: skip  # [S]
    query_masks = torch.zeros(unique_keys.numel(), dtype=torch.int64, device=device)
    query_masks.index_add_(0, inverse, bits[:, None].expand(keys.shape).flatten())
    real = int(torch.searchsorted(unique_keys, padding))
    layout = BlockLayout.from_keys(
        unique_keys[:real], seq_len_q=seq_len, seq_len_kv=seq_len_kv, q_block=q_block,
        kv_block=kv_block, layout_batch=batch, layout_heads=heads, validate=False,
    )  # fmt: skip
    return layout, query_masks[:real]
