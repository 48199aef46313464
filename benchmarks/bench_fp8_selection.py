"""Per-token selection with FP8 scores against the proxies' own bf16: time and agreement.

    python3 benchmarks/bench_fp8_selection.py [--seq-lens 128k,1m] [--out DIR]

bench_msa's proxies (H_p 4, H_pk 1, D_p 128, top_k 16, kv_block 128), "random" and "local".
select_tokens is timed in bf16 and with score_dtype float8_e4m3fn (its quantization of the
proxies included, and timed alone); agreement is the share of the bf16 selection's
(token, proxy head, block) choices the FP8 selection also makes.

Writes DIR/fp8_selection.json and .md (DIR defaults to benchmarks/results/<gpu>/).
"""

from __future__ import annotations

import argparse

import bench_msa
import torch
from common import (
    markdown_table,
    parse_length,
    results_dir,
    run_metadata,
    selection_agreement,
    timed,
    write_report,
)

from flash_msa.msa import select_tokens
from flash_msa.msa.fp8 import FP8, quantize_proxies


def run_case(seq_len: int, proxies: str, device) -> dict:
    if proxies == "local":
        q_proxy, k_proxy = (t.bfloat16() for t in bench_msa.local_proxies(seq_len, device))
    else:
        generator = torch.Generator(device=device).manual_seed(0)
        shape = (1, seq_len, bench_msa.HEADS_PROXY, bench_msa.PROXY_HEAD_DIM)
        q_proxy = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)
        k_proxy = torch.randn((*shape[:2], bench_msa.HEADS_PROXY_KEYS, shape[3]),
                              generator=generator, device=device, dtype=torch.bfloat16)  # fmt: skip
    options = dict(top_k=bench_msa.TOP_K, kv_block=bench_msa.KV_BLOCK)
    bf16 = select_tokens(q_proxy, k_proxy, **options)
    fp8 = select_tokens(q_proxy, k_proxy, score_dtype=FP8, **options)
    times = dict(
        bf16_ms=lambda: select_tokens(q_proxy, k_proxy, **options),
        fp8_ms=lambda: select_tokens(q_proxy, k_proxy, score_dtype=FP8, **options),
        quantize_ms=lambda: quantize_proxies(q_proxy, k_proxy, bench_msa.KV_BLOCK),
    )
    record = dict(seq_len=seq_len, proxies=proxies)
    record.update({name: round(timed(step)["ms"], 3) for name, step in times.items()})
    record["agreement"] = round(selection_agreement(bf16, fp8), 5)
    record["speed_up"] = round(record["bf16_ms"] / record["fp8_ms"], 2)
    print(record, flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="128k,1m")
    parser.add_argument("--proxies", default=",".join(bench_msa.PROXIES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    records = [
        run_case(parse_length(length), proxies, device)
        for length in args.seq_lens.split(",")
        for proxies in args.proxies.split(",")
    ]
    meta = run_metadata(device)
    records = [dict(record, **meta) for record in records]
    columns = ["S", "proxies", "bf16 ms", "FP8 ms (quantize ms)", "speed-up", "agreement"]
    rows = [
        (r, [f"{r['seq_len']:,}", r["proxies"], r["bf16_ms"],
             f"{r['fp8_ms']} ({r['quantize_ms']})", f"{r['speed_up']}x",
             f"{100 * r['agreement']:.2f}%"])
        for r in records
    ]  # fmt: skip
    write_report(
        results_dir(args.out, device), "fp8_selection", records,
        meta=meta, title="Per-token selection: FP8 scores against bf16",
        notes=__doc__.split("\n\n")[2].replace("\n", " "), body=markdown_table(columns, rows),
    )  # fmt: skip


if __name__ == "__main__":
    main()
