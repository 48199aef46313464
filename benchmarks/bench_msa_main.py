"""MSA's main attention on real selections, per backend: the gluon kernels (tiles of packed
query heads with per-token query masks) against the triton ones, forward and forward +
backward, on one GPU.

    python benchmarks/bench_msa_main.py [--seq-lens 128k,1m] [--variants token:8,block:64]

bench_msa's inputs (bf16, B=1, H_q=64, H_kv=4, D=128; 4 proxy heads, top_k 16, kv_block 128;
causal) with local proxies; each variant (granularity:q_block) selects once, then
block_sparse_attn_func runs over that selection with backend "triton" and "gluon" (whose
backward takes dK and dV from its Gluon kernel, dQ from the Triton dQ kernel; with
deterministic=False, timed too, at q_block 64 dQ added in the dK / dV kernel). TFLOP/s over
the (query, key <= query) pairs the selection holds (forward 4 D flops a pair and head,
forward + backward 3.5x that); each gluon record carries its output's and lse's relative
difference from triton's, and the gluon backward alone given that forward's out and lse
(backward.attention_backward) with dQ from the Triton dQ kernel and from the Gluon one
(grad_q "triton" / "gluon"), with the largest relative difference of the second's dq, dk,
dv from the first's. Writes DIR/msa_main.json and msa_main.md (DIR defaults to
benchmarks/results/<gpu>/), keeping the records of the cases this run leaves out; with
--profile also DIR/msa_main_profile.txt: torch.profiler's kernel table of one gluon forward
+ backward per case (where its time goes).
"""

from __future__ import annotations

import argparse

import torch
from bench_msa import HEADS_PROXY, HEADS_Q, KV_BLOCK, TOP_K, attended_pairs, random_inputs
from common import (
    HEAD_DIM,
    free_memory,
    kept_records,
    markdown_table,
    parse_length,
    relative_difference,
    results_dir,
    run_metadata,
    timed,
    write_report,
)
from torch.profiler import ProfilerActivity, profile

from flash_msa import block_sparse_attn_func
from flash_msa.msa.interface import select
from flash_msa.ops.gluon import backward as gluon_backward
from flash_msa.ops.registry import QueryMasks

BACKENDS = ("triton", "gluon")
DQ_MODES = ("triton", "gluon", "atomic")  # the gluon backward's grad_q modes timed


def dq_modes(q, k, v, dout, out, lse, layout, query_masks) -> dict:
    """The gluon backward alone, given the forward's out and lse, per dQ mode: its ms and
    the Gluon dQ mode's largest relative difference (dq, dk, dv) from the Triton one's."""
    words = None
    if query_masks is not None:
        words = QueryMasks(query_masks, query_masks[layout.transpose_entries()])
    options = dict(causal=True, window_size=(-1, -1), softmax_scale=HEAD_DIM**-0.5,
                   query_masks=words)  # fmt: skip

    def run(mode):
        return gluon_backward.attention_backward(dout, q, k, v, out, lse, layout, **options,
                                                 grad_q=mode)  # fmt: skip

    with torch.no_grad():
        first = run("triton")
        difference = max(relative_difference(a, b) for a, b in zip(run("gluon"), first,
                                                                        strict=True))  # fmt: skip
        del first
        free_memory()
        times = {mode: timed(lambda mode=mode: run(mode))["ms"] for mode in DQ_MODES}
    return dict(backward_ms=round(times["triton"], 4),
                backward_gluon_dq_ms=round(times["gluon"], 4),
                backward_atomic_ms=round(times["atomic"], 4),
                gluon_dq_difference=difference)  # fmt: skip


