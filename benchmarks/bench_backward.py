"""The Triton backend's two backwards side by side: FlashAttention-2's two kernels (dQ, then
dK/dV; deterministic) and the one kernel with atomic dQ (backward_atomic.py).

    python benchmarks/bench_backward.py [--cases causal-32k,window-128k,topk16-128k] [--out DIR]
    TRITON_INTERPRET=1 python benchmarks/bench_backward.py --cpu-smoke --out /tmp/smoke

bf16, batch 1, H 16, head dim 128, block 128, causal (common.CASES). Per case one forward
(gluon on sm_90, triton elsewhere) gives out and lse; each backward then runs on them, and
before any timing the gradients of the atomic one are compared with the two-kernel one's
(max abs and relative difference). Timed: forward + backward, and the backward alone; the
atomic backward at the configs' key rows per program and at 64 (its D = 128 tile spills
less there). --cpu-smoke runs tiny fp32 shapes on the CPU (under TRITON_INTERPRET=1) to
check the script. Writes DIR/backward.json and backward.md (DIR defaults to
benchmarks/results/<gpu>/), keeping the records of cases this run leaves out.
"""

from __future__ import annotations

import argparse
import functools
import operator

import torch
from common import (
    CASES,
    HEAD_DIM,
    free_memory,
    kept_records,
    markdown_table,
    random_inputs,
    relative_difference,
    results_dir,
    run_metadata,
    timed,
    write_report,
)

from flash_msa import _env, bench
from flash_msa.ops import registry
from flash_msa.ops.triton import attention_backward, attention_backward_atomic

DEFAULT_CASES = ("causal-32k", "window-128k", "topk16-128k")
# variant -> (backward launcher, what it is in the reports)
VARIANTS = {
    "two-kernel": (attention_backward, "dQ kernel + dK/dV kernel, deterministic"),
    "atomic": (attention_backward_atomic, "one kernel, fp32 atomic dQ"),
    "atomic-kv64": (functools.partial(attention_backward_atomic, kv_rows=64),
                    "one kernel, fp32 atomic dQ, 64 key rows per program"),
}  # fmt: skip
SMOKE = dict(seq_len=256, heads=1, head_dim=16, dtype=torch.float32)  # --cpu-smoke's shapes


def max_abs_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max())


def run_case(name: str, device: torch.device, smoke: bool) -> list[dict]:
    """Records of one case: one per variant, with its timings and its gradients' difference
    from the two-kernel backward's."""
    case = CASES[name]
    if smoke:
        seq_len, heads, head_dim = SMOKE["seq_len"], SMOKE["heads"], SMOKE["head_dim"]
        q, k, v, dout = bench.random_inputs(seq_len, heads, heads, device, head_dim=head_dim,
                                            dtype=SMOKE["dtype"])  # fmt: skip
        heads_q = heads_kv = heads
    else:
        seq_len, heads_q, heads_kv, head_dim = case.seq_len, case.heads_q, case.heads_kv, HEAD_DIM
        q, k, v, dout = random_inputs(seq_len, heads_q, heads_kv, device)
    q, k, v = (t.detach() for t in (q, k, v))
    layout = case.layout(seq_len, device)
    options = dict(causal=True, window_size=(-1, -1), softmax_scale=head_dim**-0.5,
                   document_ids=None, dropout_p=0.0, dropout_seed=0, positions=None,
                   query_masks=None)  # fmt: skip
    forward_backend = "gluon" if _env.capability(device) == (9, 0) else "triton"
    forward = registry.get(forward_backend).forward
    out, lse = forward(q, k, v, layout, **options)

    baseline = attention_backward(dout, q, k, v, out, lse, layout, **options)
    base = dict(case=name, seq_len=seq_len, heads_q=heads_q, heads_kv=heads_kv,
                head_dim=head_dim, dtype=str(q.dtype).removeprefix("torch."),
                forward=forward_backend, density=layout.density)  # fmt: skip
    # Forward FLOPs as bench_attention counts them: the anchors' S^2 / 2 for dense causal, the
    # active blocks' elsewhere (one layout head serves every query head).
    if name.startswith("causal"):
        forward_flops = 4 * head_dim * seq_len * seq_len / 2 * heads_q
    else:
        forward_flops = layout.flops(head_dim) * heads_q
    records = []
    for variant, (backward, _) in VARIANTS.items():
        grads = backward(dout, q, k, v, out, lse, layout, **options)
        differences = {
            f"d{label}_{kind}": measure(got, expected)
            for label, got, expected in zip("qkv", grads, baseline, strict=True)
            for kind, measure in (("max_abs_diff", max_abs_difference),
                                  ("rel_diff", relative_difference))
        }  # fmt: skip
        grads = None
        free_memory()

        def both(backward=backward):
            result = forward(q, k, v, layout, **options)
            return backward(dout, q, k, v, *result, layout, **options)

        def backward_only(backward=backward):
            return backward(dout, q, k, v, out, lse, layout, **options)

        timing_device = None if device.type == "cuda" else device
        fwd_bwd = timed(both, device=timing_device)
        bwd = timed(backward_only, device=timing_device)
        free_memory()
        record = dict(base, variant=variant, **differences, fwd_bwd_ms=fwd_bwd["ms"],
                      bwd_ms=bwd["ms"], fwd_bwd_tflops=3.5 * forward_flops / fwd_bwd["ms"] / 1e9,
                      peak_gib=fwd_bwd.get("peak_gib"))  # fmt: skip
        records.append(record)
        print(f"{name:14s} {variant:12s} fwd+bwd {fwd_bwd['ms']:9.2f} ms  bwd {bwd['ms']:9.2f} ms"
              f"  max|d(dq)| {differences['dq_max_abs_diff']:.3g}"
              f"  max|d(dk)| {differences['dk_max_abs_diff']:.3g}"
              f"  max|d(dv)| {differences['dv_max_abs_diff']:.3g}", flush=True)  # fmt: skip
    return records


