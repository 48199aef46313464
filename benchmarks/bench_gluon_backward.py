"""The Gluon backward on one H200, part by part, against flash-msa's Triton backward.

    PYTHONPATH=$PWD python benchmarks/bench_gluon_backward.py [--cases causal-32k,...] [--out DIR]

bf16, B=1, H=16, D=128, blocks of 128, over common.py's layouts, causal as each case is. Given
one Gluon forward's out and lse, it times (triton.testing.do_bench, median) the backward of
each:
- triton: the Triton backward (dQ kernel over the rows, dK/dV kernel over the columns);
- the Triton dQ kernel alone (with delta), which the Gluon backward's deterministic mode
  reuses; a backward's time less this one is its dK/dV part;
- gluon: Gluon dK/dV and the Triton dQ kernel (grad_q="triton", the gluon backend's
  deterministic mode; 3 stages measured the same as 2 at eb74836);
- gluon, Gluon dQ: Gluon dK/dV and the Gluon dQ kernel over the rows (grad_q="gluon",
  deterministic too);
- gluon ordered dQ / atomic dQ: one Gluon kernel, dQ beside dK and dV, added with TMA
  reduce-adds in each query half's kv order / in any order (grad_q="ordered" / "atomic";
  the "atomic" mode is the backend's deterministic=False).
Each Gluon variant's gradients are compared with the Triton backward's (relative error).
TFLOP/s: 2 * 128^3 per matmul per active block pair and head, over the matmuls of the part
(a whole backward: the five of FlashAttention's count; dK/dV: four). DIR/gluon_backward.json
and .md (DIR defaults to benchmarks/results/<gpu>/), keeping the records of the cases this
run leaves out.
"""

from __future__ import annotations

import argparse
import operator

import torch
import triton
from common import (
    CASES,
    HEAD_DIM,
    failure,
    free_memory,
    kept_records,
    markdown_table,
    random_inputs,
    results_dir,
    run_metadata,
    write_report,
)

from flash_msa.ops.gluon import backward as gluon_backward
from flash_msa.ops.gluon import forward as gluon_forward
from flash_msa.ops.triton.backward import attention_backward, grad_q_and_delta
from flash_msa.testing import relative_error

DEFAULT_CASES = "causal-32k,window-128k,topk16-128k"
# label -> gluon_backward.attention_backward options
GLUON_VARIANTS = {
    "gluon": dict(grad_q="triton"),
    "gluon, Gluon dQ": dict(grad_q="gluon"),
    "gluon, ordered dQ": dict(grad_q="ordered"),
    "gluon, atomic dQ": dict(grad_q="atomic"),
}


def run_case(name: str, device) -> list[dict]:
    case = CASES[name]
    seq_len, heads_q, heads_kv = case.seq_len, case.heads_q, case.heads_kv
    layout = case.layout(seq_len, device)
    layout.transpose()  # cached: not part of any timing
    q, k, v, grad_out = random_inputs(seq_len, heads_q, heads_kv, device)
    scale = HEAD_DIM**-0.5
    out, lse = gluon_forward.attention_forward(
        q, k, v, layout.row_offsets, layout.col_indices, softmax_scale=scale, causal=case.causal
    )
    options = dict(causal=case.causal, window_size=(-1, -1), softmax_scale=scale)
    pair_flops = 2 * 128**3 * layout.nnz * heads_q / layout.layout_heads  # one matmul

    def tflops(ms: float, matmuls: int) -> float:
        return round(matmuls * pair_flops / ms / 1e9, 1)

    def bench(fn) -> float:
        return triton.testing.do_bench(fn, rep=300)

    fields = dict(case=name, seq_len=seq_len, heads_q=heads_q, heads_kv=heads_kv,
                  causal=case.causal)  # fmt: skip
    expected = attention_backward(grad_out, q, k, v, out, lse, layout, **options)
    triton_ms = bench(lambda: attention_backward(grad_out, q, k, v, out, lse, layout, **options))
    dq_ms = bench(lambda: grad_q_and_delta(grad_out, q, k, v, out, lse, layout, **options))
    records = [
        dict(fields, impl="triton", bwd_ms=round(triton_ms, 3), bwd_tflops=tflops(triton_ms, 5),
             dkdv_ms=round(triton_ms - dq_ms, 3), dkdv_tflops=tflops(triton_ms - dq_ms, 4)),
        dict(fields, impl="triton dQ kernel", bwd_ms=round(dq_ms, 3)),
    ]  # fmt: skip
    for label, variant in GLUON_VARIANTS.items():
        record = dict(fields, impl=label)
        try:
            grads = gluon_backward.attention_backward(
                grad_out, q, k, v, out, lse, layout, **options, **variant
            )
            record["error_vs_triton"] = [
                float(f"{relative_error(g, e.double()):.2e}")
                for g, e in zip(grads, expected, strict=True)
            ]
            ms = bench(lambda variant=variant: gluon_backward.attention_backward(
                grad_out, q, k, v, out, lse, layout, **options, **variant))  # fmt: skip
            record.update(bwd_ms=round(ms, 3), bwd_tflops=tflops(ms, 5))
            if variant["grad_q"] == "triton":
                record.update(dkdv_ms=round(ms - dq_ms, 3), dkdv_tflops=tflops(ms - dq_ms, 4))
        except Exception as error:  # a variant's failure is recorded, not fatal
            record["error"] = failure(error)
        records.append(record)
        print(record, flush=True)
    return records


def cells(record: dict) -> list:
    if "error" in record:
        return [record["error"][:60], "-", "-", "-", "-"]
    errors = record.get("error_vs_triton")
    return [
        record["bwd_ms"],
        record.get("bwd_tflops", "-"),
        record.get("dkdv_ms", "-"),
        record.get("dkdv_tflops", "-"),
        "-" if errors is None else " / ".join(f"{e:.1e}" for e in errors),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    meta = run_metadata(device)
    out_dir = results_dir(args.out, device)
    names = args.cases.split(",")
    records = kept_records(out_dir / "gluon_backward.json", operator.itemgetter("case"), names)
    order = {name: index for index, name in enumerate(CASES)}
    columns = ["case", "impl", "bwd ms", "bwd TFLOP/s (5 mm)", "dK/dV ms", "dK/dV TFLOP/s (4 mm)",
               "dq / dk / dv vs triton"]  # fmt: skip
    for name in names:
        records += [dict(record, **meta) for record in run_case(name, device)]
        records.sort(key=lambda record: order[record["case"]])
        free_memory()
        # after each case, so that a run cut short keeps the cases it finished
        body = markdown_table(columns, [(r, [r["case"], r["impl"], *cells(r)]) for r in records])
        write_report(
            out_dir, "gluon_backward", records, meta=meta,
            title="Gluon backward, part by part",
            notes="bf16, B=1, H=16, D=128, blocks of 128, causal as each case is "
            "(common.CASES); given one Gluon forward's out and lse; medians of do_bench. "
            "dK/dV: a backward's time less the Triton dQ kernel's (which computes delta too).",
            body=body,
        )  # fmt: skip


if __name__ == "__main__":
    main()
