"""flash-msa against FlashAttention-4, FlexAttention and dense SDPA, side by side on one GPU.

    python benchmarks/bench_attention.py [--cases causal-32k,window-1m] [--out DIR]

bf16, batch 1, head dim 128, block 128 (msa-main-128k: query blocks of 64, MSA's main
attention), causal but for longformer-128k and bigbird-128k (common.CASES,
common.VARLEN_CASES; the cases are listed below). Each case builds one layout; flash-msa
runs it through its gluon and its triton backend (one row each, and through gluon with
deterministic=False; records carry `backend` and `deterministic`); FlexAttention (Triton
kernels, compiled with dynamic=False) and FlashAttention-4 (FlexAttention's FLASH backend)
run the identical blocks as one BlockMask
(common.flex_block_mask: causal, diagonal blocks partial and the rest full; non-causal,
every block full). Cases whose dense attention fits add dense FlashAttention-4
(flash_attn.cute) and SDPA (cuDNN, flash), causal as the case is.
FlashAttention-4 runs where flash_attn.cute imports. A run that fails on a case is recorded
with its error and the run goes on. Writes DIR/attention.json, .md and .png (DIR defaults
to benchmarks/results/<gpu>/), keeping the records of cases this run leaves out.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import operator

import torch
from common import (
    CASES,
    VARLEN_CASES,
    K,
    compiled_flex,
    dense_flops,
    failed_cell,
    failure,
    flex_block_mask,
    free_memory,
    kept_records,
    markdown_table,
    random_inputs,
    relative_difference,
    results_dir,
    run_metadata,
    timed,
    wall_ms,
    write_chart,
    write_report,
)

from flash_msa import block_sparse_attn_func, block_sparse_attn_varlen_func, patterns
from flash_msa.sequences import document_ids_of

# impl -> what it is, in the reports
IMPLS = {
    "flash_msa:gluon": "flash-msa, gluon backend (sm_90): Gluon forward, Gluon dK/dV and Triton "
    "dQ backward (deterministic)",
    "flash_msa:gluon:nondeterministic": "flash-msa, gluon backend with deterministic=False: "
    "the faster, timed on the first call, of one Gluon backward kernel with dQ added by TMA "
    "reduce-adds in any order and the deterministic backward",
    "flash_msa:triton": "flash-msa, triton backend (deterministic backward)",
    "flex": "FlexAttention (Triton), same blocks",
    "fa4_block_sparse": "FlashAttention-4 (FlexAttention FLASH backend), same blocks",
    "fa4_dense": "FlashAttention-4 dense, causal as the case",
    "sdpa_cudnn": "SDPA cuDNN dense, causal as the case",
    "sdpa_flash": "SDPA flash (FlashAttention-2) dense, causal as the case",
}
# flash-msa's rows: impl -> (backend, deterministic)
OURS = {
    impl: (impl.split(":")[1], not impl.endswith(":nondeterministic"))
    for impl in IMPLS
    if impl.startswith("flash_msa:")
}
PEERS = [impl for impl in IMPLS if impl not in OURS]
DENSE_IMPLS = ("fa4_dense", "sdpa_cudnn", "sdpa_flash")  # timed once per shape


def fa4_attention():
    """flash_attn.cute.flash_attn_func, or None where FlashAttention-4 does not import."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as error:  # not installed, or its CUDA libraries missing
        print(f"FlashAttention-4 left out ({failure(error)})")
        return None
    return flash_attn_func


def measure(fn, dout, leaves) -> dict:
    """Median forward and forward+backward ms, and peak memory of forward+backward."""
    forward = timed(fn)
    both = timed(lambda: fn().backward(dout), leaves)
    return dict(fwd_ms=forward["ms"], fwd_bwd_ms=both["ms"], peak_gib=both["peak_gib"])


def agreement(impls: dict) -> dict[str, dict]:
    """impl -> its relative difference from flash_msa's output (block-sparse peers, on the
    same inputs) or its error; computed before any timing, so that no output stays alive
    while peak memory is measured."""
    outcomes, reference = {}, None
    for impl, (fn, _) in impls.items():
        if impl in DENSE_IMPLS:
            continue
        try:
            with torch.no_grad():
                out = fn()
            if impl in OURS and reference is None:
                outcomes[impl], reference = {}, out
            elif reference is not None:
                outcomes[impl] = dict(rel_diff_vs_flash_msa=relative_difference(out, reference))
        except Exception as error:  # a peer's failure is recorded, not fatal
            outcomes[impl] = dict(error=failure(error))
        out = None
        free_memory()  # after the except block: its traceback no longer holds tensors
    return outcomes


