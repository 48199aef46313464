"""TMA (tensor-descriptor) loads against pointer loads, same process, same inputs, on one GPU.

    python benchmarks/experiments/tma_ab.py causal-32k,window-1m,msa-128k

Cases are bench_attention.py's, plus msa-128k (an MSA selection: q_block 64, so GQA-packed
query tiles and TMA for K/V only). Prints fwd and fwd+bwd ms per path, the speed-up of TMA,
and the relative difference of out, dq, dk, dv between the paths.
"""

from __future__ import annotations

import pathlib
import sys

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from bench_attention import CASES, random_inputs  # noqa: E402

from flash_msa import block_sparse_attn_func  # noqa: E402
from flash_msa.msa import block_scores, select_blocks  # noqa: E402
from flash_msa.ops.triton import backward, forward  # noqa: E402

USE_TMA = forward.use_tma


def set_loads(tma: bool) -> None:
    choice = USE_TMA if tma else (lambda *tensors: False)
    forward.use_tma = backward.use_tma = choice


def msa_case(seq_len: int):
    q, k, v, dout = random_inputs(seq_len, 64, 4, "cuda")
    proxy_q = torch.randn(1, seq_len, 4, 128, device="cuda", dtype=torch.bfloat16)
    proxy_k = torch.randn(1, seq_len, 1, 128, device="cuda", dtype=torch.bfloat16)
    scores = block_scores(proxy_q, proxy_k, q_block=64, kv_block=128)
    layout = select_blocks(scores, 16, seq_len=seq_len, q_block=64, kv_block=128)
    return layout, (q, k, v, dout), 64


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def run(name: str) -> None:
    if name == "msa-128k":
        layout, (q, k, v, dout), heads_q = msa_case(128 * 1024)
    else:
        seq_len, heads_q, heads_kv, build, _ = CASES[name]
        layout, (q, k, v, dout) = (
            build(seq_len, "cuda"),
            random_inputs(seq_len, heads_q, heads_kv, "cuda"),
        )

    def attention():
        return block_sparse_attn_func(q, k, v, layout, causal=True)

    def step():
        attention().backward(dout)

    results = {}
    for tma in (False, True):
        set_loads(tma)
        for tensor in (q, k, v):
            tensor.grad = None
        out = attention()
        out.backward(dout)
        values = [out.detach(), *(tensor.grad.clone() for tensor in (q, k, v))]
        fwd = triton.testing.do_bench(attention, warmup=50, rep=300, return_mode="median")
        both = triton.testing.do_bench(
            step, warmup=50, rep=300, grad_to_none=[q, k, v], return_mode="median"
        )
        results[tma] = (values, fwd, both)
        print(f"{name} tma={tma} fwd {fwd:.3f} ms fwd+bwd {both:.3f} ms", flush=True)
    (pointer_values, pointer_fwd, pointer_both), (tma_values, tma_fwd, tma_both) = (
        results[False],
        results[True],
    )
    differences = [relative(a, b) for a, b in zip(tma_values, pointer_values, strict=True)]
    tflops = layout.flops(128) * heads_q / tma_fwd / 1e9
    print(
        f"{name}: TMA speed-up fwd {pointer_fwd / tma_fwd:.3f}x, fwd+bwd "
        f"{pointer_both / tma_both:.3f}x; TMA fwd {tflops:.0f} TFLOP/s; difference out/dq/dk/dv "
        + " ".join(f"{d:.1e}" for d in differences),
        flush=True,
    )
    set_loads(True)


if __name__ == "__main__":
    for case in sys.argv[1].split(","):
        run(case)
        torch.cuda.empty_cache()
