"""flash-msa: block-sparse attention kernels for million-token training."""

from flash_msa import patterns
from flash_msa.layout import BlockLayout

__all__ = ["BlockLayout", "patterns"]
