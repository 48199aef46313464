"""block_sparse_attn_func and its varlen form: the inputs are validated here, once; then the
registry picks the backend and the custom op runs it under autograd."""

from __future__ import annotations

import math

import torch

from flash_msa.layout import BlockLayout, BlockPositions
from flash_msa.ops import registry
from flash_msa.ops.custom_op import sparse_attention
from flash_msa.patterns._build import is_int
from flash_msa.sequences import check_cu_seqlens, check_document_ids, document_ids_of

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # float64: torch only
# Larger scales are refused: scale * q.k overflowed the fp32 logits into NaN (1e38 did at
# inputs of unit scale). Up to it, no fp16 input overflows them (|q.k| <= 256 * 65504^2).
MAX_SOFTMAX_SCALE = 1e4
MASK_BITS = 64  # query masks: one int64 word per active pair, one bit per query row


def check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q [B, S_q, H_q, D] and k, v [B, S_kv, H_kv, D]: one dtype and device, GQA heads."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D [batch, seq_len, heads, head_dim], got shape "
                f"{list(tensor.shape)}"
            )
        if tensor.dtype not in DTYPES:
            raise TypeError(
                f"{name} must be float16, bfloat16, float32 (or float64 with backend='torch'), "
                f"got {tensor.dtype}"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them alike"
        )
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}"
        )
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q has batch {q.shape[0]} but k, v have batch {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q has head_dim {q.shape[3]} but k, v have head_dim {k.shape[3]}")
    if q.shape[3] < 1:
        raise ValueError(f"head_dim must be at least 1, got q of shape {list(q.shape)}")
    heads_q, heads_kv = q.shape[2], k.shape[2]
    if heads_q < 1 or heads_kv < 1 or heads_q % heads_kv != 0:
        raise ValueError(
            f"query heads ({heads_q}) must be a positive multiple of key/value heads "
            f"({heads_kv}) for GQA"
        )


def _check_layout(layout: BlockLayout, q: torch.Tensor, k: torch.Tensor) -> None:
    if not isinstance(layout, BlockLayout):
        raise TypeError(
            f"layout must be a flash_msa.BlockLayout, got {type(layout).__name__}; "
            "build one with flash_msa.patterns"
        )
    layout.check_unchanged()
    check_layout_device(layout, q.device)
    batch, seq_len_q, heads_q, _ = q.shape
    seq_len_kv, heads_kv = k.shape[1], k.shape[2]
    if (layout.seq_len_q, layout.seq_len_kv) != (seq_len_q, seq_len_kv):
        raise ValueError(
            f"layout is for seq_len_q={layout.seq_len_q}, seq_len_kv={layout.seq_len_kv} but q has "
            f"{seq_len_q} and k, v have {seq_len_kv} tokens; build the layout for these lengths"
        )
    check_layout_heads(layout, batch, heads_q, heads_kv)


def check_layout_device(layout: BlockLayout, device: torch.device) -> None:
    """The layout's tensors live on q's device, where the kernels read them."""
    if layout.device != device:
        raise ValueError(f"layout is on {layout.device} but q on {device}; use layout.to(q.device)")


def check_layout_heads(layout: BlockLayout, batch: int, heads_q: int, heads_kv: int) -> None:
    """The layout's batch and head dimensions broadcast to (B, H_q)."""
    if layout.layout_batch not in (1, batch):
        raise ValueError(
            f"layout_batch {layout.layout_batch} must be 1 (shared) or the batch size {batch}"
        )
    if heads_q % layout.layout_heads != 0:
        raise ValueError(
            f"layout_heads {layout.layout_heads} must divide H_q={heads_q}: query head h uses "
            f"layout head h // (H_q / layout_heads) (1 = shared, H_kv={heads_kv} = one per "
            "GQA group, H_q = one per query head)"
        )


def _check_positions(positions, layout: BlockLayout, q: torch.Tensor) -> None:
    """Block positions of the layout's local query blocks and K/V buffer slots in a sequence
    of positions.seq_len tokens; the rows of every local query block must exist there."""
    if not isinstance(positions, BlockPositions):
        raise TypeError(
            "positions must be a flash_msa.BlockPositions(q_blocks, kv_blocks, seq_len), got "
            f"{type(positions).__name__}"
        )
    seq_len = positions.seq_len
    if not is_int(seq_len) or seq_len < 1:
        raise ValueError(
            f"positions.seq_len must be a positive int (the global sequence length), got "
            f"{seq_len!r}"
        )
    if seq_len > torch.iinfo(torch.int32).max:
        raise ValueError(
            f"positions.seq_len must be below 2**31 (the kernels compute token positions in "
            f"int32), got {seq_len}"
        )
    for name, blocks in (("q_blocks", positions.q_blocks), ("kv_blocks", positions.kv_blocks)):
        if not isinstance(blocks, torch.Tensor):
            raise TypeError(f"positions.{name} must be a torch.Tensor, got {type(blocks).__name__}")
        if blocks.is_floating_point() or blocks.is_complex() or blocks.dtype == torch.bool:
            raise TypeError(
                f"positions.{name} must hold integer block indices, got {blocks.dtype}; convert "
                "with .int()"
            )
        if blocks.dim() != 1:
            raise ValueError(f"positions.{name} must be 1-D, got shape {list(blocks.shape)}")
        if blocks.device != q.device:
            raise ValueError(
                f"positions.{name} is on {blocks.device} but q on {q.device}; move it there"
            )
    q_block, kv_block = layout.q_block, layout.kv_block
    if positions.q_blocks.numel() != layout.num_q_blocks:
        raise ValueError(
            f"positions.q_blocks must name the global block of each of the layout's "
            f"{layout.num_q_blocks} query blocks (S_q={layout.seq_len_q} in blocks of {q_block}), "
            f"got {positions.q_blocks.numel()} entries"
        )
    slots = positions.kv_blocks.numel()
    if layout.seq_len_kv != slots * kv_block:
        raise ValueError(
            f"k, v must be a buffer of whole kv blocks, one per entry of positions.kv_blocks: "
            f"{slots} * {kv_block} = {slots * kv_block} rows, got {layout.seq_len_kv} (layout "
            "and k, v); pad a ragged last block (rows past seq_len are never read)"
        )
    if torch.compiler.is_compiling():
        return  # the values live on the device: checked by eager calls, not traced ones
    q_blocks, kv_blocks = positions.q_blocks.long(), positions.kv_blocks.long()
    local_rows = layout.seq_len_q - torch.arange(layout.num_q_blocks, device=q.device) * q_block
    local_rows = local_rows.clamp(max=q_block)  # [num_q_blocks]: rows of q in each block
    ends = q_blocks * q_block + local_rows  # [num_q_blocks]: past each block's last position
    repeated = (kv_blocks.sort().values.diff() == 0).any()  # two slots holding one block
    q_low, q_high, kv_low, kv_high, end, repeats = torch.stack(
        [q_blocks.min(), q_blocks.max(), kv_blocks.min(), kv_blocks.max(), ends.max(), repeated]
    ).tolist()  # one read from the device
    for name, low, high, block in (
        ("q_blocks", q_low, q_high, q_block), ("kv_blocks", kv_low, kv_high, kv_block)
    ):  # fmt: skip
        count = math.ceil(seq_len / block)
        if low < 0 or high >= count:
            raise ValueError(
                f"positions.{name} must lie in [0, {count}) (the {block}-token blocks of "
                f"seq_len={seq_len}), got values from {low} to {high}"
            )
    if repeats:
        raise ValueError(
            "positions.kv_blocks must name each global kv block at most once (a block in two "
            "slots would count its keys twice in the softmax)"
        )
    if end > seq_len:
        local = int((ends > seq_len).nonzero()[0, 0])
        raise ValueError(
            f"local query block {local} (global block {int(q_blocks[local])}) holds "
            f"{int(local_rows[local])} rows of q, reaching global position "
            f"{int(ends[local]) - 1} past seq_len={seq_len}: only the last local query block "
            "may be the ragged global last block (q cut at seq_len)"
        )


def check_query_masks(query_masks, layout: BlockLayout, device: torch.device) -> None:
    """Per-token selections over a layout: int64 [layout.nnz], contiguous, on `device`, one
    word per active pair in the order of layout.col_indices, bit r set when query row r of
    the pair's query block reads its kv block; query blocks of at most 64 rows."""
    if not isinstance(query_masks, torch.Tensor):
        raise TypeError(
            f"query_masks must be a torch.Tensor (int64 [layout.nnz]), got "
            f"{type(query_masks).__name__}"
        )
    if query_masks.dtype != torch.int64:
        raise TypeError(
            f"query_masks must be int64 (one 64-bit word of query-row bits per active block), "
            f"got {query_masks.dtype}; convert with .long()"
        )
    if layout.q_block > MASK_BITS:
        raise ValueError(
            f"query_masks need q_block <= {MASK_BITS} (one 64-bit word per (query block, kv "
            f"block) pair holds a bit per query row), got q_block={layout.q_block}; build the "
            "layout with q_block 16, 32 or 64"
        )
    if tuple(query_masks.shape) != (layout.nnz,):
        raise ValueError(
            f"query_masks must have shape [layout.nnz] = [{layout.nnz}] (one word per entry of "
            f"layout.col_indices, in its order), got {list(query_masks.shape)}"
        )
    if query_masks.device != device:
        raise ValueError(f"query_masks is on {query_masks.device} but q on {device}; move it there")
    if not query_masks.is_contiguous():
        raise ValueError(
            f"query_masks must be contiguous, got stride {query_masks.stride()}; pass "
            "query_masks.contiguous()"
        )


def check_softmax_scale(name: str, scale) -> None:
    """A softmax scale is None (1 / sqrt(D)) or a positive float up to MAX_SOFTMAX_SCALE."""
    real = isinstance(scale, (int, float)) and not isinstance(scale, bool)
    if real and scale > MAX_SOFTMAX_SCALE:  # inf too; comparisons never overflow
        raise ValueError(
            f"{name} must be at most {MAX_SOFTMAX_SCALE:g}, got {scale!r}: larger scales "
            "overflow the fp32 logits scale * q.k into NaN (the default is 1 / sqrt(head_dim))"
        )
    if scale is not None and not (real and scale > 0):  # NaN fails here
        raise ValueError(f"{name} must be a positive finite float or None, got {scale!r}")


def check_bools(**values) -> None:
    """TypeError naming the first of the keyword values that is not a bool."""
    for name, value in values.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_options(
    causal, window_size, softmax_scale, dropout_p, deterministic, return_lse=False
) -> None:
    """The keyword options of the op (TypeError / ValueError naming the value)."""
    check_bools(causal=causal, deterministic=deterministic, return_lse=return_lse)
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(is_int(w) and w >= -1 for w in window_size)
    ):
        raise ValueError(
            f"window_size must be (left, right) ints >= -1 (-1 = unbounded), got {window_size!r}"
        )
    check_softmax_scale("softmax_scale", softmax_scale)
    if (
        not isinstance(dropout_p, (int, float))
        or isinstance(dropout_p, bool)
        or not 0.0 <= dropout_p < 1.0
    ):
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")


