"""flash-msa against FlexAttention and dense SDPA (cuDNN, flash), side by side on one GPU.

    python benchmarks/bench_attention.py [--cases causal-32k,window-1m] [--out DIR]

bf16, batch 1, head dim 128, block 128, causal. Each case builds one layout; flash-msa
runs it, FlexAttention runs the identical blocks (BlockMask.from_kv_blocks, diagonal
blocks partial with a causal mask_mod, the rest full), and SDPA runs dense causal
attention where it fits. Writes DIR/attention.json, attention.md and attention.png
(DIR defaults to benchmarks/results/<gpu>/), keeping the records of cases this run leaves
out.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import itertools
import json
import pathlib

import torch
import triton
from gpu_run import kept_records, results_dir, run_metadata

from flash_msa import block_sparse_attn_func, block_sparse_attn_varlen_func, patterns
from flash_msa.layout import BlockLayout
from flash_msa.sequences import document_ids_of

K, M = 1024, 1024 * 1024
HEAD_DIM = 128


def topk_layout(seq_len: int, device) -> BlockLayout:
    """16 blocks per row: its own, the previous one, and 14 random earlier blocks."""
    blocks = seq_len // 128
    generator = torch.Generator(device=device).manual_seed(0)
    scores = torch.rand(blocks, blocks, device=device, generator=generator)
    rows = torch.arange(1, blocks, device=device)
    scores[rows, rows - 1] = 2.0  # above every random score: always kept
    return patterns.topk(scores, 16, seq_len_q=seq_len)


def window_layout(seq_len: int, device) -> BlockLayout:
    """Sliding window of 4096 tokens + 128 sink tokens, causal."""
    return patterns.sliding_window(seq_len, 4096, device=device) | patterns.global_tokens(
        seq_len, 128, device=device
    )


# name -> document lengths (packed back to back, causal within each)
VARLEN_CASES = {
    "varlen-1x128k": [128 * K],
    "varlen-16x8k": [8 * K] * 16,
    "varlen-skewed-128k": [64 * K, 32 * K, 16 * K, 8 * K, 4 * K, 2 * K, K, K],
}

# name -> (seq_len, heads_q, heads_kv, layout builder, dense sdpa too)
CASES = {
    "causal-32k": (32 * K, 16, 16, lambda s, d: patterns.causal(s, device=d), True),
    "causal-128k": (128 * K, 16, 16, lambda s, d: patterns.causal(s, device=d), True),
    "window-128k": (128 * K, 16, 16, window_layout, True),
    "window-1m": (M, 16, 16, window_layout, False),
    "topk16-128k": (128 * K, 16, 16, topk_layout, True),
    "topk16-1m": (M, 16, 16, topk_layout, False),
    "topk16-gqa32x8-128k": (128 * K, 32, 8, topk_layout, False),
    "topk16-gqa64x4-128k": (128 * K, 64, 4, topk_layout, False),
}


def flex_block_mask(layout: BlockLayout, heads: int):
    """The layout as a FlexAttention BlockMask: diagonal blocks partial (causal mask_mod),
    the others full (no mask work), as FlexAttention's create_block_mask would split them."""
    from torch.nn.attention.flex_attention import BlockMask

    dense = layout.to_dense()[0]  # [nq, nk]
    diagonal = torch.eye(*dense.shape, dtype=torch.bool, device=dense.device)

    def csr_like(mask):  # counts [1, 1, nq], indices [1, 1, nq, nk] (active first, ascending)
        counts = mask.sum(-1, dtype=torch.int32)
        order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts[None, None], order[None, None]

    def causal(batch, head, q_index, kv_index):
        return q_index >= kv_index

    partial_counts, partial_indices = csr_like(dense & diagonal)
    full_counts, full_indices = csr_like(dense & ~diagonal)
    return BlockMask.from_kv_blocks(
        partial_counts, partial_indices, full_counts, full_indices, 128, causal
    )


def measure(fn, grads_of) -> dict:
    """Median forward and forward+backward ms, and peak memory of forward+backward."""
    forward_ms = triton.testing.do_bench(lambda: fn(), warmup=100, rep=500, return_mode="median")

    def step():
        fn().backward(grads_of["dout"])

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    both_ms = triton.testing.do_bench(
        step, warmup=100, rep=500, grad_to_none=grads_of["inputs"], return_mode="median"
    )
    return dict(
        fwd_ms=forward_ms,
        fwd_bwd_ms=both_ms,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30,
    )


