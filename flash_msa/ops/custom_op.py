"""The block-sparse op as a torch.library custom op: torch.compile traces through it, and
autograd (torch.func's transforms included) reaches the chosen backend's backward.

The layout travels as its CSR and CSC tensors plus its sizes, block positions as their two
tensors plus the global length, query masks in the order of both forms (the CSC one gathered
through the layout's cached transpose_entries); the backend by name, resolved through the
registry inside the op. This is the one place where the tensors the kernels read are made
kernel-ready: unit stride along D for q, k, v, out and dout (other strides are honoured),
contiguous layout, document and query-mask tensors, int32 contiguous block positions. The
kernels launch with the tensors' GPU current (_env.on_tensor_device).
"""

from __future__ import annotations

import torch

from flash_msa import _env
from flash_msa.layout import BlockLayout, BlockPositions
from flash_msa.ops import registry
from flash_msa.ops.registry import QueryMasks


def _unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _options(causal, window_left, window_right, softmax_scale, document_ids, q_block_positions,
             kv_block_positions, position_seq_len, query_masks, t_query_masks, dropout_p,
             seed):  # fmt: skip
    positions = None if q_block_positions is None else BlockPositions(
        q_block_positions, kv_block_positions, position_seq_len
    )  # fmt: skip
    masks = None if query_masks is None else QueryMasks(query_masks, t_query_masks)
    return dict(
        causal=causal, window_size=(window_left, window_right), softmax_scale=softmax_scale,
        document_ids=document_ids, dropout_p=dropout_p, dropout_seed=seed, positions=positions,
        query_masks=masks,
    )  # fmt: skip


@torch.library.custom_op("flash_msa::sparse_attention_forward", mutates_args=())
@_env.on_tensor_device
def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    row_offsets: torch.Tensor,
    col_indices: torch.Tensor,
    t_row_offsets: torch.Tensor,
    t_col_indices: torch.Tensor,
    document_ids: torch.Tensor | None,
    q_block_positions: torch.Tensor | None,
    kv_block_positions: torch.Tensor | None,
    position_seq_len: int,
    query_masks: torch.Tensor | None,
    t_query_masks: torch.Tensor | None,
    sizes: list[int],
    causal: bool,
    window_left: int,
    window_right: int,
    softmax_scale: float,
    dropout_p: float,
    dropout_seed: int,
    backend: str,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    layout = BlockLayout.from_op_arguments(
        row_offsets, col_indices, t_row_offsets, t_col_indices, sizes
    )
    options = _options(causal, window_left, window_right, softmax_scale, document_ids,
                       q_block_positions, kv_block_positions, position_seq_len, query_masks,
                       t_query_masks, dropout_p, dropout_seed)  # fmt: skip
    return registry.get(backend).forward(q, k, v, layout, **options)


@_forward.register_fake
def _(q, k, v, row_offsets, col_indices, t_row_offsets, t_col_indices, *options):
    batch, seq_len_q, heads_q, _ = q.shape
    lse = q.new_empty((batch, heads_q, seq_len_q), dtype=registry.lse_dtype(q.dtype))
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


@torch.library.custom_op("flash_msa::sparse_attention_backward", mutates_args=())
@_env.on_tensor_device
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
    q_block_positions: torch.Tensor | None,
    kv_block_positions: torch.Tensor | None,
    position_seq_len: int,
    query_masks: torch.Tensor | None,
    t_query_masks: torch.Tensor | None,
    sizes: list[int],
    causal: bool,
    window_left: int,
    window_right: int,
    softmax_scale: float,
    dropout_p: float,
    dropout_seed: int,
    backend: str,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layout = BlockLayout.from_op_arguments(
        row_offsets, col_indices, t_row_offsets, t_col_indices, sizes
    )
    options = _options(causal, window_left, window_right, softmax_scale, document_ids,
                       q_block_positions, kv_block_positions, position_seq_len, query_masks,
                       t_query_masks, dropout_p, dropout_seed)  # fmt: skip
    grad_out = _unit_last_stride(grad_out)
    entry = registry.get(backend)
    backward = entry.backward
    if not deterministic and entry.nondeterministic_backward is not None:
        backward = entry.nondeterministic_backward
    return backward(grad_out, q, k, v, out, lse, layout, **options)


@_backward.register_fake
def _(grad_out, q, k, v, *rest):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    (q, k, v, row_offsets, col_indices, t_row_offsets, t_col_indices, document_ids,
     q_block_positions, kv_block_positions, position_seq_len, query_masks, t_query_masks, sizes,
     causal, window_left, window_right, softmax_scale, dropout_p, dropout_seed, backend,
     deterministic) = inputs  # fmt: skip
    out, lse = output
    ctx.save_for_backward(
        q, k, v, out, lse, row_offsets, col_indices, t_row_offsets, t_col_indices, document_ids,
        q_block_positions, kv_block_positions, query_masks, t_query_masks,
    )  # fmt: skip
    ctx.options = dict(
        position_seq_len=position_seq_len, sizes=sizes, causal=causal, window_left=window_left,
        window_right=window_right, softmax_scale=softmax_scale, dropout_p=dropout_p,
        dropout_seed=dropout_seed, backend=backend, deterministic=deterministic,
    )  # fmt: skip
    ctx.mark_non_differentiable(lse)


