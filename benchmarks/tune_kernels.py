"""Time each Triton kernel apart (torch.profiler device times) under explicit launcher options:
query rows of the forward and dQ programs, kv rows x query rows of the dK/dV program, and TMA
(tensor-descriptor) or pointer loads.

    python benchmarks/tune_kernels.py [--case window-128k] [--query-rows 128,64]
        [--dq-rows 128,64] [--dkdv-rows 128x64,64x64,128x32,64x32] [--tma on|off|both]
        [--out DIR]

Each variant calls flash_msa.ops.triton.attention_forward and attention_backward with its
options (the autotuner still picks warps, stages and the inner tile). Each kernel is timed
apart, so the option lists are paired by position (the shorter ones repeated): four variants
cover every option of each kernel. --tma both runs every variant with each load path. Each
variant's out, dq, dk and dv are compared with the first variant's. Writes
DIR/tune_<case>.json and .md (DIR defaults to benchmarks/results/<gpu>/), keeping the
records of variants this run leaves out.
"""

from __future__ import annotations

import argparse
import functools
import operator

import torch
from common import (
    CASES,
    HEAD_DIM,
    failed_cell,
    failure,
    free_memory,
    kept_records,
    markdown_table,
    random_inputs,
    relative_difference,
    results_dir,
    run_metadata,
    write_report,
)

from flash_msa.ops.triton import attention_backward, attention_forward

OPTIONS = ("tma", "query_rows", "dq_query_rows", "dkdv_kv_rows", "dkdv_query_rows")
TMA_CHOICES = {"on": [True], "off": [False], "both": [False, True]}


def kernel_times(step, repeats: int = 5) -> dict[str, float]:
    """Mean device ms per launch of each Triton kernel over `repeats` runs of step()."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    return {
        event.key: round(event.device_time_total / 1e3 / repeats, 4)
        for event in profile.key_averages()
        if event.key.startswith("_") and "kernel" in event.key
    }


def forward_backward(q, k, v, dout, layout, options: dict, *, causal: bool):
    """out, dq, dk, dv from the Triton launchers under one variant's options."""
    mask = dict(causal=causal, window_size=(-1, -1), softmax_scale=HEAD_DIM**-0.5)
    out, lse = attention_forward(
        q, k, v, layout, **mask, tma=options["tma"], query_rows=options["query_rows"]
    )
    grads = attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse,
        layout,
        **mask,
        tma=options["tma"],
        dq_query_rows=options["dq_query_rows"],
        dkdv_query_rows=options["dkdv_query_rows"],
        dkdv_kv_rows=options["dkdv_kv_rows"],
    )
    return out, *grads


def variants(args) -> list[dict]:
    """The launcher options of each variant: the row lists paired by position."""
    query_rows = [int(rows) for rows in args.query_rows.split(",")]
    dq_rows = [int(rows) for rows in args.dq_rows.split(",")]
    dkdv_rows = [tuple(int(n) for n in pair.split("x")) for pair in args.dkdv_rows.split(",")]
    count = max(len(query_rows), len(dq_rows), len(dkdv_rows))
    return [
        dict(
            tma=tma,
            query_rows=query_rows[index % len(query_rows)],
            dq_query_rows=dq_rows[index % len(dq_rows)],
            dkdv_kv_rows=dkdv_rows[index % len(dkdv_rows)][0],
            dkdv_query_rows=dkdv_rows[index % len(dkdv_rows)][1],
        )
        for tma in TMA_CHOICES[args.tma]
        for index in range(count)
    ]


def kernel_cell(record: dict, kernel: str) -> str:
    times = record.get("kernel_ms", {})
    return f"{times[kernel]:.3f}" if kernel in times else "-"


def comparison_cell(record: dict) -> str:
    if "error" in record:
        return failed_cell(record)
    return f"{record['rel_diff_vs_first']:.1e}" if "rel_diff_vs_first" in record else "-"


def write_reports(records: list[dict], meta: dict, out_dir, name: str) -> None:
    kernels = sorted({kernel for record in records for kernel in record.get("kernel_ms", {})})
    rows = [
        (
            record,
            [
                "on" if record["tma"] else "off",
                record["query_rows"],
                record["dq_query_rows"],
                f"{record['dkdv_kv_rows']} x {record['dkdv_query_rows']}",
                *(kernel_cell(record, kernel) for kernel in kernels),
                comparison_cell(record),
            ],
        )
        for record in records
    ]
    columns = ["TMA", "forward q rows", "dQ q rows", "dK/dV kv x q rows"]
    columns += [f"{kernel} ms" for kernel in kernels] + ["max rel. diff. vs first variant"]
    case = records[0]["case"]
    mask = "causal" if CASES[case].causal else "non-causal"
    write_report(
        out_dir,
        name,
        records,
        meta=meta,
        title=f"Kernel times per launcher option, {case}",
        notes=f"bf16, B=1, D=128, block 128, {mask}; mean device ms per launch "
        "(torch.profiler, 5 runs); the autotuner picks warps, stages and the inner tile.",
        body=markdown_table(columns, rows),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--case", default="window-128k", choices=list(CASES))
    parser.add_argument("--query-rows", default="128,64", help="forward: query rows per program")
    parser.add_argument("--dq-rows", default="128,64", help="dQ: query rows per program")
    parser.add_argument(
        "--dkdv-rows", default="128x64,64x64,128x32,64x32", help="dK/dV: kv rows x query rows"
    )
    parser.add_argument("--tma", default="both", choices=list(TMA_CHOICES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    meta = run_metadata(device)
    out_dir = results_dir(args.out, device)
    case = CASES[args.case]
    layout = case.layout(case.seq_len, device)
    inputs = random_inputs(case.seq_len, case.heads_q, case.heads_kv, device)
    q, k, v, dout = (t.detach() for t in inputs)
    chosen = variants(args)
    name = f"tune_{args.case}"
    key = operator.itemgetter(*OPTIONS)
    records = kept_records(out_dir / f"{name}.json", key, map(key, chosen))
    first = None  # out, dq, dk, dv of the first variant that ran
    for options in chosen:
        step = functools.partial(
            forward_backward, q, k, v, dout, layout, options, causal=case.causal
        )
        record = dict(case=args.case, **options)
        try:
            values = step()  # autotunes
            record["kernel_ms"] = kernel_times(step)
            if first is None:
                first = values
            record["rel_diff_vs_first"] = max(
                relative_difference(value, expected)
                for value, expected in zip(values, first, strict=True)
            )
        except Exception as error:  # an option that does not compile or fit: recorded
            record["error"] = failure(error)
        values = None
        free_memory()
        records.append({**record, **meta})
        print(record, flush=True)
    records.sort(key=key, reverse=True)  # TMA first, then the larger tiles
    write_reports(records, meta, out_dir, name)
    print(f"wrote {out_dir}/{name}.json and {name}.md")


if __name__ == "__main__":
    main()
