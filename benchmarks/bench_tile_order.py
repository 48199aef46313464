"""The gluon backend's launch order on GQA layouts: one flash_msa against another, one call.

    PYTHONPATH=$PWD python benchmarks/bench_tile_order.py --label new [--cases ...] [--out DIR]
    PYTHONPATH=OTHER python benchmarks/bench_tile_order.py --label old --out DIR

Each run times the flash_msa it imports (PYTHONPATH: the working tree, or a copy of an
earlier commit's package) through block_sparse_attn_func with backend="gluon": forward,
and forward + backward deterministic and not (triton.testing.do_bench, median), on common.py's
cases (bf16, B=1, D=128, causal as each case is; default: top-k 16 at 128K with GQA 32/8 and
64/4, one layout for all heads, MSA's main attention with a layout per kv head and query blocks
of 64, and dense causal 32K without GQA as a control), after checking its output against the
triton backend's. Records carry the run's --label and the source digest of the package
timed; DIR/tile_order.json keeps the records of other labels, and tile_order.md sets the
labels side by side (DIR defaults to benchmarks/results/<gpu>/).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
from common import (
    CASES,
    free_memory,
    markdown_table,
    random_inputs,
    relative_difference,
    results_dir,
    run_metadata,
    source_digest,
    timed,
    write_report,
)

import flash_msa
from flash_msa import block_sparse_attn_func

DEFAULT_CASES = "topk16-gqa32x8-128k,topk16-gqa64x4-128k,msa-main-128k,causal-32k"
PACKAGE = pathlib.Path(flash_msa.__file__).parent
MODES = {"fwd": None, "fwd_bwd": True, "fwd_bwd_nondeterministic": False}  # -> deterministic


def run_case(name: str, device) -> dict:
    case = CASES[name]
    seq_len, heads_q, heads_kv = case.seq_len, case.heads_q, case.heads_kv
    layout = case.layout(seq_len, device)
    q, k, v, dout = random_inputs(seq_len, heads_q, heads_kv, device)

    def call(backend="gluon", deterministic=True):
        return block_sparse_attn_func(q, k, v, layout, causal=case.causal, backend=backend,
                                      deterministic=deterministic)  # fmt: skip

    with torch.no_grad():
        difference = relative_difference(call(), call("triton"))
    record = dict(case=name, seq_len=seq_len, heads_q=heads_q, heads_kv=heads_kv,
                  causal=case.causal, q_block=layout.q_block,
                  rel_diff_vs_triton=difference)  # fmt: skip
    flops = case.flops(layout)
    for mode, deterministic in MODES.items():
        if deterministic is None:
            ms = timed(call)["ms"]
        else:
            step = lambda d=deterministic: call(deterministic=d).backward(dout)  # noqa: E731
            ms = timed(step, [q, k, v])["ms"]
        factor = 1.0 if deterministic is None else 3.5
        record.update(
            {f"{mode}_ms": round(ms, 4), f"{mode}_tflops": round(factor * flops / ms / 1e9, 1)}
        )
        free_memory()
    return record


def write_reports(records: list[dict], meta: dict, out_dir) -> None:
    labels = sorted({record["label"] for record in records})
    rows = [
        (record, [record["case"], record["label"],
                  *(record.get(f"{mode}_ms", "-") for mode in MODES),
                  f"{record.get('rel_diff_vs_triton', float('nan')):.1e}"])
        for record in sorted(records, key=lambda r: (r["case"], r["label"]))
    ]  # fmt: skip
    columns = ["case", "label", "fwd ms", "fwd+bwd ms (deterministic)",
               "fwd+bwd ms (deterministic=False)", "out vs triton"]  # fmt: skip
    write_report(
        out_dir, "tile_order", records, meta=meta, title="The gluon backend's launch order",
        notes=f"Labels {', '.join(labels)}: each a run of bench_tile_order.py over another "
        "flash_msa package (source_sha256 in the JSON). bf16, B=1, D=128, causal as each case "
        "is (common.CASES), backend gluon; medians of do_bench.",
        body=markdown_table(columns, rows),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    meta = dict(run_metadata(device), package=str(PACKAGE))
    meta["source_sha256"] = source_digest(PACKAGE)  # the package imported, not this tree's
    out_dir = results_dir(args.out, device)
    path = out_dir / "tile_order.json"
    records = [r for r in (json.loads(path.read_text()) if path.exists() else [])
               if r["label"] != args.label]  # fmt: skip
    for name in args.cases.split(","):
        record = dict(run_case(name, device), label=args.label, **meta)
        print(json.dumps(record), flush=True)
        records.append(record)
        write_reports(records, meta, out_dir)


if __name__ == "__main__":
    main()
