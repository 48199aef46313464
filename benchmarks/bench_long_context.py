"""The longest sequence one GPU holds for one layer's forward + backward, and time per token.

    python benchmarks/bench_long_context.py [--heads 16/16,32/8] [--out DIR]

bf16, D=128, block 128, causal sliding window 4096 + 128 sink tokens (examples/
long_context_layer.py). For each head configuration: a ladder of lengths from 128K, then a
bisection (to 64K tokens) between the longest that fits and the first that runs out of
memory. Each length reports time per token, peak memory against the bare tensors (q, k, v,
out, lse, dout, dq, dk, dv) and sampled-row errors. Writes DIR/long_context.json and .md.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import runpy

import torch
from gpu_run import results_dir, run_metadata

K = 1024
STEP = 64 * K
LADDER = [128 * K, 256 * K, 512 * K, 1024 * K, 2048 * K, 3072 * K, 4096 * K, 5120 * K]
EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "long_context_layer.py"


def attempt(run, seq_len: int, heads_q: int, heads_kv: int) -> dict | None:
    """One layer at seq_len, or None when it runs out of memory."""
    gc.collect()
    torch.cuda.empty_cache()
    try:
        result = run(seq_len, heads_q, heads_kv, "window", check_rows=2)
    except torch.OutOfMemoryError:
        result = None
    gc.collect()
    torch.cuda.empty_cache()
    status = "out of memory" if result is None else (
        f"{result['us_per_token']:.4f} us/token, peak {result['peak_gib']:.2f} GiB = "
        f"{result['peak_gib'] / result['bare_gib']:.4f}x bare, errors "
        f"{result['out_error']:.1e} / {result['dq_error']:.1e}"
    )  # fmt: skip
    print(f"H={heads_q}/{heads_kv} S={seq_len:,}: {status}", flush=True)
    return result


def longest(run, heads_q: int, heads_kv: int) -> list[dict]:
    """Every length tried that fits, ladder first, then bisection at STEP granularity."""
    fits, too_long = [], None
    for seq_len in LADDER:
        result = attempt(run, seq_len, heads_q, heads_kv)
        if result is None:
            too_long = seq_len
            break
        fits.append(result)
    while too_long is not None and too_long - fits[-1]["seq_len"] > STEP:
        middle = (fits[-1]["seq_len"] + too_long) // 2 // STEP * STEP
        result = attempt(run, middle, heads_q, heads_kv)
        if result is None:
            too_long = middle
        else:
            fits.append(result)
    return fits


def write_reports(results: list[dict], meta: dict, out_dir: pathlib.Path) -> None:
    (out_dir / "long_context.json").write_text(
        json.dumps([{**result, **meta} for result in results], indent=1)
    )
    lines = [
        "# One layer's forward + backward at long context, one GPU",
        "",
        f"{meta['device']} ({meta['memory_gib']:.1f} GiB); torch {meta['torch']}, triton "
        f"{meta['triton']}; {meta['date']}. bf16, B=1, D=128, block 128, causal sliding window "
        "4096 + 128 sink tokens. Bare: q, k, v, out, lse, dout, dq, dk, dv.",
        "",
        "| H_q/H_kv | tokens | fwd ms | fwd+bwd ms | us/token | vs 128K | peak GiB | bare GiB | "
        "peak/bare | layout MiB | out err | dq err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        base = next(b for b in results if (b["heads_q"], b["heads_kv"]) == (r["heads_q"],
                    r["heads_kv"]))  # fmt: skip
        lines.append(
            f"| {r['heads_q']}/{r['heads_kv']} | {r['seq_len']:,} | {r['forward_ms']:.1f} | "
            f"{r['forward_backward_ms']:.1f} | {r['us_per_token']:.4f} | "
            f"{r['us_per_token'] / base['us_per_token']:.3f} | {r['peak_gib']:.2f} | "
            f"{r['bare_gib']:.2f} | {r['peak_gib'] / r['bare_gib']:.4f} | "
            f"{r['metadata_mib']:.2f} | {r['out_error']:.1e} | {r['dq_error']:.1e} |"
        )
    (out_dir / "long_context.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--heads", default="16/16,32/8", help="H_q/H_kv pairs, comma separated")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    meta = run_metadata(device)
    out_dir = results_dir(args.out, meta)
    run, results = runpy.run_path(str(EXAMPLE))["run"], []
    for pair in args.heads.split(","):
        heads_q, heads_kv = (int(h) for h in pair.split("/"))
        results += sorted(longest(run, heads_q, heads_kv), key=lambda r: r["seq_len"])
        write_reports(results, meta, out_dir)
    print(f"wrote {out_dir}/long_context.json and long_context.md")


if __name__ == "__main__":
    main()
