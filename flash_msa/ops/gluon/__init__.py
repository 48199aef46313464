"""Hopper (sm_90) kernels in Gluon: a warp-specialised block-sparse attention forward over
full 128 x 128 blocks (forward.py). Not a registered backend: it takes raw CSR tensors and
refuses what it does not handle."""

from flash_msa.ops.gluon.forward import attention_forward

__all__ = ["attention_forward"]
