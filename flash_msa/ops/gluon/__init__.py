"""The "gluon" backend: Hopper (sm_90) kernels in Triton's Gluon dialect.

The forward is warp-specialised over 128 x 128 blocks (forward.py), its tiles launched
heaviest first: full blocks take no mask work, blocks cut by the causal diagonal, a window
edge, a document boundary or a ragged end are masked in registers. The backward
(backward.py) computes dK and dV over the transposed layout in Gluon and dQ with the Triton
dQ kernel: deterministic. With deterministic=False the call may instead take the "atomic"
mode where its fp32 dQ buffer fits the free memory: dQ beside dK and dV in the one kernel,
added with TMA reduce-adds in a varying order. That mode runs fewer matmuls but is slower
where a layout's blocks are scattered (its adds then miss the L2), so the first such call
of each shape times both modes and later ones take the faster (fastest.FastestPath). It
takes causal, window_size, documents and any sequence lengths; the registry passes what it
refuses (dropout, and what _check names) to the next backend.

Query blocks below 128 (q_block 64 ... 2) pack 128 / q_block query heads of a GQA group
into a tile's 128 rows, as MSA's main attention is laid out (64 x 2 per block-shared
selection, 8 x 16 per token), with or without per-token query masks, forward and backward
(with deterministic=False, dQ tiles of packed heads are added in the dK / dV kernel as boxes
of positions x heads).
"""

import functools

import torch

from flash_msa.ops.fastest import FastestPath
from flash_msa.ops.gluon import backward
from flash_msa.ops.gluon.forward import (
    BLOCK_M,
    HEAD_DIMS,
    QUERY_BLOCKS,
    attention_forward,
    packing_refusal,
    padded_length,
)
from flash_msa.ops.registry import AttentionCall, Backend, Refusal


def _forward(
    q, k, v, layout, *, causal, window_size, softmax_scale, document_ids, query_masks,
    **without_dropout,
):  # fmt: skip
    """The registry's forward; _check and the declared fields admit only calls without
    dropout or block positions."""
    return attention_forward(
        q, k, v, layout.row_offsets, layout.col_indices, softmax_scale=softmax_scale,
        layout_batch=layout.layout_batch, causal=causal, window_size=window_size,
        document_ids=document_ids, row_order=layout.heavy_rows_first(), q_block=layout.q_block,
        query_masks=None if query_masks is None else query_masks.csr,
    )  # fmt: skip


def _backward(
    grad_out, q, k, v, out, lse, layout, *, causal, window_size, softmax_scale, document_ids,
    query_masks, deterministic=True, **without_dropout,
):  # fmt: skip
    """The registry's backward: backward.attention_backward with grad_q "triton" (the
    faster reproducible mode, measured) or, deterministic=False, the faster of "triton" and
    "atomic" (dQ added in the dK / dV kernel into an fp32 buffer of twice q's bytes) as
    timed on the first call of its key, where that buffer fits in the device's free memory;
    as _forward."""

    def run(grad_q: str):
        return backward.attention_backward(
            grad_out, q, k, v, out, lse, layout, causal=causal, window_size=window_size,
            softmax_scale=softmax_scale, document_ids=document_ids, query_masks=query_masks,
            grad_q=grad_q,
        )  # fmt: skip

    if deterministic or not backward.dq_buffer_fits(q):
        return run("triton")
    return _NONDETERMINISTIC_DQ(_mode_key(q, k, layout, causal, window_size, document_ids,
                                          query_masks), run, q.device)  # fmt: skip


_NONDETERMINISTIC_DQ = FastestPath(("atomic", "triton"))


def _mode_key(q, k, layout, causal, window_size, document_ids, query_masks) -> tuple:
    """What the dQ modes' relative speed is keyed on: the device, shapes, masks, the
    layout's heads and tiles and its entry count to a power of two (a layout of another
    density, such as a longer window, is timed anew)."""
    return (q.device, q.dtype, tuple(q.shape), tuple(k.shape), layout.q_block, layout.kv_block,
            tuple(layout.row_offsets.shape), layout.col_indices.numel().bit_length(), causal,
            tuple(window_size), document_ids is not None, query_masks is not None)  # fmt: skip


def _check(call: AttentionCall) -> Refusal | None:
    if call.positions:
        return Refusal("gluon has no block positions (positions=): its blocks are the tensors' own")
    if call.layout_heads not in (1, call.heads_kv, call.heads_q):
        return Refusal(f"gluon takes layout_heads 1, H_kv or H_q, not {call.layout_heads}")
    if call.batch * padded_length(max(call.seq_len_q, call.seq_len_kv)) >= 2**31:
        return Refusal("gluon addresses B * S below 2^31 tokens (TMA coordinates)")
    reason = packing_refusal(call.q_block, call.heads_q, call.heads_kv, call.layout_heads)
    if reason is not None:
        return Refusal(f"gluon: {reason}")
    return None


BACKEND = Backend(
    name="gluon",
    forward=_forward,
    backward=_backward,
    nondeterministic_backward=functools.partial(_backward, deterministic=False),
    speed={"cuda": 20},
    devices=("cuda",),
    capabilities=((9, 0),),  # wgmma: sm_90 (H100, H200) only
    dtypes=(torch.float16, torch.bfloat16),
    head_dims=lambda head_dim: head_dim in HEAD_DIMS,
    head_dims_text=" and ".join(map(str, HEAD_DIMS)),
    block_sizes=(BLOCK_M,),
    q_block_sizes=QUERY_BLOCKS,
    dropout=False,
    deterministic=("cuda",),
    check=_check,
)

__all__ = ["BACKEND", "attention_forward"]