def _autograd_backward(ctx, grad_out, _grad_lse):
    (q, k, v, out, lse, row_offsets, col_indices, t_row_offsets, t_col_indices, document_ids,
     q_block_positions, kv_block_positions, query_masks,
     t_query_masks) = ctx.saved_tensors  # fmt: skip
    dq, dk, dv = _backward(
        grad_out, q, k, v, out, lse, row_offsets=row_offsets, col_indices=col_indices,
        t_row_offsets=t_row_offsets, t_col_indices=t_col_indices, document_ids=document_ids,
        q_block_positions=q_block_positions, kv_block_positions=kv_block_positions,
        query_masks=query_masks, t_query_masks=t_query_masks, **ctx.options,
    )  # fmt: skip
    return (dq, dk, dv) + (None,) * 19


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def _fold(tensor: torch.Tensor, dim: int | None, size: int) -> torch.Tensor:
    """[size * B, ...] of a tensor vmapped at dim (or not: `size` equal copies)."""
    tensor = tensor.expand(size, *tensor.shape) if dim is None else tensor.movedim(dim, 0)
    return tensor.flatten(0, 1)


def _stacked_layout(size, row_offsets, col_indices, t_row_offsets, t_col_indices, sizes,
                    query_masks, t_query_masks):  # fmt: skip
    """The layout (and query masks) of `size` batches stacked into one: a shared layout
    (layout_batch 1) as is, per-batch-element ones repeated (offsets shift by nnz per copy).
    Returns the op's layout arguments, then query_masks, t_query_masks, then sizes."""
    if sizes[4] == 1:
        return row_offsets, col_indices, t_row_offsets, t_col_indices, query_masks, \
            t_query_masks, sizes  # fmt: skip
    shift = torch.arange(size, device=row_offsets.device, dtype=row_offsets.dtype)
    shift = shift[:, None, None] * col_indices.numel()
    masks = (None, None) if query_masks is None else (query_masks.repeat(size),
                                                      t_query_masks.repeat(size))  # fmt: skip
    return (
        (row_offsets + shift).flatten(0, 1), col_indices.repeat(size),
        (t_row_offsets + shift).flatten(0, 1), t_col_indices.repeat(size), *masks,
        [*sizes[:4], sizes[4] * size, sizes[5]],
    )  # fmt: skip


def _refuse_batched_layout(in_dims) -> None:
    if any(dim is not None for dim in in_dims):
        raise ValueError(
            "vmap over a layout's tensors or block positions (or query masks) is not "
            "supported: vmap over q, k, v (and document ids) with one BlockLayout, one "
            "BlockPositions and one query_masks tensor, or stack the layouts (patterns.stack)"
        )


@_forward.register_vmap
def _(info, in_dims, q, k, v, row_offsets, col_indices, t_row_offsets, t_col_indices,
      document_ids, q_block_positions, kv_block_positions, position_seq_len, query_masks,
      t_query_masks, sizes, *options):  # fmt: skip
    """vmap folds its dimension into the batch: one launch, not one per vmapped element
    (block positions, the same for every batch element, pass through unchanged)."""
    _refuse_batched_layout(in_dims[3:7] + in_dims[8:10] + in_dims[11:13])
    size = info.batch_size
    q, k, v = (_fold(t, dim, size) for t, dim in zip((q, k, v), in_dims, strict=False))
    if document_ids is not None:
        document_ids = _fold(document_ids, in_dims[7], size)
    layout = _stacked_layout(size, row_offsets, col_indices, t_row_offsets, t_col_indices, sizes,
                             query_masks, t_query_masks)  # fmt: skip
    out, lse = _forward(q, k, v, *layout[:4], document_ids, q_block_positions,
                        kv_block_positions, position_seq_len, *layout[4:], *options)  # fmt: skip
    return (out.unflatten(0, (size, -1)), lse.unflatten(0, (size, -1))), (0, 0)


@_backward.register_vmap
def _(info, in_dims, grad_out, q, k, v, out, lse, row_offsets, col_indices, t_row_offsets,
      t_col_indices, document_ids, q_block_positions, kv_block_positions, position_seq_len,
      query_masks, t_query_masks, sizes, *options):  # fmt: skip
    _refuse_batched_layout(in_dims[6:10] + in_dims[11:13] + in_dims[14:16])
    size = info.batch_size
    tensors = [_fold(t, dim, size) for t, dim in zip((grad_out, q, k, v, out, lse), in_dims,
                                                     strict=False)]  # fmt: skip
    if document_ids is not None:
        document_ids = _fold(document_ids, in_dims[10], size)
    layout = _stacked_layout(size, row_offsets, col_indices, t_row_offsets, t_col_indices, sizes,
                             query_masks, t_query_masks)  # fmt: skip
    grads = _backward(*tensors, *layout[:4], document_ids, q_block_positions,
                      kv_block_positions, position_seq_len, *layout[4:], *options)  # fmt: skip
    return tuple(grad.unflatten(0, (size, -1)) for grad in grads), (0, 0, 0)


