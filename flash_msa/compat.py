"""Drop-in entry points of other MSA libraries, on flash-msa's kernels.

flash_msa_func has the signature and layouts of poolside's Flash-MSA: inputs [B, H, S, D],
top_k counted in tokens, one softmax scale for the main and the proxy attention, output
[B, S, H * D]. It returns the KL loss's real value (poolside's forward returns a zero
placeholder whose backward carries the gradient).
"""

from __future__ import annotations

import torch

from flash_msa.msa.interface import msa_func, msa_func_of_rows
from flash_msa.ops.interface import check_softmax_scale
from flash_msa.sequences import check_cu_seqlens, check_document_ids, document_ids_of

KV_BLOCK = 128  # poolside's block size: top_k is a multiple of it


def _check_tensors(named: dict[str, torch.Tensor]) -> None:
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S, D], got {list(tensor.shape)}")
    batch, _, seq_len, _ = named["q"].shape
    for name, tensor in named.items():
        if (tensor.shape[0], tensor.shape[2]) != (batch, seq_len):
            raise ValueError(
                f"{name} {list(tensor.shape)} and q {list(named['q'].shape)} must agree in B "
                "(dim 0) and S (dim 2): inputs are [B, H, S, D]"
            )
        if 0 in tensor.shape[1:]:
            raise ValueError(f"{name} {list(tensor.shape)} needs H, S and D of at least 1")
    for group in (("q", "k", "v"), ("q_proxy", "k_proxy")):
        if len({named[name].shape[3] for name in group}) > 1:
            shapes = ", ".join(f"{name} {list(named[name].shape)}" for name in group)
            raise ValueError(f"{', '.join(group)} must share their head dim (dim 3): {shapes}")


def _check_top_k(top_k) -> None:
    if type(top_k) is not int or top_k < KV_BLOCK or top_k % KV_BLOCK:
        raise ValueError(
            f"top_k counts tokens: a positive multiple of {KV_BLOCK} (the block size), got "
            f"{top_k!r}; top_k={16 * KV_BLOCK} keeps 16 blocks"
        )


def _check_row_bounds(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> None:
    """cu_seqlens over B * S tokens must hold every row's start: no document spans two rows."""
    rows = torch.arange(0, batch * seq_len + 1, seq_len, device=cu_seqlens.device)
    if not bool(torch.isin(rows, cu_seqlens.to(rows.dtype)).all()):
        raise ValueError(
            f"cu_seqlens must include every batch-row boundary (multiples of S = {seq_len} up "
            f"to B * S = {batch * seq_len}): a document may not cross from one row to the next"
        )


def flash_msa_func(
    q_proxy: torch.Tensor,
    k_proxy: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    top_k: int,
    scale: float,
    document_ids: torch.Tensor | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MSA with poolside's signature (per-token selection over blocks of 128).

    Args:
        q_proxy: [B, H_p, S, D_p]; k_proxy: [B, H_pk, S, D_p]; q: [B, H_q, S, D]; k, v:
            [B, H_kv, S, D]; H_q a multiple of H_p, H_p of H_kv and of H_pk.
        top_k: keys per token, a multiple of 128: top_k / 128 blocks, the token's own included.
        scale: the softmax scale of both the main and the proxy logits (e.g. D ** -0.5).
        document_ids: int [B, S], non-decreasing along S: attention stays inside a document.
            A row's blocks of 128 start at its first token, as without documents.
        cu_seqlens: int32 [N + 1] document bounds over the B * S flattened tokens, including
            every row's start (instead of document_ids).

    Returns:
        out [B, S, H_q * D] and kl_loss, the fp32 mean over (batch, proxy head, token) of
        the KL of the proxy's distribution from the main attention's over the token's keys;
        its gradient reaches q_proxy and k_proxy only.
    """
    named = dict(q_proxy=q_proxy, k_proxy=k_proxy, q=q, k=k, v=v)
    _check_tensors(named)
    _check_top_k(top_k)
    check_softmax_scale("scale", scale)  # named here: msa_func knows it by two names
    batch, heads_q, seq_len, head_dim = q.shape
    if document_ids is not None and cu_seqlens is not None:
        raise ValueError("pass document_ids or cu_seqlens, not both")
    if document_ids is not None:
        check_document_ids(document_ids, batch, seq_len, q.device)
    elif cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, total_tokens=batch * seq_len, device=q.device)
        _check_row_bounds(cu_seqlens, batch, seq_len)
        document_ids = document_ids_of(cu_seqlens, check=False).view(batch, seq_len)
    tensors = [tensor.transpose(1, 2) for tensor in named.values()]  # [B, S, H, D]
    options = dict(top_k=top_k // KV_BLOCK, kv_block=KV_BLOCK, softmax_scale=scale,
                   proxy_softmax_scale=scale)  # fmt: skip
    if document_ids is None:
        out, kl_loss = msa_func(*tensors, **options)
    else:
        out, kl_loss = msa_func_of_rows(*tensors, document_ids=document_ids, **options)
    return out.reshape(batch, seq_len, heads_q * head_dim), kl_loss
