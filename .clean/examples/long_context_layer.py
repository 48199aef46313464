"""One attention layer's forward and backward at a million tokens and more, on one GPU.

    python examples/long_context_layer.py --seq-len 1048576 --pattern window
    python examples/long_context_layer.py --seq-len 2097152 --pattern topk --heads 32 --kv-heads 8

Reports the time, the peak memory against the bare tensors (q, k, v, out, lse, dout,
dq, dk, dv: the limit), and checks sampled query blocks against a float32 computation
over the same blocks.
"""

from __future__ import annotations

import argparse
import time

import torch

from flash_msa import block_sparse_attn_func, patterns
from flash_msa.layout import BlockLayout
from flash_msa.testing import sampled_rows_errors

HEAD_DIM, BLOCK = 128, 128


def build_layout(pattern: str, seq_len: int, device) -> BlockLayout:
    if pattern == "window":  # sliding window of 4096 tokens + 128 sink tokens
        return patterns.sliding_window(seq_len, 4096, device=device) | patterns.global_tokens(
            seq_len, 128, device=device
        )
    # up to 16 blocks per row: its own, the previous one and 14 random ones at or before it
    return patterns.random_blocks(seq_len, 14, device=device) | patterns.sliding_window(
        seq_len, BLOCK, device=device
    )


def bare_bytes(seq_len: int, heads_q: int, heads_kv: int) -> int:
    """q, out, dout, dq ([S, H_q, D]); k, v, dk, dv ([S, H_kv, D]); lse fp32 [H_q, S]."""
    element = 2  # bf16
    return seq_len * HEAD_DIM * element * (4 * heads_q + 4 * heads_kv) + 4 * heads_q * seq_len


def run(
    seq_len: int, heads_q: int, heads_kv: int, pattern: str, check_rows: int = 4, repeats: int = 3
) -> dict:
    """Forward + backward of one layer; returns the fastest of `repeats` timed passes (after
    one that compiles and autotunes), the peak memory and the sampled-row errors."""
    device = torch.device("cuda")
    layout = build_layout(pattern, seq_len, device)
    layout.transpose()  # built once with the layout, as a model would
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(heads):
        return torch.randn(1, seq_len, heads, HEAD_DIM, device=device, dtype=torch.bfloat16,
                           generator=generator)  # fmt: skip

    q, k, v = randn(heads_q).requires_grad_(), randn(heads_kv), randn(heads_kv)
    k.requires_grad_()
    v.requires_grad_()
    grad_out = randn(heads_q)
    forward_s = total_s = float("inf")
    for _ in range(1 + repeats):
        out = None  # the last pass's output is freed before the next one is measured
        for tensor in (q, k, v):
            tensor.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = block_sparse_attn_func(q, k, v, layout, causal=True)
        torch.cuda.synchronize()
        forward_s = min(forward_s, time.perf_counter() - start)
        out.backward(grad_out)
        torch.cuda.synchronize()
        total_s = min(total_s, time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated()
    out_error, dq_error = sampled_rows_errors(q, k, v, layout, out, q.grad, grad_out, check_rows)
    metadata = 4 * (layout.row_offsets.numel() + layout.col_indices.numel()) * 2  # CSR + CSC
    return dict(
        seq_len=seq_len,
        heads_q=heads_q,
        heads_kv=heads_kv,
        pattern=pattern,
        forward_ms=1e3 * forward_s,
        forward_backward_ms=1e3 * total_s,
        us_per_token=1e6 * total_s / seq_len,
        peak_gib=peak / 2**30,
        bare_gib=bare_bytes(seq_len, heads_q, heads_kv) / 2**30,
        metadata_mib=metadata / 2**20,
        out_error=out_error,
        dq_error=dq_error,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq-len", type=int, default=1 << 20)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--pattern", choices=["window", "topk"], default="window")
    args = parser.parse_args()
    result = run(args.seq_len, args.heads, args.kv_heads, args.pattern)
    print(
        f"{result['pattern']} S={result['seq_len']:,} H={result['heads_q']}/{result['heads_kv']}:"
        f" forward {result['forward_ms']:.1f} ms, forward+backward "
        f"{result['forward_backward_ms']:.1f} ms ({result['us_per_token']:.3f} us/token); peak "
        f"{result['peak_gib']:.2f} GiB vs bare tensors {result['bare_gib']:.2f} GiB "
        f"({result['peak_gib'] / result['bare_gib']:.3f}x), layout {result['metadata_mib']:.1f} "
        f"MiB; sampled rows: out error {result['out_error']:.2e}, dq error "
        f"{result['dq_error']:.2e}"
    )


if __name__ == "__main__":
    main()
