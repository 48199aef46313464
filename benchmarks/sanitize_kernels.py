"""A small forward + backward of every kernel, for compute-sanitizer on one GPU:

    compute-sanitizer --tool memcheck python3 benchmarks/sanitize_kernels.py [--parts gluon]

attention: the Triton attention forward, dQ and dK/dV kernels (ragged lengths, GQA
packing, documents and dropout, TMA and pointer loads); msa: the MSA kernels (block
scores, the KL's rows and dk_proxy kernels); gluon (on an sm_90 GPU): the Gluon forward and
its backward in each dQ mode (ragged lengths, GQA, a window, documents; tiles of 128
queries and of 2 packed heads x 64 positions), and per-token MSA's Gluon selection and KL
rows kernel (with its TMA stores of the gradient tiles). The Triton attention kernels run
one explicit config each; msa_func's autotuned kernels try every config of their lists
under the tool.
"""

from __future__ import annotations

import argparse

import torch

from flash_msa import msa_func, patterns
from flash_msa.ops.triton import attention_backward, attention_forward, configs
from flash_msa.testing import random_qkv


def first_configs(block: int) -> dict:
    """The first config of each attention kernel's list at D = 64 on an H100 / H200."""
    launch = configs.Launch(64, 128, 2, True, 232_448)
    return dict(
        config=configs.forward_configs(launch, block)[0],
        dq_config=configs.dq_configs(launch, block)[0],
        dkdv_config=configs.dkdv_configs(launch._replace(block_m=64), block)[0],
    )


def attention(device: torch.device) -> None:
    seq_len, block = 300, 64  # ragged: not a multiple of the block
    window = patterns.sliding_window(seq_len, 96, block_size=block, device=device)
    layout = window | patterns.global_tokens(seq_len, 32, block_size=block, device=device)
    documents = (torch.arange(seq_len, device=device) // 128).int()[None].repeat(2, 1)
    options = dict(causal=True, window_size=(96, 0), softmax_scale=0.125, document_ids=documents,
                   dropout_p=0.1, dropout_seed=3)  # fmt: skip
    chosen = first_configs(block)
    for tma in (False, True):
        q, k, v = random_qkv(2, seq_len, 8, 64, heads_kv=2, dtype=torch.bfloat16, device=device)
        out, lse = attention_forward(q, k, v, layout, tma=tma, config=chosen["config"], **options)
        attention_backward(
            torch.randn_like(out), q, k, v, out, lse, layout, tma=tma, **options,
            dq_config=chosen["dq_config"], dkdv_config=chosen["dkdv_config"],
        )  # fmt: skip
        torch.cuda.synchronize()
        print(f"attention forward + backward, tma={tma}: done", flush=True)


def msa_step(device: torch.device, shapes: list[tuple[int, int]], **options) -> None:
    """msa_func forward + backward at 700 tokens (ragged) on (heads, head dim) shapes of
    q_proxy, k_proxy, q, k and v, top_k 4."""
    generator = torch.Generator(device=device).manual_seed(0)
    tensors = [torch.randn(1, 700, h, d, device=device, dtype=torch.bfloat16,
                           generator=generator).requires_grad_() for h, d in shapes]  # fmt: skip
    out, kl_loss = msa_func(*tensors, top_k=4, kv_block=128, **options)
    (out.float().square().mean() + kl_loss).backward()
    torch.cuda.synchronize()
    print(f"msa_func forward + backward {options}: done", flush=True)


def msa(device: torch.device) -> None:
    msa_step(device, [(2, 32), (1, 32), (8, 64), (2, 64), (2, 64)], q_block=64)


def gluon(device: torch.device) -> None:
    from flash_msa.ops.gluon import backward, forward

    seq_len = 300  # ragged: not a multiple of the block
    layout = patterns.sliding_window(seq_len, 256, device=device)
    layout = layout | patterns.global_tokens(seq_len, 128, device=device)
    documents = (torch.arange(seq_len, device=device) // 160).int()[None].repeat(2, 1)
    options = dict(causal=True, window_size=(200, 0), softmax_scale=0.125,
                   document_ids=documents)  # fmt: skip
    q, k, v = random_qkv(2, seq_len, 8, 64, heads_kv=2, dtype=torch.bfloat16, device=device)
    out, lse = forward.attention_forward(q, k, v, layout.row_offsets, layout.col_indices,
                                         **options)  # fmt: skip
    for grad_q in backward.GRAD_Q_MODES:
        backward.attention_backward(torch.randn_like(out), q, k, v, out, lse, layout,
                                    **options, grad_q=grad_q)  # fmt: skip
    torch.cuda.synchronize()
    print(f"gluon forward + backward ({', '.join(backward.GRAD_Q_MODES)}): done", flush=True)
    # Packed tiles: query blocks of 64 hold 2 query heads of a GQA group in 128 rows.
    packed = patterns.causal(seq_len, q_block=64, kv_block=128, device=device)
    out, lse = forward.attention_forward(q, k, v, packed.row_offsets, packed.col_indices,
                                         **options, q_block=64)  # fmt: skip
    for grad_q in ("triton", "atomic"):
        backward.attention_backward(torch.randn_like(out), q, k, v, out, lse, packed,
                                    **options, grad_q=grad_q)  # fmt: skip
    torch.cuda.synchronize()
    print("gluon forward + backward of packed 64-query blocks (triton, atomic): done", flush=True)
    # Per-token MSA with 8 query heads a proxy head: the Gluon selection and KL kernels.
    msa_step(device, [(2, 64), (1, 64), (16, 64), (2, 64), (2, 64)], granularity="token")


PARTS = {"attention": attention, "msa": msa, "gluon": gluon}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS))
    args = parser.parse_args()
    device = torch.device("cuda")
    for part in args.parts.split(","):
        if part == "gluon" and torch.cuda.get_device_capability(device) != (9, 0):
            print("gluon: skipped (needs an sm_90 GPU)", flush=True)
            continue
        PARTS[part](device)
