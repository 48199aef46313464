"""Triton kernels of block-sparse attention (GPU, or CPU under TRITON_INTERPRET=1)."""

from flash_msa.ops.triton.backward import attention_backward
from flash_msa.ops.triton.forward import attention_forward

__all__ = ["attention_backward", "attention_forward"]