class _SparseAttention(torch.autograd.Function):
    """The op under autograd for callers of sparse_attention: a Function with setup_context,
    which torch.func transforms (grad, vjp, vmap of either) accept, where they refuse the one
    register_autograd makes. Its backward is not differentiable (an error, not a silent zero,
    if a double backward reaches it)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, row_offsets, col_indices, t_row_offsets, t_col_indices, document_ids,
                q_block_positions, kv_block_positions, position_seq_len, query_masks,
                t_query_masks, sizes, causal, window_left, window_right, softmax_scale,
                dropout_p, dropout_seed, backend, deterministic):  # fmt: skip
        return _forward(
            q, k, v, row_offsets, col_indices, t_row_offsets, t_col_indices, document_ids,
            q_block_positions, kv_block_positions, position_seq_len, query_masks, t_query_masks,
            sizes, causal, window_left, window_right, softmax_scale, dropout_p, dropout_seed,
            backend, deterministic,
        )  # fmt: skip

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(torch.autograd.function.once_differentiable(_autograd_backward))


def _side_tensors(document_ids, positions, query_masks, layout):
    """Kernel-ready document ids and block positions: int32 contiguous (or None), the
    positions' sequence length (0, never read, without them), and the query masks in the
    order of the layout's CSR and CSC forms (or None, None)."""
    if document_ids is not None:
        document_ids = document_ids.to(torch.int32).contiguous()
    t_query_masks = None
    if query_masks is not None:
        query_masks = query_masks.contiguous()
        t_query_masks = query_masks[layout.transpose_entries()]
    if positions is None:
        return document_ids, None, None, 0, query_masks, t_query_masks
    q_blocks, kv_blocks = (
        t.to(torch.int32).contiguous() for t in (positions.q_blocks, positions.kv_blocks)
    )
    return document_ids, q_blocks, kv_blocks, positions.seq_len, query_masks, t_query_masks


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
    positions: BlockPositions | None = None,
    query_masks: torch.Tensor | None = None,
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of validated inputs on a registered backend, differentiable in q, k, v;
    positions place the layout's blocks in a longer sequence (BlockPositions); query_masks,
    int64 [layout.nnz] aligned with layout.col_indices, keep key j of an active block for
    query i where bit i % q_block of the pair's word is set; deterministic=False lets the
    backward be the backend's nondeterministic one, where it has one."""
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    (document_ids, q_block_positions, kv_block_positions, position_seq_len, query_masks,
     t_query_masks) = _side_tensors(document_ids, positions, query_masks, layout)  # fmt: skip
    # Under torch.func's transforms through the Function they accept; else the op itself
    # (torch.compile warns on tracing any autograd.Function).
    functorch = not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active()
    attention = _SparseAttention.apply if functorch else _forward
    tensors = layout.op_arguments()
    # Positional: torch.func's transforms refuse keyword tensors to a Function (torch 2.11).
    return attention(
        q, k, v, tensors["row_offsets"], tensors["col_indices"], tensors["t_row_offsets"],
        tensors["t_col_indices"], document_ids, q_block_positions, kv_block_positions,
        position_seq_len, query_masks, t_query_masks, tensors["sizes"], causal, window_size[0],
        window_size[1], softmax_scale, dropout_p, dropout_seed, backend, deterministic,
    )  # fmt: skip


def sparse_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    layout: BlockLayout,
    *,
    backend: str,
    causal: bool,
    window_size: tuple[int, int],
    softmax_scale: float,
    document_ids: torch.Tensor | None,
    dropout_p: float,
    dropout_seed: int,
    positions: BlockPositions | None = None,
    query_masks: torch.Tensor | None = None,
    deterministic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of sparse_attention's inputs for grad_out, given out and lse. out and
    lse may be those of a softmax over more keys than this call's (the merge of several
    calls over disjoint key sets): the gradients are then those of this call's keys, as in
    FlashAttention's backward, and dq adds up over the calls. deterministic as in
    sparse_attention."""
    q, k, v, out = (_unit_last_stride(t) for t in (q, k, v, out))
    (document_ids, q_block_positions, kv_block_positions, position_seq_len, query_masks,
     t_query_masks) = _side_tensors(document_ids, positions, query_masks, layout)  # fmt: skip
    tensors = layout.op_arguments()
    return _backward(
        grad_out, q, k, v, out, lse, tensors["row_offsets"], tensors["col_indices"],
        tensors["t_row_offsets"], tensors["t_col_indices"], document_ids, q_block_positions,
        kv_block_positions, position_seq_len, query_masks, t_query_masks, tensors["sizes"],
        causal, window_size[0], window_size[1], softmax_scale, dropout_p, dropout_seed, backend,
        deterministic,
    )  # fmt: skip
