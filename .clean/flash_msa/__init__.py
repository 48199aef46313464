"""flash-msa: block-sparse attention kernels for million-token training."""

from flash_msa import patterns
from flash_msa.layout import BlockLayout, BlockPositions
from flash_msa.modules import FlashSparseAttention, MSAAttention
from flash_msa.msa import msa_checkpoint_context, msa_func
from flash_msa.ops.interface import block_sparse_attn_func, block_sparse_attn_varlen_func

__all__ = [
    "BlockLayout",
    "BlockPositions",
    "FlashSparseAttention",
    "MSAAttention",
    "block_sparse_attn_func",
    "block_sparse_attn_varlen_func",
    "msa_checkpoint_context",
    "msa_func",
    "patterns",
]
