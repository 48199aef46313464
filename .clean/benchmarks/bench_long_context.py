"""The longest sequence one GPU holds for one layer's forward + backward, and time per token.

    python benchmarks/bench_long_context.py [--heads 16/16,32/8] [--out DIR]

bf16, D=128, block 128, causal sliding window 4096 + 128 sink tokens (common.window_layout).
For each head configuration: a ladder of lengths from 128K, then a bisection (to 64K tokens)
between the longest that fits and the first that runs out of memory. Each length reports
time per token, peak memory against the bare tensors (q, k, v, out, lse, dout, dq, dk, dv)
and the errors of sampled query blocks against float32. Writes DIR/long_context.json and .md
(DIR defaults to benchmarks/results/<gpu>/), keeping the records of head configurations this
run leaves out.
"""

from __future__ import annotations

import argparse
import operator
import time

import torch
from common import (
    HEAD_DIM,
    K,
    free_memory,
    kept_records,
    markdown_table,
    random_inputs,
    results_dir,
    run_metadata,
    window_layout,
    write_report,
)

from flash_msa import block_sparse_attn_func
from flash_msa.testing import sampled_rows_errors

STEP = 64 * K
LADDER = [128 * K, 256 * K, 512 * K, 1024 * K, 2048 * K, 3072 * K, 4096 * K, 5120 * K]


def bare_bytes(seq_len: int, heads_q: int, heads_kv: int) -> int:
    """q, out, dout, dq ([S, H_q, D]); k, v, dk, dv ([S, H_kv, D]) in bf16; lse fp32 [H_q, S]."""
    return seq_len * HEAD_DIM * 2 * (4 * heads_q + 4 * heads_kv) + 4 * heads_q * seq_len


def run_layer(seq_len: int, heads_q: int, heads_kv: int, check_rows: int = 2, repeats: int = 3):
    """Forward + backward of one layer: the fastest of `repeats` timed passes (after one that
    compiles and autotunes), the peak memory of a pass and the sampled-row errors."""
    device = torch.device("cuda")
    layout = window_layout(seq_len, device)
    layout.transpose()  # built once with the layout, as a model would
    q, k, v, dout = random_inputs(seq_len, heads_q, heads_kv, device)
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
        out.backward(dout)
        torch.cuda.synchronize()
        total_s = min(total_s, time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated()
    out_error, dq_error = sampled_rows_errors(q, k, v, layout, out, q.grad, dout, check_rows)
    metadata = 4 * (layout.row_offsets.numel() + layout.col_indices.numel()) * 2  # CSR + CSC
    return dict(
        seq_len=seq_len,
        heads_q=heads_q,
        heads_kv=heads_kv,
        pattern="window",
        forward_ms=1e3 * forward_s,
        forward_backward_ms=1e3 * total_s,
        us_per_token=1e6 * total_s / seq_len,
        peak_gib=peak / 2**30,
        bare_gib=bare_bytes(seq_len, heads_q, heads_kv) / 2**30,
        metadata_mib=metadata / 2**20,
        out_error=out_error,
        dq_error=dq_error,
    )


def attempt(seq_len: int, heads_q: int, heads_kv: int) -> dict | None:
    """One layer at seq_len, or None when it runs out of memory."""
    free_memory()
    try:
        result = run_layer(seq_len, heads_q, heads_kv)
    except torch.OutOfMemoryError:
        result = None
    free_memory()
    status = "out of memory"
    if result is not None:
        status = (
            f"{result['us_per_token']:.4f} us/token, peak {result['peak_gib']:.2f} GiB = "
            f"{result['peak_gib'] / result['bare_gib']:.4f}x bare, errors "
            f"{result['out_error']:.1e} / {result['dq_error']:.1e}"
        )
    print(f"H={heads_q}/{heads_kv} S={seq_len:,}: {status}", flush=True)
    return result


def longest(heads_q: int, heads_kv: int) -> list[dict]:
    """Every length tried that fits, ladder first, then bisection at STEP granularity."""
    fits, too_long = [], None
    for seq_len in LADDER:
        result = attempt(seq_len, heads_q, heads_kv)
        if result is None:
            too_long = seq_len
            break
        fits.append(result)
    while too_long is not None and too_long - fits[-1]["seq_len"] > STEP:
        middle = (fits[-1]["seq_len"] + too_long) // 2 // STEP * STEP
        result = attempt(middle, heads_q, heads_kv)
        if result is None:
            too_long = middle
        else:
            fits.append(result)
    return sorted(fits, key=operator.itemgetter("seq_len"))


def row_cells(record: dict, base: dict) -> list[str]:
    """One length's cells; base: the shortest length of the same head configuration."""
    return [
        f"{record['heads_q']}/{record['heads_kv']}",
        f"{record['seq_len']:,}",
        f"{record['forward_ms']:.1f}",
        f"{record['forward_backward_ms']:.1f}",
        f"{record['us_per_token']:.4f}",
        f"{record['us_per_token'] / base['us_per_token']:.3f}",
        f"{record['peak_gib']:.2f}",
        f"{record['bare_gib']:.2f}",
        f"{record['peak_gib'] / record['bare_gib']:.4f}",
        f"{record['metadata_mib']:.2f}",
        f"{record['out_error']:.1e}",
        f"{record['dq_error']:.1e}",
    ]


def write_reports(records: list[dict], meta: dict, out_dir) -> None:
    heads = operator.itemgetter("heads_q", "heads_kv")
    shortest = {}
    for record in records:  # sorted by heads, then length
        shortest.setdefault(heads(record), record)
    rows = [(record, row_cells(record, shortest[heads(record)])) for record in records]
    columns = ["H_q/H_kv", "tokens", "fwd ms", "fwd+bwd ms", "us/token", "vs 128K", "peak GiB"]
    columns += ["bare GiB", "peak/bare", "layout MiB", "out err", "dq err"]
    write_report(
        out_dir,
        "long_context",
        records,
        meta=meta,
        title="One layer's forward + backward at long context, one GPU",
        notes=f"{meta['memory_gib']:.1f} GiB. bf16, B=1, D=128, block 128, causal sliding "
        "window 4096 + 128 sink tokens. Fastest of 3 passes. Bare: q, k, v, out, lse, dout, "
        "dq, dk, dv. Errors: sampled query blocks against float32.",
        body=markdown_table(columns, rows),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--heads", default="16/16,32/8", help="H_q/H_kv pairs, comma separated")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    meta = run_metadata(device)
    out_dir = results_dir(args.out, device)
    pairs = [tuple(int(h) for h in pair.split("/")) for pair in args.heads.split(",")]
    key = operator.itemgetter("heads_q", "heads_kv")
    records = kept_records(out_dir / "long_context.json", key, pairs)
    for heads_q, heads_kv in pairs:
        records += [{**record, **meta} for record in longest(heads_q, heads_kv)]
        records.sort(key=operator.itemgetter("heads_q", "heads_kv", "seq_len"))
        write_reports(records, meta, out_dir)  # partial results survive a timeout
    print(f"wrote {out_dir}/long_context.json and long_context.md")


if __name__ == "__main__":
    main()
