"""The block-sparse op as a torch.library custom op: torch.compile traces through it, and
autograd reaches the chosen backend's backward.

The layout travels as its CSR and CSC tensors plus its sizes; the backend by name, resolved
through the registry inside the op. This is the one place where the tensors the kernels
read are made kernel-ready: unit stride along D for q, k, v, out and dout (other strides
are honoured), contiguous layout and document tensors.
"""

from __future__ import annotations

import torch

from flash_msa.layout import BlockLayout
from flash_msa.ops import registry


def _unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _options(causal, window_left, window_right, softmax_scale, document_ids, dropout_p, seed):
    return dict(
        causal=causal, window_size=(window_left, window_right), softmax_scale=softmax_scale,
        document_ids=document_ids, dropout_p=dropout_p, dropout_seed=seed,
    )  # fmt: skip


@torch.library.custom_op("flash_msa::sparse_attention_forward", mutates_args=())
def _forward(
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
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    layout = BlockLayout.from_op_arguments(
        row_offsets, col_indices, t_row_offsets, t_col_indices, sizes
    )
    options = _options(causal, window_left, window_right, softmax_scale, document_ids,
                       dropout_p, dropout_seed)  # fmt: skip
    return registry.get(backend).forward(q, k, v, layout, **options)


@_forward.register_fake
def _(q, k, v, row_offsets, col_indices, t_row_offsets, t_col_indices, *options):
    batch, seq_len_q, heads_q, _ = q.shape
    lse = q.new_empty((batch, heads_q, seq_len_q), dtype=torch.float32)
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


@torch.library.custom_op("flash_msa::sparse_attention_backward", mutates_args=())
def _backward(
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
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layout = BlockLayout.from_op_arguments(
        row_offsets, col_indices, t_row_offsets, t_col_indices, sizes
    )
    options = _options(causal, window_left, window_right, softmax_scale, document_ids,
                       dropout_p, dropout_seed)  # fmt: skip
    grad_out = _unit_last_stride(grad_out)
    return registry.get(backend).backward(grad_out, q, k, v, out, lse, layout, **options)


@_backward.register_fake
def _(grad_out, q, k, v, *rest):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    (q, k, v, row_offsets, col_indices, t_row_offsets, t_col_indices, document_ids, sizes,
     causal, window_left, window_right, softmax_scale, dropout_p, dropout_seed,
     backend) = inputs  # fmt: skip
    out, lse = output
    ctx.save_for_backward(
        q, k, v, out, lse, row_offsets, col_indices, t_row_offsets, t_col_indices, document_ids
    )
    ctx.options = dict(
        sizes=sizes, causal=causal, window_left=window_left, window_right=window_right,
        softmax_scale=softmax_scale, dropout_p=dropout_p, dropout_seed=dropout_seed,
        backend=backend,
    )  # fmt: skip
    ctx.mark_non_differentiable(lse)


def _autograd_backward(ctx, grad_out, _grad_lse):
    (q, k, v, out, lse, row_offsets, col_indices, t_row_offsets, t_col_indices,
     document_ids) = ctx.saved_tensors  # fmt: skip
    dq, dk, dv = _backward(
        grad_out, q, k, v, out, lse, row_offsets=row_offsets, col_indices=col_indices,
        t_row_offsets=t_row_offsets, t_col_indices=t_col_indices, document_ids=document_ids,
        **ctx.options,
    )  # fmt: skip
    return (dq, dk, dv) + (None,) * 13


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    *,
    backend: str,
    causal: bool,
    window_size: tuple[int, int],
    softmax_scale: float,
    document_ids: torch.Tensor | None,
    dropout_p: float,
    dropout_seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of validated inputs on a registered backend, differentiable in q, k, v."""
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    if document_ids is not None:
        document_ids = document_ids.to(torch.int32).contiguous()
    return _forward(
        q, k, v, **layout.op_arguments(), document_ids=document_ids, causal=causal,
        window_left=window_size[0], window_right=window_size[1], softmax_scale=softmax_scale,
        dropout_p=dropout_p, dropout_seed=dropout_seed, backend=backend,
    )  # fmt: skip