def time_impls(case: dict, impls: dict, inputs, dense_timings: dict) -> list[dict]:
    """Time every implementation (impl -> (fn returning [1, S, H_q, D], forward FLOPs)) on one
    case (case: the fields every record starts with). Dense ones do not depend on the
    layout: measured once per shape and causal flag (dense_timings)."""
    q, k, v, dout = inputs
    outcomes = agreement(impls)
    records = []
    for impl, (fn, flops) in impls.items():
        record = dict(case, impl=impl.partition(":")[0], **outcomes.get(impl, {}))
        if impl in OURS:
            backend, deterministic = OURS[impl]
            record.update(backend=backend, deterministic=deterministic)
        shape_key = (impl, case["seq_len"], case["heads_q"], case["heads_kv"], case["causal"])
        try:
            if "error" in record:
                timing = None
            elif shape_key in dense_timings:
                timing = dense_timings[shape_key]
            else:
                timing = measure(fn, dout, [q, k, v])
        except Exception as error:  # a peer's failure is recorded, not fatal
            timing, record["error"] = None, failure(error)
        free_memory()
        records.append(record)
        if timing is None:
            print(f"{case['case']:22s} {impl:16s} failed: {record['error']}", flush=True)
            continue
        if impl in DENSE_IMPLS:
            dense_timings[shape_key] = timing
        record.update(
            {key: round(value, 4) for key, value in timing.items()},
            fwd_tflops=round(flops / timing["fwd_ms"] / 1e9, 1),
            fwd_bwd_tflops=round(3.5 * flops / timing["fwd_bwd_ms"] / 1e9, 1),
        )
        print(
            f"{case['case']:22s} {impl:16s} fwd {record['fwd_ms']:9.3f} ms "
            f"{record['fwd_tflops']:6.1f} TF/s  fwd+bwd {record['fwd_bwd_ms']:9.3f} ms "
            f"{record['fwd_bwd_tflops']:6.1f} TF/s  peak {record['peak_gib']:6.2f} GiB",
            flush=True,
        )
    return records


def flex_call(flex, q_t, k_t, v_t, block_mask, *, backend: str | None = None):
    """A zero-argument call of compiled FlexAttention on q_t, k_t, v_t [B, H, S, D] returning
    [B, S, H, D]; backend "FLASH" runs FlashAttention-4's kernels, None flex's own (Triton)."""
    options = None if backend is None else {"BACKEND": backend}
    gqa = q_t.shape[1] != k_t.shape[1]

    def attention():
        out = flex(q_t, k_t, v_t, block_mask=block_mask, enable_gqa=gqa, kernel_options=options)
        return out.transpose(1, 2)

    return attention


def first(result):
    """FlashAttention-4 returns out or (out, lse), depending on its version."""
    return result[0] if isinstance(result, tuple) else result


def run_case(name: str, device, dense_timings: dict, fa4) -> list[dict]:
    """flash-msa, FlexAttention and FA4 on the same blocks, and dense peers where they fit."""
    case = CASES[name]
    seq_len, heads_q, heads_kv, causal = case.seq_len, case.heads_q, case.heads_kv, case.causal
    layout_ms, layout = wall_ms(lambda: case.layout(seq_len, device), device, repeats=5)
    q, k, v, dout = inputs = random_inputs(seq_len, heads_q, heads_kv, device)
    anchor_flops = dense_flops(seq_len, heads_q, causal=causal)
    sparse_flops = case.flops(layout)
    q_t, k_t, v_t = (t.transpose(1, 2) for t in (q, k, v))  # flex and SDPA take [B, H, S, D]
    flex, block_mask = compiled_flex(), flex_block_mask(layout, heads_q, causal=causal)

    impls = {
        **{
            impl: (
                lambda backend=backend, deterministic=deterministic: block_sparse_attn_func(
                    q, k, v, layout, causal=causal, backend=backend, deterministic=deterministic
                ),
                sparse_flops,
            )
            for impl, (backend, deterministic) in OURS.items()
        },
        "flex": (flex_call(flex, q_t, k_t, v_t, block_mask), sparse_flops),
    }
    if fa4 is not None:
        flash = flex_call(flex, q_t, k_t, v_t, block_mask, backend="FLASH")
        impls["fa4_block_sparse"] = (flash, sparse_flops)
    if case.dense and fa4 is not None:
        impls["fa4_dense"] = (lambda: first(fa4(q, k, v, causal=causal)), anchor_flops)
    if case.dense:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        for impl, backend in (
            ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
            ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
        ):

            def sdpa(backend=backend):
                with sdpa_kernel(backend):
                    out = scaled_dot_product_attention(q_t, k_t, v_t, is_causal=causal)
                return out.transpose(1, 2)

            impls[impl] = (sdpa, anchor_flops)
    fields = dict(case=name, seq_len=seq_len, heads_q=heads_q, heads_kv=heads_kv, causal=causal)
    fields.update(density=layout.density, layout_ms=round(layout_ms, 3))
    return time_impls(fields, impls, inputs, dense_timings)