def random_inputs(seq_len: int, heads_q: int, heads_kv: int, device):
    """bf16 q [1, S, H_q, D], k, v [1, S, H_kv, D] (requiring grad) and dout, from a seed."""
    generator = torch.Generator(device=device).manual_seed(1)

    def randn(heads):
        return torch.randn(1, seq_len, heads, HEAD_DIM, generator=generator, device=device,
                           dtype=torch.bfloat16)  # fmt: skip

    q, k, v = (randn(h).requires_grad_() for h in (heads_q, heads_kv, heads_kv))
    return q, k, v, randn(heads_q)


def time_impls(name, impls, inputs, shape, density, dense_timings) -> list[dict]:
    """Time every implementation (name -> (fn returning [1, S, H_q, D], FLOPs)) on one case.
    Dense SDPA does not depend on the layout: measured once per shape (dense_timings)."""
    q, k, v, dout = inputs
    seq_len, heads_q, heads_kv = shape
    grads_of = dict(dout=dout, inputs=[q, k, v])
    with torch.no_grad():  # agreement of the sparse implementations on these inputs
        ours, theirs = impls["flash_msa"][0]().float(), impls["flex"][0]().float()
        agreement = float((ours - theirs).norm() / theirs.norm())
    records = []
    for impl, (fn, flops) in impls.items():
        gc.collect()
        torch.cuda.empty_cache()
        shape_key = (impl, *shape)
        try:
            if impl.startswith("sdpa") and shape_key in dense_timings:
                timing = dense_timings[shape_key]
            else:
                timing = measure(fn, grads_of)
        except torch.OutOfMemoryError:
            print(f"{name:22s} {impl:10s} out of memory")
            continue
        if impl.startswith("sdpa"):
            dense_timings[shape_key] = timing
        record = dict(
            case=name,
            seq_len=seq_len,
            heads_q=heads_q,
            heads_kv=heads_kv,
            impl=impl,
            density=density,
            **{key: round(value, 4) for key, value in timing.items()},
            fwd_tflops=round(flops / timing["fwd_ms"] / 1e9, 1),
            fwd_bwd_tflops=round(3.5 * flops / timing["fwd_bwd_ms"] / 1e9, 1),
            rel_diff_vs_flex=agreement if impl == "flash_msa" else None,
        )
        records.append(record)
        print(
            f"{name:22s} {impl:10s} fwd {record['fwd_ms']:9.3f} ms {record['fwd_tflops']:6.1f} TF/s"
            f"  fwd+bwd {record['fwd_bwd_ms']:9.3f} ms {record['fwd_bwd_tflops']:6.1f} TF/s"
            f"  peak {record['peak_gib']:6.2f} GiB",
            flush=True,
        )
    return records


def compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    return torch.compile(flex_attention, dynamic=False)


def run_case(name: str, device, dense_timings: dict) -> list[dict]:
    """flash-msa, FlexAttention on the same blocks, and dense SDPA where it fits."""
    seq_len, heads_q, heads_kv, build, dense = CASES[name]
    layout = build(seq_len, device)
    q, k, v, dout = inputs = random_inputs(seq_len, heads_q, heads_kv, device)
    if name.startswith("causal"):
        sparse_flops = 4 * HEAD_DIM * seq_len * seq_len / 2 * heads_q  # the anchors' count
    else:
        sparse_flops = layout.flops(HEAD_DIM) * heads_q
    dense_flops = 4 * HEAD_DIM * seq_len * seq_len / 2 * heads_q

    impls = {
        "flash_msa": (lambda: block_sparse_attn_func(q, k, v, layout, causal=True), sparse_flops)
    }
    flex = compiled_flex()
    block_mask = flex_block_mask(layout, heads_q)
    q_t, k_t, v_t = (t.transpose(1, 2) for t in (q, k, v))  # flex takes [B, H, S, D]
    impls["flex"] = (
        lambda: flex(
            q_t, k_t, v_t, block_mask=block_mask, enable_gqa=heads_q != heads_kv
        ).transpose(1, 2),
        sparse_flops,
    )
    if dense:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        for impl, backend in (
            ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
            ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
        ):

            def sdpa(backend=backend):
                with sdpa_kernel(backend):
                    return scaled_dot_product_attention(q_t, k_t, v_t, is_causal=True).transpose(
                        1, 2
                    )

            impls[impl] = (sdpa, dense_flops)
    shape = (seq_len, heads_q, heads_kv)
    return time_impls(name, impls, inputs, shape, layout.density, dense_timings)


