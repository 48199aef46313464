"""The dropout mask the attention kernels draw, materialised (for tests, small sizes only)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flash_msa.ops.triton.common import dropout_scale

MASK_LIMIT = 1 << 26  # elements of a materialised mask


@triton.jit
def _dropout_mask_kernel(
    keep,
    seed,
    dropout_p,
    heads_q,
    seq_len_q,
    seq_len_kv,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (cdiv(S_q, BLOCK_M), cdiv(S_kv, BLOCK_N), B * H_q); keep bool [B, H_q, S_q, S_kv]."""
    batch_head = tl.program_id(2)
    queries = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # [BLOCK_M, 1]
    keys = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [1, BLOCK_N]
    scale = dropout_scale(
        seed, batch_head // heads_q, batch_head % heads_q, queries, keys, dropout_p
    )  # [BLOCK_M, BLOCK_N]
    offsets = (batch_head.to(tl.int64) * seq_len_q + queries) * seq_len_kv + keys
    tl.store(keep + offsets, scale > 0, mask=(queries < seq_len_q) & (keys < seq_len_kv))


def dropout_mask(
    seed: int,
    dropout_p: float,
    batch: int,
    heads_q: int,
    seq_len_q: int,
    seq_len_kv: int,
    device: torch.device | str,
) -> torch.Tensor:
    """bool [B, H_q, S_q, S_kv]: True where the kernels keep a probability for this seed."""
    size = batch * heads_q * seq_len_q * seq_len_kv
    if size > MASK_LIMIT:
        raise ValueError(f"a dropout mask of {size} elements is over the limit {MASK_LIMIT}")
    keep = torch.empty(batch, heads_q, seq_len_q, seq_len_kv, dtype=torch.bool, device=device)
    grid = (triton.cdiv(seq_len_q, 32), triton.cdiv(seq_len_kv, 32), batch * heads_q)
    _dropout_mask_kernel[grid](
        keep=keep, seed=seed, dropout_p=dropout_p, heads_q=heads_q, seq_len_q=seq_len_q,
        seq_len_kv=seq_len_kv, BLOCK_M=32, BLOCK_N=32,
    )  # fmt: skip
    return keep
