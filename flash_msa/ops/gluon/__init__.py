"""The "gluon" backend: Hopper (sm_90) kernels in Triton's Gluon dialect.

The forward is warp-specialised over full 128 x 128 blocks (forward.py); the backward is the
Triton backend's (deterministic: no atomics). It takes calls without element masks (no
causal or window bound, no documents, no dropout) on sequence lengths that are multiples of
128; the registry passes every other call to the next backend.
"""

import torch

from flash_msa import _env
from flash_msa.ops.gluon.forward import BLOCK_M, HEAD_DIMS, attention_forward
from flash_msa.ops.registry import AttentionCall, Backend, Refusal
from flash_msa.ops.triton import attention_backward


def _forward(q, k, v, layout, *, softmax_scale, **unmasked):
    """The registry's forward; _check and the declared fields admit only calls whose other
    options (causal, window_size, document_ids, dropout) ask for no mask."""
    return attention_forward(
        q, k, v, layout.row_offsets, layout.col_indices, softmax_scale=softmax_scale,
        layout_batch=layout.layout_batch,
    )  # fmt: skip


def _check(call: AttentionCall) -> Refusal | None:
    if _env.capability(call.device) != (9, 0):
        return Refusal("gluon runs on sm_90 (H100, H200) only")
    if call.element_masks:
        return Refusal("gluon takes whole blocks only: no causal or window masks")
    if call.seq_len_q % BLOCK_M or call.seq_len_kv % BLOCK_M:
        return Refusal(
            f"gluon takes sequence lengths that are multiples of {BLOCK_M}, not "
            f"{call.seq_len_q} and {call.seq_len_kv}"
        )
    if call.layout_heads not in (1, call.heads_kv, call.heads_q):
        return Refusal(f"gluon takes layout_heads 1, H_kv or H_q, not {call.layout_heads}")
    if call.batch * max(call.seq_len_q, call.seq_len_kv) >= 2**31:
        return Refusal("gluon addresses B * S below 2^31 tokens (TMA coordinates)")
    return None


BACKEND = Backend(
    name="gluon",
    forward=_forward,
    backward=attention_backward,
    speed={"cuda": 20},
    devices=("cuda",),
    min_capability=(9, 0),
    dtypes=(torch.float16, torch.bfloat16),
    head_dims=lambda head_dim: head_dim in HEAD_DIMS,
    head_dims_text=" and ".join(map(str, HEAD_DIMS)),
    block_sizes=(BLOCK_M,),
    dropout=False,
    documents=False,
    check=_check,
)

__all__ = ["BACKEND", "attention_forward"]
