"""The per-query-block selection at long lengths: block scores (every causal proxy pair, a
max per block pair) and the top-k of each row, timed apart.

    python3 benchmarks/bench_block_selection.py [--seq-lens 128k,1m] [--proxy-dims 64,128]
        [--scores bf16,fp8] [--kernels gluon,triton] [--tile-rows 128] [--out DIR]

Random bf16 proxies, H_p 4 sharing one key head (H_pk 1), q_block 64, kv_block 128, top_k
16: train_million's selection at proxy head dim 64, bench_msa's at 128. Scores: the
proxies' bf16 products or FP8 ones (score_dtype float8_e4m3fn, the proxies' quantization
included); agreement is the share of the bf16 selection's (query block, proxy head, kv
block) choices the FP8 selection also makes. Tile rows: query rows (positions x proxy heads
sharing a key head) of one block-scores program (block_scores.MAX_TILE_ROWS, set per run;
256 packs the four heads of a query block). Kernel: gluon is block_scores as it runs on
sm_90 (block_scores_gluon.py, two proxy heads a program; tile rows do not apply), triton
the Triton kernel. TFLOP/s count the causal pairs' proxy products, 2 * S^2 / 2 * H_p * D_p.

Writes DIR/block_selection.json and .md (DIR defaults to benchmarks/results/<gpu>/).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
from unittest import mock

import torch
from common import markdown_table, parse_length, results_dir, run_metadata, timed, write_report

from flash_msa import patterns
from flash_msa.msa import block_scores, block_scores_gluon
from flash_msa.msa.fp8 import FP8

# The module, whose name the package's function shadows as an attribute.
block_scores_module = importlib.import_module("flash_msa.msa.block_scores")

HEADS_PROXY, HEADS_PROXY_KEYS, Q_BLOCK, KV_BLOCK, TOP_K = 4, 1, 64, 128, 16
SCORE_DTYPES = {"bf16": None, "fp8": FP8}


def run_case(seq_len: int, proxy_dim: int, scores_name: str, kernel: str, tile_rows: int,
             device) -> dict:  # fmt: skip
    """One case's record; kernel "triton" refuses the Gluon kernel every call for the case."""
    block_scores_module.MAX_TILE_ROWS = tile_rows
    refused = mock.patch.object(block_scores_gluon, "supports", return_value=False)
    with refused if kernel == "triton" else contextlib.nullcontext():
        return _run_case(seq_len, proxy_dim, scores_name, kernel, tile_rows, device)


def _run_case(seq_len, proxy_dim, scores_name, kernel, tile_rows, device) -> dict:
    generator = torch.Generator(device=device).manual_seed(0)
    q_proxy, k_proxy = (
        torch.randn(1, seq_len, heads, proxy_dim, generator=generator, device=device,
                    dtype=torch.bfloat16)
        for heads in (HEADS_PROXY, HEADS_PROXY_KEYS)
    )  # fmt: skip
    blocks = dict(q_block=Q_BLOCK, kv_block=KV_BLOCK)
    score_dtype = SCORE_DTYPES[scores_name]
    scores = block_scores(q_proxy, k_proxy, **blocks, score_dtype=score_dtype)

    def score():
        block_scores(q_proxy, k_proxy, out=scores, **blocks, score_dtype=score_dtype)

    def rank():
        return patterns.topk(scores, TOP_K, seq_len_q=seq_len, fixed_counts=True, **blocks)

    record = dict(seq_len=seq_len, proxy_dim=proxy_dim, scores=scores_name, kernel=kernel,
                  tile_rows=None if kernel == "gluon" else tile_rows)  # fmt: skip
    if score_dtype is not None:
        selected = rank()
        expected = patterns.topk(block_scores(q_proxy, k_proxy, **blocks), TOP_K,
                                 seq_len_q=seq_len, fixed_counts=True, **blocks)  # fmt: skip
        record["agreement"] = round((expected & selected).nnz / expected.nnz, 5)
    record.update(scores_ms=round(timed(score)["ms"], 3), topk_ms=round(timed(rank)["ms"], 3))
    flops = seq_len * seq_len * HEADS_PROXY * proxy_dim  # 2 * S^2 / 2 * H_p * D_p
    record["scores_tflops"] = round(flops / record["scores_ms"] / 1e9, 1)
    print(record, flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", default="128k,1m")
    parser.add_argument("--proxy-dims", default="64,128")
    parser.add_argument("--scores", default=",".join(SCORE_DTYPES))
    parser.add_argument("--kernels", default="gluon,triton")
    parser.add_argument("--tile-rows", default="128")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    records = [
        run_case(parse_length(length), int(dim), scores, kernel, int(rows), device)
        for length in args.seq_lens.split(",")
        for dim in args.proxy_dims.split(",")
        for scores in args.scores.split(",")
        for kernel in args.kernels.split(",")
        for rows in (args.tile_rows.split(",") if kernel == "triton" else ["128"])
    ]
    meta = run_metadata(device)
    records = [dict(record, **meta) for record in records]
    columns = ["S", "D_p", "scores", "kernel", "tile rows", "block scores ms (TFLOP/s)",
               "top-k ms", "bf16 choices FP8 also makes"]  # fmt: skip
    rows = [
        (r, [f"{r['seq_len']:,}", r["proxy_dim"], r.get("scores", "bf16"),
             r.get("kernel", "triton"), r["tile_rows"] or "-",
             f"{r['scores_ms']} ({r['scores_tflops']})", r["topk_ms"],
             f"{100 * r['agreement']:.2f}%" if "agreement" in r else "-"])
        for r in records
    ]  # fmt: skip
    write_report(
        results_dir(args.out, device), "block_selection", records,
        meta=meta, title="Per-query-block selection: block scores and top-k",
        notes=__doc__.split("\n\n")[2].replace("\n", " "), body=markdown_table(columns, rows),
    )  # fmt: skip


if __name__ == "__main__":
    main()