def run_varlen_case(name: str, device, fa4) -> list[dict]:
    """Packed causal documents: flash-msa's varlen call, FlexAttention and FA4 with a document
    mask, and FlashAttention-2's varlen kernel (torch.nn.attention.varlen), H = 16."""
    lengths, heads = VARLEN_CASES[name], 16
    total, longest = sum(lengths), max(lengths)
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    layout_ms, layout = wall_ms(
        lambda: patterns.causal(total, device=device, cu_seqlens=bounds), device, repeats=5
    )
    q, k, v, dout = inputs = random_inputs(total, heads, heads, device)
    flops = sum(dense_flops(length, heads, causal=True) for length in lengths)
    impls = {
        impl: (
            lambda backend=backend, deterministic=deterministic: block_sparse_attn_varlen_func(
                q[0],
                k[0],
                v[0],
                bounds,
                longest,
                layout,
                causal=True,
                backend=backend,
                deterministic=deterministic,
            )[None],
            flops,
        )
        for impl, (backend, deterministic) in OURS.items()
    }
    from torch.nn.attention.flex_attention import create_block_mask

    documents = document_ids_of(bounds)

    def causal_documents(batch, head, q_index, kv_index):
        return (documents[q_index] == documents[kv_index]) & (q_index >= kv_index)

    block_mask = create_block_mask(
        causal_documents, 1, 1, total, total, device=device, _compile=True
    )
    flex = compiled_flex()
    q_t, k_t, v_t = (t.transpose(1, 2) for t in (q, k, v))

    impls["flex"] = (flex_call(flex, q_t, k_t, v_t, block_mask), flops)
    if fa4 is not None:
        flash = flex_call(flex, q_t, k_t, v_t, block_mask, backend="FLASH")
        impls["fa4_block_sparse"] = (flash, flops)
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    if varlen_attn is not None:
        parameters = inspect.signature(varlen_attn).parameters
        causal = {"is_causal": True} if "is_causal" in parameters else {"window_size": (-1, 0)}
        impls["sdpa_flash"] = (
            lambda: varlen_attn(q[0], k[0], v[0], bounds, bounds, longest, longest, **causal)[None],
            flops,
        )
    case = dict(case=name, seq_len=total, heads_q=heads, heads_kv=heads, causal=True)
    case.update(density=layout.density, layout_ms=round(layout_ms, 3))
    return time_impls(case, impls, inputs, {})


def case_description(name: str) -> tuple[str, str]:
    """A case's mask ("causal" or "non-causal") and what its layout keeps, in a sentence;
    ("-", "-") for a case of earlier records that is no longer defined."""
    if name in VARLEN_CASES:
        lengths = ", ".join(f"{length // K}K" for length in VARLEN_CASES[name])
        return "causal", f"Packed documents of {lengths} tokens, causal within each (varlen)."
    if name in CASES:
        case = CASES[name]
        return "causal" if case.causal else "non-causal", case.summary
    return "-", "-"


def ratio(peer: dict | None, ours: dict, key: str) -> str:
    """peer ms / flash_msa ms ("-" where either is missing or failed)."""
    if peer is None or key not in peer or key not in ours:
        return "-"
    return f"{peer[key] / ours[key]:.2f}x"


def timing_cells(record: dict) -> list:
    if "error" in record:
        return [failed_cell(record), "-", "-", "-", "-"]
    return [
        f"{record['fwd_ms']:.3f}",
        f"{record['fwd_bwd_ms']:.3f}",
        record["fwd_tflops"],
        record["fwd_bwd_tflops"],
        f"{record['peak_gib']:.2f}",
    ]


def row_name(record: dict) -> str:
    """The impl, and for flash-msa's rows its backend (and :nondeterministic):
    "flash_msa:gluon"."""
    if "backend" not in record:
        return record["impl"]
    mode = "" if record.get("deterministic", True) else ":nondeterministic"
    return f"{record['impl']}:{record['backend']}{mode}"


