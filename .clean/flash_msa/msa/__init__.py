"""MiniMax Sparse Attention: learned block selection (per token or per query block) trained
by a KL loss."""

from flash_msa.msa.block_scores import block_scores
from flash_msa.msa.checkpointing import msa_checkpoint_context
from flash_msa.msa.interface import MsaSelection, msa_func
from flash_msa.msa.kl import proxy_kl_loss
from flash_msa.msa.reference import (
    block_scores_reference,
    msa_reference,
    select_blocks_reference,
    select_tokens_reference,
)
from flash_msa.msa.token_selection import select_tokens, token_selection_layout

__all__ = [
    "MsaSelection",
    "block_scores",
    "block_scores_reference",
    "msa_checkpoint_context",
    "msa_func",
    "msa_reference",
    "proxy_kl_loss",
    "select_blocks_reference",
    "select_tokens",
    "select_tokens_reference",
    "token_selection_layout",
]