def run_varlen_case(name: str, device, dense_timings: dict) -> list[dict]:
    """Packed causal documents: flash-msa's varlen call, FlexAttention with a document
    mask, and FlashAttention-2's varlen kernel (torch.nn.attention.varlen), H = 16."""
    lengths, heads = VARLEN_CASES[name], 16
    total, longest = sum(lengths), max(lengths)
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    layout = patterns.causal(total, device=device, cu_seqlens=bounds)
    q, k, v, dout = inputs = random_inputs(total, heads, heads, device)
    flops = sum(4 * HEAD_DIM * length * length / 2 for length in lengths) * heads
    impls = {
        "flash_msa": (
            lambda: block_sparse_attn_varlen_func(
                q[0], k[0], v[0], bounds, longest, layout, causal=True
            )[None],
            flops,
        )
    }
    from torch.nn.attention.flex_attention import create_block_mask

    documents = document_ids_of(bounds)

    def causal_documents(batch, head, q_index, kv_index):
        return (documents[q_index] == documents[kv_index]) & (q_index >= kv_index)

    block_mask = create_block_mask(causal_documents, 1, 1, total, total, device=device,
                                   _compile=True)  # fmt: skip
    flex = compiled_flex()
    q_t, k_t, v_t = (t.transpose(1, 2) for t in (q, k, v))
    impls["flex"] = (lambda: flex(q_t, k_t, v_t, block_mask=block_mask).transpose(1, 2), flops)
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
    return time_impls(name, impls, inputs, (total, heads, heads), layout.density, {})


def write_reports(records: list[dict], meta: dict, out_dir: pathlib.Path) -> None:
    (out_dir / "attention.json").write_text(json.dumps(records, indent=1))
    by_case: dict[str, dict] = {}
    for record in records:
        by_case.setdefault(record["case"], {})[record["impl"]] = record
    lines = [
        "# Block-sparse attention, side by side",
        "",
        f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}; {meta['date']}. "
        "bf16, B=1, D=128, block 128, causal; medians of do_bench. TFLOP/s over the "
        "computed pairs (active blocks; dense causal: half the square). Each row's date is in "
        "attention.json.",
        "",
        "| case | impl | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s | peak GiB | "
        "fwd+bwd speed-up vs flex |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, impls in by_case.items():
        flex = impls.get("flex")
        for impl, r in impls.items():
            ratio = f"{flex['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x" if flex else "-"
            lines.append(
                f"| {case} | {impl} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | "
                f"{r['fwd_tflops']} | {r['fwd_bwd_tflops']} | {r['peak_gib']:.2f} | {ratio} |"
            )
    (out_dir / "attention.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = ["flash_msa", "flex", "sdpa_cudnn", "sdpa_flash"]
    cases = [case for case in by_case if "flex" in by_case[case]]
    figure, axes = plt.subplots(1, 2, figsize=(max(10, 2.4 * len(cases)), 4.5), sharey=True)
    width = 0.2
    for axis, key, title in zip(axes, ("fwd_ms", "fwd_bwd_ms"), ("forward", "forward + backward"),
                                strict=True):  # fmt: skip
        for index, impl in enumerate(impls):
            speedups = [
                by_case[c]["flex"][key] / by_case[c][impl][key] if impl in by_case[c] else 0
                for c in cases
            ]
            axis.bar([x + index * width for x in range(len(cases))], speedups, width, label=impl)
        axis.axhline(1.25, color="black", linestyle="--", linewidth=1)
        axis.set_xticks([x + 1.5 * width for x in range(len(cases))], cases, rotation=30,
                        ha="right")  # fmt: skip
        axis.set_title(title)
    axes[0].set_ylabel("speed-up over FlexAttention (dashed: 1.25x)")
    axes[0].legend()
    figure.suptitle(f"{meta['device']}, bf16, D=128, block 128, causal")
    figure.savefig(out_dir / "attention.png", dpi=110, bbox_inches="tight")
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", default=",".join([*CASES, *VARLEN_CASES]))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    meta = run_metadata(device)
    out_dir = results_dir(args.out, meta)
    names = args.cases.split(",")
    records, dense_timings = kept_records(out_dir / "attention.json", "case", names), {}
    order = {name: index for index, name in enumerate([*CASES, *VARLEN_CASES])}
    for name in names:
        run = run_varlen_case if name in VARLEN_CASES else run_case
        records += [{**record, **meta} for record in run(name, device, dense_timings)]
        records.sort(key=lambda record: order[record["case"]])
        write_reports(records, meta, out_dir)  # partial results survive a timeout
    print(f"wrote {out_dir}/attention.json, attention.md, attention.png")


if __name__ == "__main__":
    main()