def _check_documents(document_ids, q, k, positions) -> None:
    """document_ids int [B, S] over the sequence: self-attention, or the global one of
    positions."""
    if positions is not None:
        check_document_ids(document_ids, q.shape[0], positions.seq_len, q.device)
        return
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"document_ids needs self-attention lengths, got S_q={q.shape[1]} and S_kv={k.shape[1]}"
        )
    check_document_ids(document_ids, q.shape[0], q.shape[1], q.device)


def _attention(
    q, k, v, layout, causal, window_size, softmax_scale, dropout_p, backend, deterministic,
    document_ids, positions, query_masks,
):  # fmt: skip
    """Dispatch of validated inputs through the registry: (out, lse)."""
    # Only a call that autograd will differentiate needs a reproducible backward.
    needs_backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    call = registry.AttentionCall(
        device=q.device, dtype=q.dtype, head_dim=q.shape[-1], q_block=layout.q_block,
        kv_block=layout.kv_block, dropout=dropout_p > 0, documents=document_ids is not None,
        deterministic=deterministic and needs_backward,
        element_masks=causal or max(window_size) >= 0, seq_len_q=q.shape[1],
        seq_len_kv=k.shape[1], batch=q.shape[0], heads_q=q.shape[2], heads_kv=k.shape[2],
        layout_heads=layout.layout_heads, positions=positions is not None,
        query_masks=query_masks is not None,
    )  # fmt: skip
    chosen = registry.select(call, backend)
    # A fresh Philox seed per call from PyTorch's default generator (torch.manual_seed).
    seed = int(torch.randint(2**31 - 1, ())) if dropout_p > 0 else 0
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    # A window as long as the sequences is unbounded: kernels get ints that fit int64.
    longest = max(layout.seq_len_q, layout.seq_len_kv, positions.seq_len if positions else 0)
    window_size = tuple(min(side, longest) for side in window_size)
    return sparse_attention(
        q, k, v, layout, backend=chosen.name, causal=causal, window_size=window_size,
        softmax_scale=scale, document_ids=document_ids, dropout_p=float(dropout_p),
        dropout_seed=seed, positions=positions, query_masks=query_masks,
        deterministic=deterministic,
    )  # fmt: skip


