"""The running top-(top_k - 1) of the per-token selection kernels (token_selection.py in
Triton, token_selection_gluon.py in Gluon): per row, SLOTS slots of (score, block) in
registers, a block entering a row when its score beats the row's worst slot and replacing
that slot (the lowest score, of those the highest block index, as blocks arrive in
ascending order and ties go to the earlier one); then the kept blocks in ascending order.
Empty slots hold distinct negative blocks (-1 - slot), so a row's blocks are unique and
name the victim themselves.

These helpers build no tensor from a shape alone (the Gluon kernel's tensors carry layouts):
the callers pass the index and zero tiles in their own layouts.
"""

import triton
import triton.language as tl

_EMPTY: tl.constexpr = tl.constexpr(1 << 30)  # empty slots rank after every block


@triton.jit
def enter_block(slot_scores, slot_blocks, worst, score, block, slots, TOP_K: tl.constexpr):
    """Put kv block `block` into the rows whose worst slot its score [BLOCK_M] beats; returns
    the updated [BLOCK_M, SLOTS] scores and blocks and the rows' new worst scores. slots:
    [SLOTS], 0 .. SLOTS - 1."""
    # The victim: the highest block among the live slots at the worst score.
    SLOTS: tl.constexpr = slot_scores.shape[1]
    live = slots < TOP_K - 1  # [SLOTS]: slots of other blocks
    at_worst = live[None, :] & (slot_scores == worst[:, None])  # [BLOCK_M, SLOTS]
    victims = tl.max(tl.where(at_worst, slot_blocks, -SLOTS - 1), axis=1)  # [BLOCK_M]
    replace = (slot_blocks == victims[:, None]) & (score > worst)[:, None]  # [BLOCK_M, SLOTS]
    slot_scores = tl.where(replace, score[:, None], slot_scores)
    slot_blocks = tl.where(replace, block, slot_blocks)
    return slot_scores, slot_blocks, tl.min(slot_scores, axis=1)


@triton.jit
def empty_slots(slots, zeros, TOP_K: tl.constexpr):
    """The running top-k's start, tiles like `zeros` (fp32 [BLOCK_M, SLOTS] of zeros): scores
    -inf in the top_k - 1 slots of other blocks and +inf in the rest (never a victim), blocks
    -1 - slot, and the rows' worst scores."""
    live = slots < TOP_K - 1  # [SLOTS]
    slot_scores = tl.where(live[None, :], float("-inf"), float("inf")) + zeros
    slot_blocks = zeros.to(tl.int32) - 1 - slots[None, :]
    return slot_scores, slot_blocks, tl.min(slot_scores, axis=1)


@triton.jit
def ranked_blocks(slot_blocks, own_blocks, slots, TOP_K: tl.constexpr):
    """(blocks, columns) [BLOCK_M, SLOTS]: the slots' blocks with the own block in the first
    dead slot, and each slot's output column, its rank among the row's slots (empty ones,
    negative, ordered after every block by their position: all values of a row differ, so
    the ranks are a permutation and every column is written)."""
    SLOTS: tl.constexpr = slot_blocks.shape[1]
    blocks = tl.where((slots == TOP_K - 1)[None, :], own_blocks[:, None], slot_blocks)
    order = tl.where(blocks < 0, _EMPTY + slots[None, :], blocks)  # [BLOCK_M, SLOTS]
    columns = order * 0  # [BLOCK_M, SLOTS]
    for other in tl.static_range(SLOTS):  # one slot at a time: no [BLOCK_M, SLOTS, SLOTS]
        value = tl.sum(tl.where(slots[None, :] == other, order, 0), axis=1)  # [BLOCK_M]
        columns += (value[:, None] < order).to(tl.int32)
    return blocks, columns
