"""BigBird: sliding window + global tokens + random blocks."""

from __future__ import annotations

from flash_msa.layout import BlockLayout
from flash_msa.patterns.global_tokens import global_tokens
from flash_msa.patterns.random_blocks import random_blocks
from flash_msa.patterns.sliding_window import sliding_window


def bigbird(
    seq_len: int,
    window: int,
    num_global: int,
    num_random: int,
    *,
    seed: int = 0,
    causal: bool = False,
    block_size: int = 128,
    q_block: int | None = None,
    kv_block: int | None = None,
    device=None,
) -> BlockLayout:
    """Union of sliding_window(window), global_tokens(num_global) and num_random random
    blocks per row (Zaheer et al., 2020).

    Args:
        seq_len: tokens of queries and keys.
        window, num_global: tokens, as in sliding_window and global_tokens.
        num_random: random blocks per row (capped at the row's candidates, see random_blocks).
        block_size: q_block and kv_block when they are not given.

    Returns:
        A single-head BlockLayout.
    """
    common = dict(
        causal=causal, block_size=block_size, q_block=q_block, kv_block=kv_block, device=device
    )
    return (
        sliding_window(seq_len, window, **common)
        | global_tokens(seq_len, num_global, **common)
        | random_blocks(seq_len, num_random, seed=seed, **common)
    )