def speedup_cells(impls: dict[str, dict], ours: dict) -> list[str]:
    """One flash-msa row's speed-up over each peer, forward / forward+backward."""
    return [
        f"{ratio(impls.get(peer), ours, 'fwd_ms')} / {ratio(impls.get(peer), ours, 'fwd_bwd_ms')}"
        for peer in PEERS
    ]


def write_reports(records: list[dict], meta: dict, out_dir) -> None:
    by_case: dict[str, dict] = {}
    for record in records:
        by_case.setdefault(record["case"], {})[row_name(record)] = record
    case_rows = [
        (r, [r["case"], r["seq_len"], f"{r['heads_q']} / {r['heads_kv']}", f"{r['density']:.4f}",
             *case_description(r["case"])])
        for r in (next(iter(impls.values())) for impls in by_case.values())
    ]  # fmt: skip
    columns = ["case", "impl", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s", "fwd+bwd TFLOP/s", "peak GiB"]
    timings = [(r, [r["case"], row_name(r), *timing_cells(r)]) for r in records]
    speedups = [
        (impls[ours], [case, ours.partition(":")[2], *speedup_cells(impls, impls[ours])])
        for case, impls in by_case.items()
        for ours in OURS
        if ours in impls
    ]
    body = [
        "## Cases",
        "",
        *markdown_table(["case", "S", "H_q / H_kv", "density", "mask", "layout"], case_rows),
        "",
        "## Times",
        "",
        *markdown_table(columns, timings),
        "",
        "## flash-msa's speed-up over each peer",
        "",
        "Peer ms / flash_msa ms, forward / forward+backward: above 1.00x flash-msa is faster.",
        "",
        *markdown_table(["case", "backend", *(f"vs {peer}" for peer in PEERS)], speedups),
        "",
        "Impls: " + "; ".join(f"{impl}: {text}" for impl, text in IMPLS.items()) + ".",
    ]
    write_report(
        out_dir,
        "attention",
        records,
        meta=meta,
        title="Block-sparse attention, side by side",
        notes="bf16, B=1, D=128, block 128, causal or not as each case (## Cases); medians "
        "of do_bench. TFLOP/s over the computed pairs (every pair of the active blocks; dense "
        "causal: half the square), 3.5x the forward's for forward+backward. layout_ms (in the "
        "JSON): building flash-msa's layout.",
        body=body,
    )
    cases = [case for case, impls in by_case.items() if "fwd_ms" in impls.get("flex", {})]

    def over_flex(key: str) -> dict[str, list[float]]:  # impl -> flex ms / impl ms per case
        return {
            impl: [
                by_case[case]["flex"][key] / by_case[case][impl][key]
                if key in by_case[case].get(impl, {})
                else 0
                for case in cases
            ]
            for impl in IMPLS
            if any(impl in by_case[case] for case in cases)
        }

    if not cases:  # nothing to draw against FlexAttention yet
        return
    write_chart(
        out_dir / "attention.png",
        cases,
        {"forward": over_flex("fwd_ms"), "forward + backward": over_flex("fwd_bwd_ms")},
        ylabel="speed-up over FlexAttention (dashed: 1.25x)",
        title=f"{meta['device']}, bf16, D=128, block 128",
        reference=1.25,
    )


def main() -> None:
    listing = [
        "  {} [{}]: {}".format(name, *case_description(name)) for name in [*CASES, *VARLEN_CASES]
    ]
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog="\n".join(["cases (--cases, comma-separated; default: all):", *listing]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--cases", default=",".join([*CASES, *VARLEN_CASES]))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    names = args.cases.split(",")
    order = {name: index for index, name in enumerate([*CASES, *VARLEN_CASES])}
    unknown = [name for name in names if name not in order]
    if unknown:
        parser.error(f"unknown cases {unknown}: choose among {', '.join(order)}")
    device = torch.device("cuda")
    meta = run_metadata(device)
    out_dir = results_dir(args.out, device)
    records = kept_records(out_dir / "attention.json", operator.itemgetter("case"), names)
    fa4, dense_timings = fa4_attention(), {}
    for name in names:
        if name in VARLEN_CASES:
            measured = run_varlen_case(name, device, fa4)
        else:
            measured = run_case(name, device, dense_timings, fa4)
        records += [{**record, **meta} for record in measured]
        records.sort(key=lambda record: order.get(record["case"], len(order)))
        write_reports(records, meta, out_dir)  # partial results survive a timeout
    print(f"wrote {out_dir}/attention.json, attention.md, attention.png")


if __name__ == "__main__":
    main()
