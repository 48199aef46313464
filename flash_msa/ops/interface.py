"""block_sparse_attn_func: validation, backend dispatch and autograd."""

from __future__ import annotations

import math
import os

import torch

from flash_msa.layout import BlockLayout
from flash_msa.ops.torch_ref import block_sparse_attention_torch
from flash_msa.sequences import check_cu_seqlens, check_document_ids, document_ids_of

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # float64: torch only
BACKENDS = ("auto", "torch", "triton")
MAX_HEAD_DIM = 256


def _check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
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
    head_dim = q.shape[3]
    if head_dim > MAX_HEAD_DIM or head_dim % 8 != 0:
        raise ValueError(
            f"head_dim must be a multiple of 8 up to {MAX_HEAD_DIM}, got {head_dim}; "
            "pad the head dimension"
        )
    heads_q, heads_kv = q.shape[2], k.shape[2]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(
            f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv}) for GQA"
        )


def _check_layout(layout: BlockLayout, q: torch.Tensor, k: torch.Tensor) -> None:
    if not isinstance(layout, BlockLayout):
        raise TypeError(
            f"layout must be a flash_msa.BlockLayout, got {type(layout).__name__}; "
            "build one with flash_msa.patterns"
        )
    if layout.device != q.device:
        raise ValueError(
            f"layout is on {layout.device} but q on {q.device}; use layout.to(q.device)"
        )
    batch, seq_len_q, heads_q, _ = q.shape
    seq_len_kv, heads_kv = k.shape[1], k.shape[2]
    if (layout.seq_len_q, layout.seq_len_kv) != (seq_len_q, seq_len_kv):
        raise ValueError(
            f"layout is for seq_len_q={layout.seq_len_q}, seq_len_kv={layout.seq_len_kv} but q has "
            f"{seq_len_q} and k, v have {seq_len_kv} tokens; build the layout for these lengths"
        )
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


