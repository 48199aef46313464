"""The "torch" backend: gather each row's active K/V blocks, mask, softmax, in plain PyTorch.

Any device and dtype (float64 for ground truth), memory bounded by a chunk of query blocks
(never S x S). Scores, softmax and the weighted sum are computed in fp32 (fp64 for fp64
inputs), as the kernels do. The backward recomputes the forward under autograd. Dropout
draws the Triton kernels' bits: Philox4x32-10 under the call's seed with counter (key
position, query position, query head, batch), computed in int64 arithmetic, so both
backends drop the same weights, in any chunking, forward and backward. Its backward
is bitwise reproducible on the CPU; on CUDA the vjp of its gathers adds with atomics, so
block_sparse_attn_func(..., deterministic=True) refuses it there for calls that need a
backward.
"""

from __future__ import annotations

import torch

from flash_msa.layout import BLOCK_SIZES, LAYOUT_BLOCK_SIZES, BlockLayout, BlockPositions
from flash_msa.ops.registry import Backend, QueryMasks, lse_dtype
from flash_msa.reference import visible

SCORE_BUDGET = 1 << 24  # score elements per chunk of query blocks (64 MiB in fp32)

# Philox4x32-10 as triton.language.random: round multipliers and key increments.
PHILOX_ROUND_A, PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
PHILOX_KEY_A, PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10
UINT32 = 0xFFFFFFFF
# uint_to_uniform_float's scale for 32 bits: the largest with (2^31 - 1) * scale < 1 in fp32.
UNIFORM_SCALE = 4.6566127342e-10


def philox(seed: int, c0, c1, c2, c3) -> torch.Tensor:
    """First 32-bit word of Philox4x32-10 for counters (c0, c1, c2, c3) under a 64-bit seed, as
    Triton's tl.philox(seed, c0, c1, c2, c3)[0]: int64 tensors of uint32 values, broadcast.
    An int64 product of two uint32 values wraps, keeping the exact low 64 bits: its high
    word is (p >> 32) & 0xFFFFFFFF, its low word p & 0xFFFFFFFF."""
    shape = torch.broadcast_shapes(c0.shape, c1.shape, c2.shape, c3.shape)
    # Full-size copies, updated in place: each round is a dozen passes over the scores.
    c0, c1, c2, c3 = (c.expand(shape).clone(memory_format=torch.contiguous_format)
                      for c in (c0, c1, c2, c3))  # fmt: skip
    k0, k1 = seed & UINT32, (seed >> 32) & UINT32
    for _ in range(PHILOX_ROUNDS):
        product_b, product_a = c2.mul_(PHILOX_ROUND_B), c0.mul_(PHILOX_ROUND_A)
        c0 = (product_b >> 32).bitwise_and_(UINT32).bitwise_xor_(c1).bitwise_xor_(k0)
        c2 = (product_a >> 32).bitwise_and_(UINT32).bitwise_xor_(c3).bitwise_xor_(k1)
        c1, c3 = product_b.bitwise_and_(UINT32), product_a.bitwise_and_(UINT32)
        k0, k1 = (k0 + PHILOX_KEY_A) & UINT32, (k1 + PHILOX_KEY_B) & UINT32
    return c0


def uniform_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """fp32 in [0, 1) of uint32 bits (int64), as tl.uint_to_uniform_float: the bits read as
    int32, negatives folded onto -x - 1, times the scale in fp32."""
    folded = torch.where(bits > UINT32 >> 1, UINT32 - bits, bits)  # [0, 2^31 - 1]
    return folded.to(torch.float32) * torch.tensor(UNIFORM_SCALE, dtype=torch.float32)


def dropout_keep(seed: int, dropout_p: float, batches, heads, query_positions, key_positions):
    """bool: where the kernels' dropout keeps a probability (triton.common.dropout_scale): the
    uniform of Philox bits under seed with counter (key, query, head, batch) is at least p.
    The int64 index tensors broadcast to the scores' shape."""
    bits = philox(seed, key_positions, query_positions, heads, batches)
    return uniform_of_bits(bits) >= torch.tensor(dropout_p, dtype=torch.float32)


def layout_slices(layout: BlockLayout, heads_q: int):
    """For each layout index l, the (batch slice, query-head slice) it serves."""
    group_size = heads_q // layout.layout_heads
    for index in range(layout.num_layouts):
        layout_b, layout_h = divmod(index, layout.layout_heads)
        batches = slice(None) if layout.layout_batch == 1 else slice(layout_b, layout_b + 1)
        heads = slice(layout_h * group_size, (layout_h + 1) * group_size)
        yield index, batches, heads


