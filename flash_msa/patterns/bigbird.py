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
    device=None,
) -> BlockLayout:
    """Union of sliding_window(window), global_tokens(num_global) and num_random random
    blocks per row (Zaheer et al., 2020)."""
    common = dict(causal=causal, block_size=block_size, device=device)
    return (
        sliding_window(seq_len, window, **common)
        | global_tokens(seq_len, num_global, **common)
        | random_blocks(seq_len, num_random, seed=seed, **common)
    )
