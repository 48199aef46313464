"""Layout builders: each returns a BlockLayout, vectorised on the device, O(nnz) memory."""

from flash_msa.patterns.bigbird import bigbird
from flash_msa.patterns.causal import causal
from flash_msa.patterns.dilated import dilated
from flash_msa.patterns.documents import documents
from flash_msa.patterns.from_dense_mask import from_dense_mask
from flash_msa.patterns.global_tokens import global_tokens
from flash_msa.patterns.longformer import longformer
from flash_msa.patterns.random_blocks import random_blocks
from flash_msa.patterns.sliding_window import sliding_window
from flash_msa.patterns.stack import stack
from flash_msa.patterns.topk import topk

__all__ = [
    "bigbird",
    "causal",
    "dilated",
    "documents",
    "from_dense_mask",
    "global_tokens",
    "longformer",
    "random_blocks",
    "sliding_window",
    "stack",
    "topk",
]
