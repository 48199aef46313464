"""MiniMax Sparse Attention (issue 4): learned block selection trained by a KL loss."""

from flash_msa.msa.block_scores import block_scores
from flash_msa.msa.reference import block_scores_reference, msa_reference, select_blocks_reference
from flash_msa.msa.selection import select_blocks

__all__ = [
    "block_scores",
    "block_scores_reference",
    "msa_reference",
    "select_blocks",
    "select_blocks_reference",
]