def block_sparse_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
    deterministic: bool = True,
    document_ids: torch.Tensor | None = None,
    positions: BlockPositions | None = None,
    query_masks: torch.Tensor | None = None,
):
    """Attention over the blocks `layout` marks active.

    Query i sees key j when their blocks are active, the element masks allow it and, with
    query_masks, i's own selection holds j's block.

    Args:
        q: [B, S_q, H_q, D]; k, v: [B, S_kv, H_kv, D] with H_q a multiple of H_kv (GQA).
            float16 / bfloat16 (GPU), float32, or float64 (backend "torch").
        layout: a BlockLayout for (S_q, S_kv); layout head h // (H_q / layout_heads) serves
            query head h.
        causal: keep j <= i.
        window_size: (left, right) keeps i - left <= j <= i + right; -1 is unbounded.
        softmax_scale: defaults to 1 / sqrt(D); at most 1e4 (larger overflows fp32 logits).
        dropout_p: probability of dropping an attention weight (training).
        return_lse: also return the log-sum-exp of the scores.
        backend: "auto" (the fastest backend that supports the call) or a registered name
            ("triton", "torch", ...); see flash_msa.ops.registry.
        deterministic: a bitwise reproducible backward (the default): backends with a faster
            backward whose sums come in a varying order (gluon's, dQ by atomics) take it
            only with deterministic=False, and those with no reproducible backward on the
            device (torch on CUDA) are refused for calls that need a backward. The atomic
            adds are faster where neighbouring kv blocks share query blocks (causal,
            windows, documents, MSA's selections) and slower on scattered blocks (random
            top-k): docs/performance.md.
        document_ids: int [B, S] (non-decreasing along S, S_q == S_kv): keep pairs of one
            document.
        positions: a BlockPositions placing the layout's blocks in a longer sequence (context
            parallelism): q holds local query blocks, k and v a buffer of whole kv blocks
            (slots) the layout's columns name; masks, document_ids [B, positions.seq_len] and
            dropout see global positions, so each row equals the whole-sequence call's.
        query_masks: per-token selections (MSA with one set of kv blocks per query token):
            int64 [layout.nnz], contiguous, one word per entry of layout.col_indices (same
            flat order), bit r set when query row r of that entry's query block (token
            q_blk * q_block + r of the layout's rows) reads its kv block; needs q_block <= 64.
            Applied on top of the element masks; a row no bit selects sees nothing.

    Returns:
        out [B, S_q, H_q, D] (zeros where a query sees nothing) and, with return_lse,
        lse [B, H_q, S_q] (fp32, fp64 for float64 inputs; natural log; -inf where a query
        sees nothing).

    Examples:
        >>> layout = patterns.sliding_window(4096, 512) | patterns.global_tokens(4096, 64)
        >>> out = block_sparse_attn_func(q, k, v, layout, causal=True)
    """
    check_tensors(q, k, v)
    _check_layout(layout, q, k)
    check_options(causal, window_size, softmax_scale, dropout_p, deterministic, return_lse)
    if positions is not None:
        _check_positions(positions, layout, q)
    if document_ids is not None:
        _check_documents(document_ids, q, k, positions)
    if query_masks is not None:
        check_query_masks(query_masks, layout, q.device)
    out, lse = _attention(
        q, k, v, layout, causal, window_size, softmax_scale, dropout_p, backend, deterministic,
        document_ids, positions, query_masks,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def block_sparse_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    layout: BlockLayout,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
    deterministic: bool = True,
    positions: BlockPositions | None = None,
    query_masks: torch.Tensor | None = None,
):
    """Attention over documents packed back to back, without padding.

    Attention never crosses a document; causal and window_size apply within each.

    Args:
        q: [T, H_q, D]; k, v: [T, H_kv, D], the documents' tokens back to back.
        cu_seqlens: int32 [N + 1], document starts then T, as in FlashAttention.
        max_seqlen: at least the longest document.
        layout: a BlockLayout over the T packed tokens (e.g. built with
            cu_seqlens=cu_seqlens, or pattern & patterns.documents(cu_seqlens)).
        causal, window_size, softmax_scale, dropout_p, return_lse, backend, deterministic:
            as in block_sparse_attn_func.
        positions: as in block_sparse_attn_func: q holds local query blocks of the packed
            tokens, k and v a buffer of kv blocks; cu_seqlens then ends at positions.seq_len.
        query_masks: as in block_sparse_attn_func, over the layout's packed rows.

    Returns:
        out [T, H_q, D] and, with return_lse, lse [H_q, T] (fp32, fp64 for float64 inputs).
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if isinstance(tensor, torch.Tensor) and tensor.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D [total_tokens, heads, head_dim] for the varlen call, got "
                f"shape {list(tensor.shape)}; padded batches go to block_sparse_attn_func"
            )
    check_tensors(*(t.unsqueeze(0) if isinstance(t, torch.Tensor) else t for t in (q, k, v)))
    if positions is None and q.shape[0] != k.shape[0]:
        raise ValueError(f"q has {q.shape[0]} tokens but k, v have {k.shape[0]}; pack them alike")
    if not is_int(max_seqlen) or max_seqlen < 0:
        raise ValueError(f"max_seqlen must be a non-negative int, got {max_seqlen!r}")
    if positions is None:
        check_cu_seqlens(cu_seqlens, total_tokens=q.shape[0], max_seqlen=max_seqlen,
                         device=q.device)  # fmt: skip
    q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    _check_layout(layout, q, k)
    check_options(causal, window_size, softmax_scale, dropout_p, deterministic, return_lse)
    if positions is not None:  # the documents pack the global sequence
        _check_positions(positions, layout, q)
        check_cu_seqlens(cu_seqlens, total_tokens=positions.seq_len, max_seqlen=max_seqlen,
                         device=q.device)  # fmt: skip
    if query_masks is not None:
        check_query_masks(query_masks, layout, q.device)
    out, lse = _attention(
        q, k, v, layout, causal, window_size, softmax_scale, dropout_p, backend, deterministic,
        document_ids_of(cu_seqlens, check=False)[None], positions, query_masks,
    )  # fmt: skip
    return (out[0], lse[0]) if return_lse else out[0]
