"""The per-query-block selection at long lengths: block scores (every causal proxy pair, a
max per block pair) and the top-k of each row, timed apart.

    python3 benchmarks/bench_block_selection.py [--seq-lens 128k,1m] [--proxy-dims 64,128]
        [--tile-rows 128,256] [--out DIR]

Random bf16 proxies, H_p 4 sharing one key head (H_pk 1), q_block 64, kv_block 128, top_k
16: train_million's selection at proxy head dim 64, bench_msa's at 128. Tile rows: query
rows (positions x proxy heads sharing a key head) of one block-scores program
(block_scores.MAX_TILE_ROWS, set per run; 256 packs the four heads of a query block).
TFLOP/s count the causal pairs' proxy products, 2 * S^2 / 2 * H_p * D_p.

Writes DIR/block_selection.json and .md (DIR defaults to benchmarks/results/<gpu>/).
"""

from __future__ import annotations

import argparse
import importlib

import torch
from common import markdown_table, parse_length, results_dir, run_metadata, timed, write_report

from flash_msa import patterns
from flash_msa.msa import block_scores

# The module, whose name the package's function shadows as an attribute.
block_scores_module = importlib.import_module("flash_msa.msa.block_scores")

HEADS_PROXY, HEADS_PROXY_KEYS, Q_BLOCK, KV_BLOCK, TOP_K = 4, 1, 64, 128, 16


def run_case(seq_len: int, proxy_dim: int, tile_rows: int, device) -> dict:
    block_scores_module.MAX_TILE_ROWS = tile_rows
    generator = torch.Generator(device=device).manual_seed(0)
    q_proxy, k_proxy = (
        torch.randn(1, seq_len, heads, proxy_dim, generator=generator, device=device,
                    dtype=torch.bfloat16)
        for heads in (HEADS_PROXY, HEADS_PROXY_KEYS)
    )  # fmt: skip
    blocks = dict(q_block=Q_BLOCK, kv_block=KV_BLOCK)
    scores = block_scores(q_proxy, k_proxy, **blocks)

    def score():
        block_scores(q_proxy, k_proxy, out=scores, **blocks)

    def rank():
        patterns.topk(scores, TOP_K, seq_len_q=seq_len, fixed_counts=True, **blocks)

    record = dict(seq_len=seq_len, proxy_dim=proxy_dim, tile_rows=tile_rows)
    record.update(scores_ms=round(timed(score)["ms"], 3), topk_ms=round(timed(rank)["ms"], 3))
    flops = seq_len * seq_len * HEADS_PROXY * proxy_dim  # 2 * S^2 / 2 * H_p * D_p
    record["scores_tflops"] = round(flops / record["scores_ms"] / 1e9, 1)
    print(record, flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="128k,1m")
    parser.add_argument("--proxy-dims", default="64,128")
    parser.add_argument("--tile-rows", default="128,256")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    records = [
        run_case(parse_length(length), int(dim), int(rows), device)
        for length in args.seq_lens.split(",")
        for dim in args.proxy_dims.split(",")
        for rows in args.tile_rows.split(",")
    ]
    meta = run_metadata(device)
    records = [dict(record, **meta) for record in records]
    columns = ["S", "D_p", "tile rows", "block scores ms (TFLOP/s)", "top-k ms"]
    rows = [
        (r, [f"{r['seq_len']:,}", r["proxy_dim"], r["tile_rows"],
             f"{r['scores_ms']} ({r['scores_tflops']})", r["topk_ms"]])
        for r in records
    ]  # fmt: skip
    write_report(
        results_dir(args.out, device), "block_selection", records,
        meta=meta, title="Per-query-block selection: block scores and top-k",
        notes=__doc__.split("\n\n")[2].replace("\n", " "), body=markdown_table(columns, rows),
    )  # fmt: skip


if __name__ == "__main__":
    main()
