"""The "triton" backend: portable Triton kernels (Ampere and newer; the CPU under
TRITON_INTERPRET=1, for tests)."""

import torch

from flash_msa import _env
from flash_msa.layout import BLOCK_SIZES
from flash_msa.ops.registry import AttentionCall, Backend, Refusal
from flash_msa.ops.triton.backward import attention_backward
from flash_msa.ops.triton.backward_atomic import attention_backward_atomic
from flash_msa.ops.triton.forward import attention_forward

MAX_HEAD_DIM = 256
# Calls that allow a non-deterministic backward take the one-kernel backward with atomic dQ
# (backward_atomic.py) when this is set, the two-kernel one otherwise.
ATOMIC_BACKWARD = False


def _check(call: AttentionCall) -> Refusal | None:
    refusal = _env.triton_refusal(call.device, call.dtype)
    return None if refusal is None else Refusal(*refusal)


def _nondeterministic_backward(*tensors, **options):
    """The backward of calls without deterministic=True (see ATOMIC_BACKWARD)."""
    backward = attention_backward_atomic if ATOMIC_BACKWARD else attention_backward
    return backward(*tensors, **options)


BACKEND = Backend(
    name="triton",
    forward=attention_forward,
    backward=attention_backward,
    nondeterministic_backward=_nondeterministic_backward,
    speed={"cuda": 10},  # on the CPU the interpreter is for tests: by name only
    devices=("cuda", "cpu"),
    min_capability=None,
    dtypes=(torch.float16, torch.bfloat16, torch.float32),
    head_dims=lambda head_dim: 1 <= head_dim <= MAX_HEAD_DIM,  # padded to a power of two
    head_dims_text=f"up to {MAX_HEAD_DIM}",
    block_sizes=BLOCK_SIZES,
    check=_check,
)

__all__ = ["BACKEND", "attention_backward", "attention_backward_atomic", "attention_forward"]