def _global_positions(index: torch.Tensor, block: int, blocks: torch.Tensor | None):
    """Positions in the sequence of tensor rows `index`, in blocks of `block` rows: blocks[i]
    is the global block of local block i (a BlockPositions tensor), or None: rows are
    positions."""
    if blocks is None:
        return index
    return blocks.long()[index // block] * block + index % block


def _gather(t: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """t's slices `index` (int64, any shape) along dim. Its vjp, index_add_, adds in index order
    on the CPU; that of advanced indexing (index_put_ with accumulate) adds with atomics there
    once several threads share the work, which would make the backward irreproducible."""
    return t.index_select(dim, index.flatten()).unflatten(dim, index.shape)


def _row_attention(
    q, k, v, layout, index, rows, width, *, causal, window_size, scale, documents, dropout_p,
    dropout_seed, batch_ids, head_ids, positions, query_masks,
):  # fmt: skip
    """Attention of query blocks `rows` (int64 [R]) of layout `index`, each padded to `width`
    kv blocks.

    q [b, S_q, h, D]; k, v [b, S_kv, h, D] (already one kv head per query head);
    documents: int [b, S] document ids (keys of another document are not seen) or None;
    batch_ids [b], head_ids [h]: the batch elements and query heads of q (dropout counters);
    positions: the BlockPositions of q's blocks and k's slots, or None;
    query_masks: int64 [nnz] words of query-row bits aligned with layout.col_indices, or None.
    Returns out [b, R * q_block, h, D] and lse [b, h, R * q_block] (padded tail included).
    """
    offsets = layout.row_offsets[index].long()
    starts, counts = offsets[rows], offsets[rows + 1] - offsets[rows]  # [R]
    slot = torch.arange(width, device=q.device)
    active = slot[None, :] < counts[:, None]  # [R, m]
    entry = (starts[:, None] + slot[None, :]).clamp(max=max(layout.nnz - 1, 0))
    padded_cols = layout.col_indices if layout.nnz else layout.col_indices.new_zeros(1)
    cols = torch.where(active, padded_cols[entry].long(), 0)  # [R, m]

    # Rows of q and k, v (index) and the sequence positions masks see (pos): the same
    # without positions; with them, local query blocks and buffer slots map to global blocks.
    q_blocks = kv_blocks = None
    key_end = layout.seq_len_kv  # keys from here on are masked
    if positions is not None:
        q_blocks, kv_blocks, key_end = positions.q_blocks, positions.kv_blocks, positions.seq_len
    within_kv = torch.arange(layout.kv_block, device=q.device)
    k_index = (cols[:, :, None] * layout.kv_block + within_kv).flatten(1)  # [R, m * kv_block]
    k_pos = _global_positions(k_index, layout.kv_block, kv_blocks)  # [R, m * kv_block]
    k_ok = active.repeat_interleave(layout.kv_block, 1) & (k_pos < key_end)
    k_index, k_pos = k_index.clamp(max=layout.seq_len_kv - 1), k_pos.clamp(max=key_end - 1)
    q_index = rows[:, None] * layout.q_block + torch.arange(layout.q_block, device=q.device)
    q_index = q_index.clamp(max=layout.seq_len_q - 1)  # [R, q_block]; padded rows are cut later
    q_pos = _global_positions(q_index, layout.q_block, q_blocks)  # [R, q_block]

    accumulate = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for ground truth
    q_rows = _gather(q, 1, q_index).to(accumulate)  # [b, R, q_block, h, D]
    k_rows = _gather(k, 1, k_index).to(accumulate)  # [b, R, m * kv_block, h, D]
    v_rows = _gather(v, 1, k_index).to(accumulate)  # [b, R, m * kv_block, h, D]
    if positions is not None:  # a buffer's padding rows may hold anything, even NaN
        k_rows, v_rows = (torch.where(k_ok[:, :, None, None], t, 0) for t in (k_rows, v_rows))
    scores = torch.einsum("brihd,brjhd->bhrij", q_rows, k_rows) * scale
    keep = k_ok[:, None, :] & visible(q_pos[:, :, None], k_pos[:, None, :], causal, window_size)
    if query_masks is not None:  # bit r of a pair's word: row r of the q block reads it
        words = torch.where(active, query_masks[entry], 0)  # [R, m]
        within_q = torch.arange(layout.q_block, device=q.device)
        bits = (words[:, None, :] >> within_q[None, :, None]) & 1  # [R, q_block, m]
        keep = keep & bits.bool().repeat_interleave(layout.kv_block, 2)
    keep = keep[None]  # [1 or b, R, q_block, m * kv_block]
    if documents is not None:
        keep = keep & (documents[:, q_pos][..., None] == documents[:, k_pos][:, :, None, :])
    scores = scores.masked_fill(~keep[:, None], float("-inf"))  # [b, h, R, q_block, m * kv_block]
    lse = torch.logsumexp(scores, dim=-1)  # [b, h, R, q_block]
    finite_lse = torch.where(torch.isinf(lse), 0.0, lse)
    probs = torch.exp(scores - finite_lse[..., None])
    if dropout_p > 0:
        keep = dropout_keep(
            dropout_seed, dropout_p, batch_ids[:, None, None, None, None],
            head_ids[:, None, None, None], q_pos[:, :, None], k_pos[:, None, :],
        )  # fmt: skip  # [b, h, R, q_block, m * kv_block]
        probs = probs * keep / (1.0 - dropout_p)
    out = torch.einsum("bhrij,brjhd->brihd", probs, v_rows)
    return out.flatten(1, 2), lse.flatten(2).to(lse_dtype(q.dtype))


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BlockLayout,
    *,
    causal: bool,
    window_size: tuple[int, int],
    softmax_scale: float,
    document_ids: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    positions: BlockPositions | None = None,
    query_masks: QueryMasks | None = None,
    score_budget: int = SCORE_BUDGET,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, S_q, H_q, D] and lse [B, H_q, S_q] (fp32; fp64 for fp64 inputs) of validated
    inputs; differentiable
    by autograd. document_ids int [B, S] keeps attention within documents; positions (a
    BlockPositions) place q's blocks and k's slots in a longer sequence; query_masks (the
    CSR words are read) keep, in each active block, the query rows whose bit is set;
    score_budget: score elements computed at a time (whole query blocks, at least one)."""
    batch, seq_len_q, heads_q, _ = q.shape
    heads_kv = k.shape[2]
    if q.numel() == 0 or layout.nnz == 0:
        lse = torch.full(
            (batch, heads_q, seq_len_q), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device
        )
        return q.new_zeros(q.shape), lse
    head_ids = torch.arange(heads_q, device=q.device)
    kv_head_of = head_ids // (heads_q // heads_kv)
    batch_ids = torch.arange(batch, device=q.device)
    counts = layout.row_counts().view(layout.num_layouts, layout.num_q_blocks)
    widths = counts.max(dim=1).values.clamp(min=1).tolist()  # one read of the layout
    rows = torch.arange(layout.num_q_blocks, device=q.device)
    outs, lses = [], []  # per layout: [b, S_q, h, D], [b, h, S_q]; assembled without writes
    for index, batches, heads in layout_slices(layout, heads_q):
        q_part = q[batches, :, heads]
        kv_heads = kv_head_of[heads]
        k_part, v_part = (_gather(t[batches], 2, kv_heads) for t in (k, v))
        width = widths[index]
        per_row = q_part.shape[0] * q_part.shape[2] * layout.q_block * width * layout.kv_block
        documents = None if document_ids is None else document_ids[batches]
        pieces = [
            _row_attention(
                q_part, k_part, v_part, layout, index, part, width, causal=causal,
                window_size=window_size, scale=softmax_scale, documents=documents,
                dropout_p=dropout_p, dropout_seed=dropout_seed, batch_ids=batch_ids[batches],
                head_ids=head_ids[heads], positions=positions,
                query_masks=None if query_masks is None else query_masks.csr,
            )
            for part in rows.split(max(1, score_budget // per_row))
        ]  # fmt: skip
        outs.append(torch.cat([p[0] for p in pieces], 1)[:, :seq_len_q].to(q.dtype))
        lses.append(torch.cat([p[1] for p in pieces], 2)[..., :seq_len_q])
    heads = layout.layout_heads  # layout index = layout batch * layout_heads + layout head
    out = torch.cat(
        [torch.cat(outs[b * heads : (b + 1) * heads], 2) for b in range(layout.layout_batch)], 0
    )
    lse = torch.cat(
        [torch.cat(lses[b * heads : (b + 1) * heads], 1) for b in range(layout.layout_batch)], 0
    )
    return out, lse


def attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    layout: BlockLayout,
    **options,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv): the vector-Jacobian product of the recomputed forward (same dropout bits,
    same seed). torch.func rather than autograd: this runs inside the custom op, below
    autograd's dispatch.

    out and lse may be those of a softmax over more keys than this call's (a merge of calls
    over disjoint key sets, out = sum_i exp(lse_i - lse) out_i): the cotangents of this
    call's (out_i, lse_i) are then weight * grad_out and weight * <grad_out, out_i - out>,
    weight = exp(lse_i - lse), as the kernels' backward gets from the merged lse and delta.
    For this call's own out and lse the weight is 1 and the lse term 0."""

    def attention(q, k, v):
        return attention_forward(q, k, v, layout, **options)

    (part_out, part_lse), pullback = torch.func.vjp(attention, q, k, v)
    weight = torch.where(torch.isfinite(lse), torch.exp(part_lse - lse), 0.0)  # [B, H, S]
    weight_rows = weight.transpose(1, 2)[..., None].to(grad_out.dtype)  # [B, S, H, 1]
    wide = torch.promote_types(grad_out.dtype, torch.float32)
    spread = (grad_out.to(wide) * (part_out.to(wide) - out.to(wide))).sum(-1).transpose(1, 2)
    return pullback((grad_out * weight_rows, (weight * spread).to(part_lse.dtype)))


BACKEND = Backend(
    name="torch",
    forward=attention_forward,
    backward=attention_backward,
    speed={"cpu": 0, "cuda": 0},
    devices=("cpu", "cuda"),
    dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64),
    head_dims=lambda head_dim: head_dim >= 1,
    head_dims_text=">= 1",
    block_sizes=BLOCK_SIZES,
    q_block_sizes=LAYOUT_BLOCK_SIZES,
    deterministic=("cpu",),  # CUDA's index_add (the vjp of a gather) adds with atomics
)
