"""Time every layout builder at 1M tokens (block 128) and report its metadata size.

    python benchmarks/bench_layouts.py [--device cuda] [--seq-len 1048576] [--out DIR]

Writes DIR/layouts.json and DIR/layouts.md (DIR defaults to benchmarks/results/<gpu>/, or
benchmarks/results/cpu/ on the CPU).
"""

from __future__ import annotations

import argparse
import functools

import torch
from common import markdown_table, results_dir, run_metadata, wall_ms, write_report

from flash_msa import patterns

TARGET_MS = {"cpu": 1000.0, "cuda": 10.0}


def builders(seq_len: int, device: torch.device) -> dict:
    """name -> zero-argument callable building a layout; inputs are made beforehand."""
    blocks = seq_len // 128
    generator = torch.Generator(device=device).manual_seed(0)
    scores = torch.rand(blocks, blocks, device=device, generator=generator)
    dense_mask = scores < 16 / blocks
    window = patterns.sliding_window(seq_len, 4096, device=device)
    common = dict(device=device)
    return {
        "causal": functools.partial(patterns.causal, seq_len, **common),
        "sliding_window(4096)": functools.partial(patterns.sliding_window, seq_len, 4096, **common),
        "global_tokens(128)": functools.partial(patterns.global_tokens, seq_len, 128, **common),
        "dilated(16384, 4)": functools.partial(patterns.dilated, seq_len, 16384, 4, **common),
        "random_blocks(16)": functools.partial(patterns.random_blocks, seq_len, 16, **common),
        "bigbird(4096, 128, 4)": functools.partial(
            patterns.bigbird, seq_len, 4096, 128, 4, **common
        ),
        "longformer(4096, 128)": functools.partial(
            patterns.longformer, seq_len, 4096, 128, **common
        ),
        "window 4096 + sinks 128, causal": lambda: (
            patterns.sliding_window(seq_len, 4096, **common)
            | patterns.global_tokens(seq_len, 128, **common)
        ),
        "from_dense_mask": functools.partial(
            patterns.from_dense_mask, dense_mask, seq_len_q=seq_len
        ),
        "topk(16)": functools.partial(patterns.topk, scores, 16, seq_len_q=seq_len),
        "stack(16 x window)": lambda: patterns.stack([window] * 16),
        "transpose(window)": lambda: patterns.sliding_window(seq_len, 4096, **common).transpose(),
    }


def write_reports(records: list[dict], meta: dict, out_dir) -> None:
    rows = [
        (
            r,
            [
                r["builder"],
                f"{r['ms']:.2f}",
                f"{r['nnz']:,}",
                f"{r['metadata_mib']:.2f}",
                "yes" if r["ms"] < r["target_ms"] else "no",
            ],
        )
        for r in records
    ]
    target = records[0]["target_ms"]
    write_report(
        out_dir,
        "layouts",
        records,
        meta=meta,
        title=f"Layout builders at {records[0]['seq_len']:,} tokens, block 128",
        notes=f"Median synchronised wall time of {records[0]['repeats']} builds after one. "
        f"Target: each under {target:g} ms.",
        body=markdown_table(["builder", "ms", "nnz", "metadata MiB", "under target"], rows),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-len", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
    meta = run_metadata(device)
    records = []
    for name, build in builders(args.seq_len, device).items():
        ms, layout = wall_ms(build, device, repeats)
        metadata = layout.row_offsets.numel() * 4 + layout.col_indices.numel() * 4
        record = dict(
            builder=name,
            seq_len=args.seq_len,
            block=128,
            ms=round(ms, 3),
            nnz=layout.nnz,
            layout_heads=layout.layout_heads,
            metadata_mib=round(metadata / 2**20, 3),
            target_ms=TARGET_MS[device.type],
            repeats=repeats,
        )
        records.append({**record, **meta})
        print(f"{name:34s} {ms:10.2f} ms  nnz {layout.nnz:>11,}  {metadata / 2**20:9.2f} MiB")
    out_dir = results_dir(args.out, device)
    write_reports(records, meta, out_dir)
    print(f"wrote {out_dir}/layouts.json and layouts.md")


if __name__ == "__main__":
    main()
