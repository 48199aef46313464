"""msa_func: MiniMax Sparse Attention's training step, selection -> main attention -> KL."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from flash_msa import _env, patterns
from flash_msa.layout import BLOCK_SIZES, LAYOUT_BLOCK_SIZES, BlockLayout, check_block_size
from flash_msa.msa.block_scores import block_scores
from flash_msa.msa.checks import check_tensors
from flash_msa.msa.fp8 import FP8, check_score_dtype
from flash_msa.msa.kl import checked_kl_loss
from flash_msa.msa.token_selection import MAX_MASK_QUERIES, select_tokens, token_selection_layout
from flash_msa.ops.interface import block_sparse_attn_func, check_softmax_scale
from flash_msa.ops.triton import MIN_TILE_ROWS
from flash_msa.ops.triton.configs import largest_power_of_two_dividing
from flash_msa.patterns._build import diagonal_total
from flash_msa.sequences import check_cu_seqlens, cu_seqlens_of, document_ids_of

GRANULARITIES = ("token", "block")
# q_block by default: block's selection unit; token's main attention tile (16 tokens, GQA-
# packed to 64 rows, hold a smaller union of choices than 64; 8 tokens where a proxy head's
# query heads pack 16 or more to a tile: docs/performance.md).
DEFAULT_Q_BLOCKS = {"token": 16, "block": 64}
WIDE_TILE_Q_BLOCK, WIDE_TILE_HEADS = 8, 16  # token tiles of 8 tokens x 16 or more heads
MIN_KL_Q_BLOCK = 16  # tokens per KL query tile under granularity "token" (see kl_q_block)


def check_granularity(granularity) -> None:
    if not isinstance(granularity, str) or granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def default_q_block(q_block: int | None, granularity: str, heads_per_proxy: int | None = None
                    ) -> int:  # fmt: skip
    """q_block, or the granularity's default where it is None (the granularity checked
    first, so that a wrong one is named rather than a block size it implies): 64 for
    "block"; for "token" 8 where the H_q / H_p query heads of a proxy head pack 16 or more
    to a tile (8 tokens x 16 heads fill the kernels' 128-row tiles, and 8 tokens' union of
    choices holds fewer blocks than 16's), else 16."""
    check_granularity(granularity)
    if q_block is not None:
        return q_block
    if (
        granularity == "token" and heads_per_proxy is not None
        and largest_power_of_two_dividing(heads_per_proxy) >= WIDE_TILE_HEADS
    ):  # fmt: skip
        return WIDE_TILE_Q_BLOCK
    return DEFAULT_Q_BLOCKS[granularity]


class MsaSelection(NamedTuple):
    """What the main attention of one msa_func call ran over.

    layout: layout_batch B (1 under warm-up), layout_heads H_p (1 under warm-up); under
        granularity "token" row r holds the union of the blocks its query tile's tokens chose.
    query_masks: int64 [layout.nnz] aligned with layout.col_indices, bit t set when token
        r * q_block + t chose the block (granularity "token"); None when every query of a
        row reads every block of the row (granularity "block", warm-up, q_block 1).
    """

    layout: BlockLayout
    query_masks: torch.Tensor | None


def check_msa_inputs(
    q_proxy,
    k_proxy,
    q,
    k,
    v,
    top_k,
    q_block,
    kv_block,
    proxy_softmax_scale,
    cu_seqlens,
    granularity="token",
    score_dtype=None,
    warmup=False,
) -> int:
    """msa_func's checks of its tensors and options (TypeError / ValueError naming them);
    returns q_block, its default (default_q_block) where it is None."""
    check_granularity(granularity)  # first: it sets q_block's default
    if not isinstance(warmup, bool):
        raise TypeError(f"warmup must be a bool, got {warmup!r}")
    rank = 3 if cu_seqlens is not None else 4
    check_tensors(dict(q_proxy=q_proxy, q=q), dict(k_proxy=k_proxy, k=k, v=v), rank=rank)
    heads_per_proxy = q.shape[-2] // q_proxy.shape[-2]
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    check_score_dtype(score_dtype, q.device)
    q_block = default_q_block(q_block, granularity, heads_per_proxy)
    check_msa_blocks(q_block, kv_block, granularity, heads_per_proxy)
    check_softmax_scale("proxy_softmax_scale", proxy_softmax_scale)
    return q_block


def check_msa_blocks(q_block, kv_block, granularity: str, heads_per_proxy: int | None = None
                     ) -> None:  # fmt: skip
    """MSA's block sizes (ValueError naming the fix), for msa_func and the layers: q_block one
    of the layout's sizes with granularity "token" (rows of 1 to 8 tokens too, at most 64:
    one int64 of query bits per block), a block size with "block"; kv_block a block size, at
    least q_block; with heads_per_proxy (H_q / H_p), the tiles of q_block rows x the query
    heads a proxy head packs at least the kernels' MIN_TILE_ROWS."""
    q_block_sizes = LAYOUT_BLOCK_SIZES if granularity == "token" else BLOCK_SIZES
    check_block_size("q_block", q_block, q_block_sizes)
    check_block_size("kv_block", kv_block)
    packed = None if heads_per_proxy is None else largest_power_of_two_dividing(heads_per_proxy)
    if packed is not None and q_block * packed < MIN_TILE_ROWS:  # packed: heads a tile packs
        raise ValueError(
            f"q_block {q_block} with H_q / H_p = {heads_per_proxy} query heads per proxy "
            f"head fills tiles of {q_block * packed} rows, fewer than the kernels' "
            f"{MIN_TILE_ROWS}: use q_block {MIN_TILE_ROWS} (or more query heads per proxy head)"
        )
    if q_block > kv_block:
        raise ValueError(
            f"q_block ({q_block}) must be <= kv_block ({kv_block}) so that a query block lies in "
            "its diagonal kv block"
        )
    if granularity == "token" and q_block > MAX_MASK_QUERIES:
        raise ValueError(
            f"granularity 'token' takes q_block at most {MAX_MASK_QUERIES} (each tile's "
            f"per-token choices are one int64 of query bits per block), got {q_block}"
        )


@torch.library.custom_op("flash_msa::token_selection", mutates_args=())
def _token_selection(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    document_ids: torch.Tensor | None,
    top_k: int,
    kv_block: int,
    fp8_scores: bool,
) -> torch.Tensor:
    """select_tokens as one op, so that activation checkpointing keeps its output instead of
    scoring every causal pair again (msa_checkpoint_context)."""
    return select_tokens(
        q_proxy, k_proxy, top_k=top_k, kv_block=kv_block, document_ids=document_ids,
        score_dtype=FP8 if fp8_scores else None,
    )  # fmt: skip


@_token_selection.register_fake
def _(q_proxy, k_proxy, document_ids, top_k, kv_block, fp8_scores):
    batch, seq_len, heads = q_proxy.shape[:3]
    return q_proxy.new_empty(batch, heads, seq_len, top_k, dtype=torch.int32)


@torch.library.custom_op("flash_msa::token_layout", mutates_args=())
def _token_layout(
    selected: torch.Tensor, q_block: int, kv_block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """select_tokens' choices as a layout: (row_offsets, col_indices, the transpose's
    row_offsets and col_indices, query_masks, transpose_entries). One op, so that
    torch.compile sees the data-dependent size of the union (nnz) once, as one symbol."""
    layout, query_masks = token_selection_layout(
        selected, seq_len=selected.shape[2], q_block=q_block, kv_block=kv_block, check=False
    )
    if query_masks is None:  # q_block 1: each row reads all of its blocks
        query_masks = selected.new_empty(0, dtype=torch.int64)
    transposed = layout.transpose()
    return (
        layout.row_offsets.clone(), layout.col_indices.clone(), transposed.row_offsets.clone(),
        transposed.col_indices.clone(), query_masks, layout.transpose_entries().clone(),
    )  # fmt: skip


@_token_layout.register_fake
def _(selected, q_block, kv_block):
    batch, heads, seq_len = selected.shape[:3]
    nnz = torch.library.get_ctx().new_dynamic_size()
    rows = (math.ceil(seq_len / q_block), math.ceil(seq_len / kv_block))
    int32 = dict(dtype=torch.int32, device=selected.device)
    int64 = dict(dtype=torch.int64, device=selected.device)
    return (
        torch.empty(batch * heads, rows[0] + 1, **int32), torch.empty(nnz, **int32),
        torch.empty(batch * heads, rows[1] + 1, **int32), torch.empty(nnz, **int32),
        torch.empty(0 if q_block == 1 else nnz, **int64), torch.empty(nnz, **int64),
    )  # fmt: skip


def _token_selection_layout(selected: torch.Tensor, *, q_block: int, kv_block: int):
    """MsaSelection of select_tokens' [B, H_p, S, top_k] choices over tiles of q_block tokens."""
    row_offsets, col_indices, t_row_offsets, t_col_indices, query_masks, entries = _token_layout(
        selected, q_block, kv_block
    )
    batch, heads, seq_len = selected.shape[:3]
    layout = BlockLayout(
        row_offsets, col_indices, seq_len_q=seq_len, seq_len_kv=seq_len, q_block=q_block,
        kv_block=kv_block, layout_batch=batch, layout_heads=heads, validate=False,
    ).attach_transpose(t_row_offsets, t_col_indices, entries)  # fmt: skip
    return MsaSelection(layout, None if q_block == 1 else query_masks)


def kept_blocks(top_k: int, seq_len: int, kv_block: int) -> int:
    """The blocks a selection keeps per token (or query block) and proxy head: top_k, at most
    the kv blocks of seq_len tokens. No token sees more, so a larger top_k keeps them all, and
    the selection's outputs, sized by what it keeps, stay within the sequence's."""
    return min(top_k, math.ceil(seq_len / kv_block))


def kl_q_block(q_block: int) -> int:
    """The query tile of the KL's layout under granularity "token": tiles of 2 to 8 tokens
    are merged to 16 (no kv_block is smaller), whose union of choices the KL walks faster than two
    halves' (its kernels take the queries as a tile's rows and load each K and k_proxy tile
    per query tile: docs/performance.md); rows of one token stay (their tiles are a token's
    query heads)."""
    return q_block if q_block == 1 else max(q_block, MIN_KL_Q_BLOCK)


@torch.library.custom_op("flash_msa::block_selection", mutates_args=())
def _block_selection(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    document_ids: torch.Tensor | None,
    top_k: int,
    q_block: int,
    kv_block: int,
    proxy_softmax_scale: float,
    fp8_scores: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-query-block selection as a layout's (row_offsets, col_indices): block scores,
    then the diagonal and the top_k - 1 best earlier blocks of each row. One op, so that
    activation checkpointing keeps its small output instead of scoring every causal pair
    again (msa_checkpoint_context)."""
    scores = block_scores(
        q_proxy, k_proxy, q_block=q_block, kv_block=kv_block,
        proxy_softmax_scale=proxy_softmax_scale, document_ids=document_ids,
        score_dtype=FP8 if fp8_scores else None,
    )  # fmt: skip
    layout = patterns.topk(
        scores, top_k, seq_len_q=q_proxy.shape[1], q_block=q_block, kv_block=kv_block,
        fixed_counts=True,
    )  # fmt: skip
    return layout.row_offsets, layout.col_indices


@_block_selection.register_fake
def _(q_proxy, k_proxy, document_ids, top_k, q_block, kv_block, proxy_softmax_scale,
      fp8_scores):
    batch, seq_len, heads = q_proxy.shape[:3]
    num_kv_blocks = math.ceil(seq_len / kv_block)
    meta = dict(seq_len_q=seq_len, q_block=q_block, kv_block=kv_block)
    nnz = batch * heads * diagonal_total(meta, min(top_k, num_kv_blocks))
    int32 = dict(dtype=torch.int32, device=q_proxy.device)
    return (
        torch.empty(batch * heads, math.ceil(seq_len / q_block) + 1, **int32),
        torch.empty(nnz, **int32),
    )


def select(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    *,
    top_k: int,
    q_block: int,
    kv_block: int,
    proxy_softmax_scale: float,
    granularity: str,
    warmup: bool,
    document_ids: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    score_dtype: torch.dtype | None = None,
) -> tuple[MsaSelection, MsaSelection]:
    """msa_func's selection (no gradient) of [B, S, ...] proxy tensors, checked by the caller:
    (the main attention's, the KL's). The two differ only under granularity "token" with
    q_block 2 to 8, where the KL walks tiles of kl_q_block tokens; both hold exactly each
    token's choices."""
    seq_len, device = q_proxy.shape[1], q_proxy.device
    top_k = kept_blocks(top_k, seq_len, kv_block)
    with torch.no_grad():
        if warmup or q_proxy.shape[0] == 0:  # batch 0: nothing to score, empty outputs
            # Dense blocks: a row per token would only multiply the entries.
            dense_q_block = DEFAULT_Q_BLOCKS["block"] if q_block == 1 else q_block
            layout = patterns.causal(seq_len, q_block=dense_q_block, kv_block=kv_block,
                                     device=device)  # fmt: skip
        elif granularity == "token":  # it never picks a block of another document
            selected = _token_selection(
                q_proxy, k_proxy, document_ids, top_k, kv_block, score_dtype == FP8
            )
            main = _token_selection_layout(selected, q_block=q_block, kv_block=kv_block)
            kl_tiles = kl_q_block(q_block)
            if kl_tiles == q_block:
                return main, main
            return main, _token_selection_layout(selected, q_block=kl_tiles, kv_block=kv_block)
        else:
            row_offsets, col_indices = _block_selection(
                q_proxy, k_proxy, document_ids, top_k, q_block, kv_block, proxy_softmax_scale,
                score_dtype == FP8,
            )
            layout = BlockLayout(
                row_offsets, col_indices, seq_len_q=seq_len, seq_len_kv=seq_len,
                q_block=q_block, kv_block=kv_block, layout_batch=q_proxy.shape[0],
                layout_heads=q_proxy.shape[2], validate=False,
            )  # fmt: skip
        if cu_seqlens is not None:
            layout = layout & patterns.causal(
                seq_len, q_block=layout.q_block, kv_block=kv_block, device=device,
                cu_seqlens=cu_seqlens,
            )  # fmt: skip
    selection = MsaSelection(layout, None)
    return selection, selection


def msa_func(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    top_k: int = 16,
    q_block: int | None = None,
    kv_block: int = 128,
    softmax_scale: float | None = None,
    proxy_softmax_scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    warmup: bool = False,
    granularity: str = "token",
    score_dtype: torch.dtype | None = None,
    deterministic: bool = True,
    return_selection: bool = False,
):
    """MiniMax Sparse Attention, causal: the proxy picks key blocks, the main attention runs
    over them, and kl_loss trains the proxy.

    Selection (no gradient), granularity "token" (MiniMax's and poolside's): for query token
    i and proxy head p the score of kv block c is the largest proxy logit q_proxy[i, p] .
    k_proxy[j] over the keys j <= i of c (and of i's document); the token keeps its own block
    plus the top_k - 1 best other visible blocks, ties to the lower index, and every query
    head p serves attends over those blocks, causal inside. Granularity "block", a cheaper
    approximation: one choice per (query block, proxy head), scored by the largest causal
    logit over the whole (query block, kv block) tile (patterns.topk with fixed_counts).

    Args:
        q_proxy: [B, S, H_p, D_p]; k_proxy: [B, S, H_pk, D_p].
        q: [B, S, H_q, D]; k, v: [B, S, H_kv, D]; H_q a multiple of H_p, H_p of H_kv and of
            H_pk. With cu_seqlens every tensor is packed [T, H, D].
        top_k: key blocks per token (or query block) and proxy head, its own included.
        q_block, kv_block: block sizes, q_block <= kv_block (MiniMax: 64 and 128); for
            granularity "token" q_block is only the main attention's query tile, at most 64
            (the KL's holds kl_q_block tokens; None: default_q_block's, for "token" 8 where
            H_q / H_p packs 16 query heads or more to a tile, else 16, and 64 for "block");
            "token" also takes q_block 1, a row per token over exactly its blocks, where
            H_q / H_p packs 16 query heads or more.
        softmax_scale, proxy_softmax_scale: default 1 / sqrt(D) and 1 / sqrt(D_p).
        cu_seqlens: int32 [N + 1] of packed documents; nothing crosses a document.
        warmup: attend over every causal block (dense) while the proxy trains on the full
            causal context.
        granularity: "token" or "block", as above.
        score_dtype: None (the proxies' dtype) or torch.float8_e4m3fn: FP8 products for the
            selection's scores (select_tokens' or block_scores'; sm_89 and up).
        deterministic: the main attention's, as in block_sparse_attn_func (False: a faster
            backward where the backend has one, gluon's with dQ summed in an fp32 buffer
            twice q's size, 32 GiB at 1M tokens and H_q 64, where that fits the free memory;
            the KL's gradients stay reproducible).
        return_selection: also return the MsaSelection the main attention ran over.

    Returns:
        out like q (gradients as for block_sparse_attn_func; layout_heads = H_p, so a proxy
        head's query heads share their K/V loads), kl_loss: fp32 scalar, the mean over
        (token, proxy head) of KL(teacher || student) over the keys the main attention
        used; teacher = the main probabilities averaged over the proxy head's query heads
        (detached), student = softmax of proxy_softmax_scale * q_proxy . k_proxy. Its
        gradient reaches q_proxy and k_proxy only: add it to the loss with a weight.
        [, selection].

    Examples:
        >>> out, kl_loss = msa_func(q_proxy, k_proxy, q, k, v, top_k=16)
        >>> (task_loss(out) + 0.1 * kl_loss).backward()
    """
    q_block = check_msa_inputs(
        q_proxy, k_proxy, q, k, v, top_k, q_block, kv_block, proxy_softmax_scale, cu_seqlens,
        granularity, score_dtype, warmup,
    )  # fmt: skip
    for name, value in (("deterministic", deterministic), ("return_selection", return_selection)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    refusal = _env.triton_refusal(q.device, q.dtype)
    if refusal is not None:
        reason, error = refusal
        raise error(f"msa_func: {reason}")
    document_ids = None
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, total_tokens=q.shape[0], device=q.device)
        document_ids = document_ids_of(cu_seqlens, check=False)[None]  # [1, T]
        q_proxy, k_proxy, q, k, v = (t.unsqueeze(0) for t in (q_proxy, k_proxy, q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    proxy_scale = (
        1.0 / math.sqrt(q_proxy.shape[-1]) if proxy_softmax_scale is None else proxy_softmax_scale
    )
    selection, kl_selection = select(
        q_proxy, k_proxy, top_k=top_k, q_block=q_block, kv_block=kv_block,
        proxy_softmax_scale=proxy_scale, granularity=granularity, warmup=warmup,
        document_ids=document_ids, cu_seqlens=cu_seqlens, score_dtype=score_dtype,
    )  # fmt: skip
    out, lse = block_sparse_attn_func(
        q, k, v, selection.layout, causal=True, softmax_scale=scale, return_lse=True,
        document_ids=document_ids, query_masks=selection.query_masks,
        deterministic=deterministic,
    )  # fmt: skip
    kl_loss = checked_kl_loss(
        q_proxy, k_proxy, q, k, lse, kl_selection.layout, softmax_scale=scale,
        proxy_softmax_scale=proxy_scale, document_ids=document_ids,
        query_masks=kl_selection.query_masks,
    )  # fmt: skip
    if cu_seqlens is not None:
        out = out[0]
    return (out, kl_loss, selection) if return_selection else (out, kl_loss)


def msa_func_of_rows(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    document_ids: torch.Tensor,
    kv_block: int,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """msa_func over the B rows of [B, S, H, D] tensors holding packed documents, each row's
    blocks starting at its first token as msa_func's do without documents.

    Args:
        q_proxy, k_proxy, q, k, v: as msa_func's, [B, S, H, D].
        document_ids: int [B, S], non-decreasing along S (checked by the caller).
        kv_block, options: msa_func's (cu_seqlens aside).

    Returns:
        out [B, S, H_q, D] and kl_loss, the mean over every row's (proxy head, token) terms.

    The rows run packed one after another with cu_seqlens: in one call where S is a
    multiple of kv_block (every row then starts on a block boundary), else one call a row.
    """
    tensors = (q_proxy, k_proxy, q, k, v)
    batch, seq_len = q.shape[:2]
    if batch == 0:
        return msa_func(*tensors, kv_block=kv_block, **options)
    rows = batch if seq_len % kv_block == 0 else 1
    outs, kl_losses = [], []
    for first in range(0, batch, rows):
        cu_seqlens = cu_seqlens_of(document_ids[first : first + rows])
        packed = [t[first : first + rows].flatten(0, 1) for t in tensors]  # [rows * S, H, D]
        out, kl_loss = msa_func(*packed, kv_block=kv_block, cu_seqlens=cu_seqlens, **options)
        outs.append(out.unflatten(0, (rows, seq_len)))
        kl_losses.append(kl_loss)
    # Each call's KL is a mean over as many (row, proxy head, token) terms.
    return torch.cat(outs), torch.stack(kl_losses).mean()