def _check_options(causal, window_size, softmax_scale, dropout_p, backend, device, dtype) -> str:
    """Validate the keyword options; returns the backend to run."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and w >= -1 for w in window_size)
    ):
        raise ValueError(
            f"window_size must be (left, right) ints >= -1 (-1 = unbounded), got {window_size!r}"
        )
    if softmax_scale is not None and not (
        isinstance(softmax_scale, (int, float))
        and math.isfinite(softmax_scale)
        and softmax_scale > 0
    ):
        raise ValueError(
            f"softmax_scale must be a positive finite float or None, got {softmax_scale!r}"
        )
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if backend == "triton" and device.type != "cuda" and not interpreted:
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got {device}) or TRITON_INTERPRET=1 on the CPU; "
            "use backend='torch' or 'auto'"
        )
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and dtype != torch.float64 else "torch"
    if backend == "triton" and dtype == torch.float64:
        raise TypeError(
            "float64 runs on backend='torch' only; cast to float32 or pick that backend"
        )
    if backend == "triton" and device.type != "cuda" and dtype == torch.bfloat16:
        raise TypeError(
            "Triton's CPU interpreter computes bfloat16 wrongly; on the CPU use float16 or "
            "float32 with backend='triton', or backend='torch'"
        )
    return backend


LAYOUT_SIZES = ("seq_len_q", "seq_len_kv", "q_block", "kv_block", "layout_batch", "layout_heads")


def _layout_of(row_offsets, col_indices, t_row_offsets, t_col_indices, sizes) -> BlockLayout:
    """Rebuild the (already validated) layout and its transposed form inside the ops."""
    layout = BlockLayout(
        row_offsets, col_indices, **dict(zip(LAYOUT_SIZES, sizes, strict=True)), validate=False
    )
    return layout.attach_transpose(t_row_offsets, t_col_indices)


# The Triton path is a torch.library custom op so that torch.compile traces through it;
# the layout travels as its CSR and CSC tensors plus its sizes.
@torch.library.custom_op("flash_msa::sparse_attention_forward", mutates_args=())
def _sparse_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    row_offsets: torch.Tensor,
    col_indices: torch.Tensor,
    t_row_offsets: torch.Tensor,
    t_col_indices: torch.Tensor,
    document_ids: torch.Tensor | None,
    sizes: list[int],
    causal: bool,
    window_left: int,
    window_right: int,
    softmax_scale: float,
    dropout_p: float,
    dropout_seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Imported here: the kernels compile for the interpreter only if TRITON_INTERPRET
    # is set when they are first imported.
    from flash_msa.ops.triton.forward import attention_forward

    layout = _layout_of(row_offsets, col_indices, t_row_offsets, t_col_indices, sizes)
    return attention_forward(
        q, k, v, layout, causal=causal, window_size=(window_left, window_right),
        softmax_scale=softmax_scale, document_ids=document_ids, dropout_p=dropout_p,
        dropout_seed=dropout_seed,
    )  # fmt: skip


@_sparse_attention_forward.register_fake
def _(q, k, v, row_offsets, col_indices, t_row_offsets, t_col_indices, *options):
    batch, seq_len_q, heads_q, _ = q.shape
    lse = q.new_empty((batch, heads_q, seq_len_q), dtype=torch.float32)
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


@torch.library.custom_op("flash_msa::sparse_attention_backward", mutates_args=())
def _sparse_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    row_offsets: torch.Tensor,
    col_indices: torch.Tensor,
    t_row_offsets: torch.Tensor,
    t_col_indices: torch.Tensor,
    document_ids: torch.Tensor | None,
    sizes: list[int],
    causal: bool,
    window_left: int,
    window_right: int,
    softmax_scale: float,
    dropout_p: float,
    dropout_seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from flash_msa.ops.triton.backward import attention_backward

    layout = _layout_of(row_offsets, col_indices, t_row_offsets, t_col_indices, sizes)
    return attention_backward(
        grad_out, q, k, v, out, lse, layout, causal=causal,
        window_size=(window_left, window_right), softmax_scale=softmax_scale,
        document_ids=document_ids, dropout_p=dropout_p, dropout_seed=dropout_seed,
    )  # fmt: skip


@_sparse_attention_backward.register_fake
def _(grad_out, q, k, v, *rest):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, *layout_tensors, document_ids = inputs[:8]
    ctx.save_for_backward(q, k, v, *output, *layout_tensors, document_ids)
    ctx.options = inputs[8:]  # sizes, causal, window, scale, dropout p and seed
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, *layout_tensors, document_ids = ctx.saved_tensors
    dq, dk, dv = _sparse_attention_backward(
        grad_out, q, k, v, out, lse, *layout_tensors, document_ids, *ctx.options
    )
    return (dq, dk, dv) + (None,) * 12


_sparse_attention_forward.register_autograd(_backward, setup_context=_setup_context)


def _attention(
    q, k, v, layout, causal, window_size, softmax_scale, dropout_p, backend, document_ids
):
    """Dispatch of validated inputs: (out, lse)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    window_size, dropout_p = tuple(window_size), float(dropout_p)
    if backend == "torch":
        return block_sparse_attention_torch(
            q, k, v, layout, causal=causal, window_size=window_size, softmax_scale=scale,
            document_ids=document_ids, dropout_p=dropout_p,
        )  # fmt: skip
    # A fresh Philox seed per call from PyTorch's default generator (torch.manual_seed).
    seed = int(torch.randint(2**31 - 1, ())) if dropout_p > 0 else 0
    transposed = layout.transpose()
    return _sparse_attention_forward(
        q, k, v, layout.row_offsets, layout.col_indices,
        transposed.row_offsets, transposed.col_indices, document_ids,
        [getattr(layout, name) for name in LAYOUT_SIZES], causal, *window_size, scale,
        dropout_p, seed,
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
    document_ids: torch.Tensor | None = None,
):
    """Attention over the blocks `layout` marks active.

    q [B, S_q, H_q, D], k, v [B, S_kv, H_kv, D] with H_q % H_kv == 0 (GQA). Query i sees
    key j when their blocks are active and the element masks allow it: causal keeps
    j <= i, window_size = (left, right) keeps i - left <= j <= i + right (-1 unbounded),
    document_ids (int [B, S], non-decreasing along S, self-attention only) keeps pairs of
    one document. Returns out [B, S_q, H_q, D] (zeros where a query sees nothing) and,
    with return_lse, lse fp32 [B, H_q, S_q] (natural log; -inf where it sees nothing).
    """
    _check_tensors(q, k, v)
    _check_layout(layout, q, k)
    backend = _check_options(
        causal, window_size, softmax_scale, dropout_p, backend, q.device, q.dtype
    )
    if document_ids is not None:
        if q.shape[1] != k.shape[1]:
            raise ValueError(
                f"document_ids needs self-attention lengths, got S_q={q.shape[1]} and "
                f"S_kv={k.shape[1]}"
            )
        check_document_ids(document_ids, q.shape[0], q.shape[1], q.device)
    out, lse = _attention(
        q, k, v, layout, causal, window_size, softmax_scale, dropout_p, backend, document_ids
    )
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
):
    """Attention over documents packed back to back, without padding.

    q [T, H_q, D], k, v [T, H_kv, D]; cu_seqlens int32 [N + 1] (document starts, then T)
    as in FlashAttention; max_seqlen >= the longest document. The layout is over the T
    packed tokens (e.g. pattern & patterns.documents(cu_seqlens)); attention never crosses
    a document, and causal / window_size apply within each. Returns out [T, H_q, D] and,
    with return_lse, lse fp32 [H_q, T].
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if isinstance(tensor, torch.Tensor) and tensor.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D [total_tokens, heads, head_dim] for the varlen call, got "
                f"shape {list(tensor.shape)}; padded batches go to block_sparse_attn_func"
            )
    _check_tensors(*(t.unsqueeze(0) if isinstance(t, torch.Tensor) else t for t in (q, k, v)))
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q has {q.shape[0]} tokens but k, v have {k.shape[0]}; pack them alike")
    if not isinstance(max_seqlen, int) or max_seqlen < 0:
        raise ValueError(f"max_seqlen must be a non-negative int, got {max_seqlen!r}")
    check_cu_seqlens(cu_seqlens, total_tokens=q.shape[0], max_seqlen=max_seqlen, device=q.device)
    q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    _check_layout(layout, q, k)
    backend = _check_options(
        causal, window_size, softmax_scale, dropout_p, backend, q.device, q.dtype
    )
    out, lse = _attention(
        q, k, v, layout, causal, window_size, softmax_scale, dropout_p, backend,
        document_ids_of(cu_seqlens)[None],
    )  # fmt: skip
    return (out[0], lse[0]) if return_lse else out[0]