def write_reports(records: list[dict], meta: dict, out_dir) -> None:
    rows = []
    for record in records:
        two_kernel = next(
            r for r in records if r["case"] == record["case"] and r["variant"] == "two-kernel"
        )
        differences = " / ".join(f"{record[f'd{label}_max_abs_diff']:.2g}" for label in "qkv")
        rows.append((record, [
            record["case"], record["variant"], f"{record['fwd_bwd_ms']:.2f}",
            f"{record['bwd_ms']:.2f}", f"{two_kernel['bwd_ms'] / record['bwd_ms']:.2f}x",
            f"{record['fwd_bwd_tflops']:.1f}", differences,
        ]))  # fmt: skip
    columns = ["case", "backward", "fwd+bwd ms", "bwd ms", "bwd speed-up",
               "fwd+bwd TFLOP/s", "max abs diff dq / dk / dv vs two-kernel"]  # fmt: skip
    first = records[0]
    variants = "; ".join(f"{variant}: {text}" for variant, (_, text) in VARIANTS.items())
    write_report(
        out_dir, "backward", records, meta=meta,
        title="flash-msa backward: two kernels against one with atomic dQ",
        notes=(f"{first['dtype']}, B=1, H={first['heads_q']}, D={first['head_dim']}, block 128, "
               f"causal; forward {first['forward']}. "
               f"Backwards: {variants}. TFLOP/s over active blocks (3.5x the forward's)."),
        body=markdown_table(columns, rows),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--out", default=None)
    parser.add_argument("--cpu-smoke", action="store_true",
                        help=f"tiny fp32 shapes on the CPU ({SMOKE['seq_len']} tokens), "
                             "under TRITON_INTERPRET=1")  # fmt: skip
    args = parser.parse_args()
    if args.cpu_smoke and not _env.interpreting():
        raise SystemExit("--cpu-smoke runs the kernels on the CPU: set TRITON_INTERPRET=1")
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    meta = run_metadata(device)
    out_dir = results_dir(args.out, device)
    names = args.cases.split(",")
    unknown = [name for name in names if name not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}: pick from {list(CASES)}")
    records = kept_records(out_dir / "backward.json", operator.itemgetter("case"), names)
    for name in names:
        records += [{**record, **meta} for record in run_case(name, device, args.cpu_smoke)]
        write_reports(records, meta, out_dir)  # partial results survive a timeout
    print(f"wrote {out_dir}/backward.json, backward.md")


if __name__ == "__main__":
    main()
