"""The block-sparse attention op: interface (validation), registry (backends), custom op."""

from flash_msa.ops import gluon, registry, torch_ref
from flash_msa.ops import triton as triton_backend

registry.register(torch_ref.BACKEND)
registry.register(triton_backend.BACKEND)
registry.register(gluon.BACKEND)
