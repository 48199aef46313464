"""The "triton" backend: portable Triton kernels (Ampere and newer; the CPU under
TRITON_INTERPRET=1, for tests)."""

import math

import torch

from flash_msa import _env
from flash_msa.layout import BLOCK_SIZES, LAYOUT_BLOCK_SIZES
from flash_msa.ops.registry import AttentionCall, Backend, Refusal
from flash_msa.ops.triton.backward import attention_backward
from flash_msa.ops.triton.configs import largest_power_of_two_dividing
from flash_msa.ops.triton.forward import attention_forward

MAX_HEAD_DIM = 256
MIN_TILE_ROWS = 16  # tl.dot's smallest M


def _check(call: AttentionCall) -> Refusal | None:
    refusal = _env.triton_refusal(call.device, call.dtype)
    if refusal is not None:
        return Refusal(*refusal)
    # A query block smaller than MIN_TILE_ROWS (1: a row per token) fills its tiles with the
    # query heads that share its layout row and kv head.
    shared = math.gcd(call.heads_q // call.heads_kv, call.heads_q // call.layout_heads)
    packed = largest_power_of_two_dividing(shared)
    if call.q_block * packed < MIN_TILE_ROWS:
        return Refusal(
            f"triton needs q_block x packed query heads >= {MIN_TILE_ROWS} rows per tile; "
            f"q_block {call.q_block} packs {packed} heads (those sharing a kv head and a "
            "layout row): use a larger q_block"
        )
    return None


BACKEND = Backend(
    name="triton",
    forward=attention_forward,
    backward=attention_backward,
    speed={"cuda": 10},  # on the CPU the interpreter is for tests: by name only
    devices=("cuda", "cpu"),
    dtypes=(torch.float16, torch.bfloat16, torch.float32),
    head_dims=lambda head_dim: 1 <= head_dim <= MAX_HEAD_DIM,  # padded to a power of two
    head_dims_text=f"up to {MAX_HEAD_DIM}",
    block_sizes=BLOCK_SIZES,
    q_block_sizes=LAYOUT_BLOCK_SIZES,
    check=_check,
)

__all__ = ["BACKEND", "attention_backward", "attention_forward"]