def kernel_table(step, grad_to_none, rows: int = 14) -> str:
    """torch.profiler's table of one call of step (after one untimed call), its kernels by
    total CUDA time; the tensors of grad_to_none have their .grad cleared before each call."""

    def run():
        for tensor in grad_to_none:
            tensor.grad = None
        step()
        torch.cuda.synchronize()

    run()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def run_variant(seq_len: int, inputs: dict, granularity: str, q_block: int,
                profiles: list[str] | None) -> list[dict]:  # fmt: skip
    """One selection, then the main attention over it per backend: the records (and, given
    profiles, the gluon forward + backward's kernel table appended to it)."""
    q, k, v, dout = (inputs[name] for name in ("q", "k", "v", "dout"))
    with torch.no_grad():
        selection, _ = select(
            inputs["q_proxy"], inputs["k_proxy"], top_k=TOP_K, q_block=q_block,
            kv_block=KV_BLOCK, granularity=granularity, proxy_softmax_scale=HEAD_DIM**-0.5,
            warmup=False, document_ids=None, cu_seqlens=None, score_dtype=None,
        )  # fmt: skip
    layout, query_masks = selection
    pairs = attended_pairs(selection, seq_len) * (HEADS_Q // HEADS_PROXY)
    records, outputs = [], {}
    for backend in BACKENDS:

        def attention(backend=backend, deterministic=True):
            return block_sparse_attn_func(q, k, v, layout, causal=True, query_masks=query_masks,
                                          backend=backend, return_lse=True,
                                          deterministic=deterministic)  # fmt: skip

        with torch.no_grad():
            forward_ms = timed(attention)["ms"]
            outputs[backend] = attention()
        free_memory()
        both = timed(lambda attention=attention: attention()[0].backward(dout), [q, k, v])
        if profiles is not None and backend == "gluon":
            table = kernel_table(lambda attention=attention: attention()[0].backward(dout),
                                 [q, k, v])  # fmt: skip
            profiles.append(f"S={seq_len:,} {granularity} q_block {q_block}, gluon forward + "
                            f"backward:\n{table}")  # fmt: skip
        record = dict(
            seq_len=seq_len, granularity=granularity, q_block=q_block, backend=backend,
            forward_ms=round(forward_ms, 4), fwd_bwd_ms=round(both["ms"], 4),
            forward_tflops=round(4 * HEAD_DIM * pairs / forward_ms / 1e9, 1),
            fwd_bwd_tflops=round(3.5 * 4 * HEAD_DIM * pairs / both["ms"] / 1e9, 1),
            attended_pairs=pairs, density=layout.density, peak_gib=round(both["peak_gib"], 3),
        )  # fmt: skip
        if backend != "triton":
            record["out_difference"] = relative_difference(outputs[backend][0],
                                                           outputs["triton"][0])  # fmt: skip
            record["lse_difference"] = relative_difference(outputs[backend][1],
                                                           outputs["triton"][1])  # fmt: skip
            record.update(dq_modes(q, k, v, dout, *outputs[backend], layout, query_masks))
            free_memory()
            ms = timed(lambda attention=attention: attention(deterministic=False)[0].backward(
                dout), [q, k, v])["ms"]  # fmt: skip
            record["fwd_bwd_nondeterministic_ms"] = round(ms, 4)
            record["fwd_bwd_nondeterministic_tflops"] = round(
                3.5 * 4 * HEAD_DIM * pairs / ms / 1e9, 1)  # fmt: skip
        backward = ""
        if "backward_ms" in record:
            backward = (f"; backward {record['backward_ms']:.3f} ms, with the Gluon dQ "
                        f"{record['backward_gluon_dq_ms']:.3f} ms, atomic "
                        f"{record['backward_atomic_ms']:.3f} ms; fwd+bwd deterministic=False "
                        f"{record['fwd_bwd_nondeterministic_ms']:.3f} ms")  # fmt: skip
        print(f"S={seq_len:>8,} {granularity:5s} q{q_block:<3d} {backend:6s} forward "
              f"{forward_ms:8.3f} ms ({record['forward_tflops']} TF/s), fwd+bwd "
              f"{both['ms']:8.3f} ms ({record['fwd_bwd_tflops']} TF/s){backward}",
              flush=True)  # fmt: skip
        records.append(record)
        free_memory()
    return records


def write_reports(records: list[dict], meta: dict, out_dir) -> None:
    triton = {(r["seq_len"], r["granularity"], r["q_block"]): r for r in records
              if r["backend"] == "triton"}  # fmt: skip
    columns = ["S", "granularity", "q_block", "backend", "forward ms (TF/s)",
               "fwd+bwd ms (TF/s)", "forward speed-up vs triton", "fwd+bwd speed-up vs triton",
               "out / lse difference vs triton",
               "backward ms: Triton dQ / Gluon dQ / atomic",
               "Gluon dQ's gradient difference",
               "fwd+bwd deterministic=False ms (TF/s)"]  # fmt: skip
    rows = []
    for record in records:
        base = triton.get((record["seq_len"], record["granularity"], record["q_block"]))
        ratios = ["-", "-"]
        if base is not None and record["backend"] != "triton":
            ratios = [f"{base[key] / record[key]:.2f}x" for key in ("forward_ms", "fwd_bwd_ms")]
        difference = "-"
        if "out_difference" in record:
            difference = f"{record['out_difference']:.1e} / {record['lse_difference']:.1e}"
        modes = ["-", "-", "-"]
        if "backward_ms" in record:
            modes = [f"{record['backward_ms']:.3f} / {record['backward_gluon_dq_ms']:.3f} / "
                     f"{record['backward_atomic_ms']:.3f}",
                     f"{record['gluon_dq_difference']:.1e}", "-"]  # fmt: skip
        if "fwd_bwd_nondeterministic_ms" in record:
            modes[2] = (f"{record['fwd_bwd_nondeterministic_ms']:.3f} "
                        f"({record['fwd_bwd_nondeterministic_tflops']})")  # fmt: skip
        rows.append((record, [
            f"{record['seq_len']:,}", record["granularity"], record["q_block"], record["backend"],
            f"{record['forward_ms']:.3f} ({record['forward_tflops']})",
            f"{record['fwd_bwd_ms']:.3f} ({record['fwd_bwd_tflops']})", *ratios, difference,
            *modes,
        ]))  # fmt: skip
    write_report(
        out_dir, "msa_main", records, meta=meta,
        title="MSA main attention per backend",
        notes="bf16, B=1, H_q=64, H_kv=4, D=128; 4 proxy heads, top_k 16, kv_block 128, causal; "
        "local proxies. Granularity token: q_block tokens x 16 heads a tile over the union of "
        "the tokens' blocks, a bit per token; block: one choice per 64-query block (64 x 2 "
        "heads a gluon tile). The gluon backward takes dQ from the Triton dQ kernel; its last "
        "columns but one time it alone per dQ mode (grad_q triton / gluon / atomic: dQ added "
        "in the dK / dV kernel), the last the forward + backward with deterministic=False (the "
        "registry's choice: the atomic mode from q_block 64, the Triton dQ kernel below). Medians "
        "of do_bench; TFLOP/s over the selected (query, key <= query) pairs.",
        body=markdown_table(columns, rows),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-lens", default="128k,1m", help="e.g. 128k,1m")
    parser.add_argument("--variants", default="token:8,block:64", help="granularity:q_block,...")
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="write msa_main_profile.txt")
    args = parser.parse_args()
    variants = []
    for text in args.variants.split(","):
        granularity, _, q_block = text.partition(":")
        if granularity not in ("token", "block") or not q_block.isdigit():
            parser.error(f"--variants takes granularity:q_block items, got {text!r}")
        variants.append((granularity, int(q_block)))
    device = torch.device("cuda")
    meta = run_metadata(device)
    out_dir = results_dir(args.out, device)
    seq_lens = sorted(parse_length(text) for text in args.seq_lens.split(","))
    measured = [(s, g, b) for s in seq_lens for g, b in variants]
    records = kept_records(out_dir / "msa_main.json",
                           lambda r: (r["seq_len"], r["granularity"], r["q_block"]),
                           measured)  # fmt: skip
    profiles = [] if args.profile else None
    for seq_len in seq_lens:
        inputs = random_inputs(seq_len, device, "local")
        for granularity, q_block in variants:
            records += [{**record, **meta}
                        for record in run_variant(seq_len, inputs, granularity, q_block,
                                                  profiles)]  # fmt: skip
            records.sort(key=lambda r: (r["seq_len"], r["granularity"], r["q_block"]))
            write_reports(records, meta, out_dir)  # partial results survive a timeout
            if profiles:
                header = f"# {meta['device']}; torch {meta['torch']}; commit {meta.get('commit')}"
                text = "\n\n".join([header, *profiles])
                (out_dir / "msa_main_profile.txt").write_text(text + "\n")
        del inputs
        free_memory()
    print(f"wrote {out_dir}/msa_main.json and msa_main.md")


if __name__ == "__main__":
    main()
