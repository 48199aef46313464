"""One MSA training step (selection, main attention, KL) against dense cuDNN attention and
FlexAttention on the same selected blocks, on one GPU.

    python benchmarks/bench_msa.py [--seq-lens 32k,128k,1m] [--out DIR]

bf16, B=1, H_q=64, H_kv=4, D=128; proxy H_p=4, H_pk=1, D_p=128; top_k 16, q_block 64,
kv_block 128; causal. Per length, msa_func forward + backward (out.backward(dout) and
kl_loss.backward() in one pass) is timed whole and in parts: selection (block_scores +
select_blocks), main attention (block_sparse_attn_func over msa_func's layout, forward +
backward) and KL (the total minus those two: the KL loss forward + backward and the glue;
the KL kernels alone, given the main lse, are timed too).
Dense cuDNN SDPA (fwd+bwd) is measured up to 128K and estimated beyond as the 128K time times
(S / 128K)^2 (marked "estimated"). FlexAttention (compiled) runs the selected layout as a
BlockMask with per-head kv indices [1, H_q, nq, nk]; it is skipped where those do not fit.
Writes DIR/msa.json and msa.md after each length (DIR defaults to benchmarks/results/<gpu>/),
keeping the records of lengths this run leaves out.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import pathlib
import time
from unittest import mock

import torch
import triton
from bench_attention import compiled_flex
from gpu_run import kept_records, results_dir, run_metadata

from flash_msa import block_sparse_attn_func
from flash_msa.layout import BlockLayout
from flash_msa.msa import block_scores, msa_func, proxy_kl_loss, select_blocks

K, M = 1024, 1024 * 1024
HEADS_Q, HEADS_KV, HEADS_PROXY, HEADS_PROXY_KEYS = 64, 4, 4, 1
HEAD_DIM = PROXY_HEAD_DIM = 128
TOP_K, Q_BLOCK, KV_BLOCK = 16, 64, 128
MSA_OPTIONS = dict(top_k=TOP_K, q_block=Q_BLOCK, kv_block=KV_BLOCK)
DENSE_MEASURED_UP_TO = 128 * K


def parse_length(text: str) -> int:
    """'32k' -> 32768, '1m' -> 1048576, '5000' -> 5000."""
    text = text.strip().lower()
    units = {"k": K, "m": M}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def random_inputs(seq_len: int, device) -> dict[str, torch.Tensor]:
    """bf16 q_proxy, k_proxy, q, k, v (requiring grad) and dout, [1, S, H, D] each, seeded."""
    generator = torch.Generator(device=device).manual_seed(1)
    shapes = dict(
        q_proxy=(HEADS_PROXY, PROXY_HEAD_DIM),
        k_proxy=(HEADS_PROXY_KEYS, PROXY_HEAD_DIM),
        q=(HEADS_Q, HEAD_DIM),
        k=(HEADS_KV, HEAD_DIM),
        v=(HEADS_KV, HEAD_DIM),
        dout=(HEADS_Q, HEAD_DIM),
    )
    tensors = {
        name: torch.randn(
            1, seq_len, heads, dim, generator=generator, device=device, dtype=torch.bfloat16
        )
        for name, (heads, dim) in shapes.items()
    }
    for name in ("q_proxy", "k_proxy", "q", "k", "v"):
        tensors[name].requires_grad_()
    return tensors


def timed(step, grad_to_none=None) -> dict:
    """Median ms of step (do_bench) and the peak memory of one run of it."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = triton.testing.do_bench(
        step, warmup=100, rep=500, grad_to_none=grad_to_none, return_mode="median"
    )
    return dict(ms=ms, peak_gib=torch.cuda.max_memory_allocated() / 2**30)


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def relative_difference(actual: torch.Tensor, expected: torch.Tensor, chunk: int = 64 * K):
    """||actual - expected|| / ||expected|| over [B, S, ...], in fp32 a chunk of S at a time."""
    error = norm = 0.0
    for start in range(0, expected.shape[1], chunk):
        a, e = (t[:, start : start + chunk].float() for t in (actual, expected))
        error += float((a - e).square().sum())
        norm += float(e.square().sum())
    return (error / norm) ** 0.5


def run_msa(seq_len: int, inputs: dict) -> tuple[dict, BlockLayout]:
    """msa_func forward + backward, whole and split; returns the record and the layout."""
    leaves = [inputs[name] for name in ("q_proxy", "k_proxy", "q", "k", "v")]
    q_proxy, k_proxy, q, k, v = leaves
    dout = inputs["dout"]

    def step():
        out, kl_loss = msa_func(q_proxy, k_proxy, q, k, v, **MSA_OPTIONS)
        torch.autograd.backward([out, kl_loss], [dout, None])

    def scores():
        return block_scores(q_proxy, k_proxy, q_block=Q_BLOCK, kv_block=KV_BLOCK)

    def selection():
        return select_blocks(scores(), TOP_K, seq_len=seq_len, q_block=Q_BLOCK, kv_block=KV_BLOCK)

    total = timed(step, leaves)
    with torch.no_grad():
        scores_ms = timed(scores)["ms"]
        selection_ms = timed(selection)["ms"]
        layout = msa_func(q_proxy, k_proxy, q, k, v, **MSA_OPTIONS, return_layout=True)[2]
    free_memory()
    main_ms = timed(
        lambda: block_sparse_attn_func(q, k, v, layout, causal=True).backward(dout), [q, k, v]
    )["ms"]
    with torch.no_grad():
        lse = block_sparse_attn_func(q, k, v, layout, causal=True, return_lse=True)[1]
    scale = HEAD_DIM**-0.5
    kl_kernels_ms = timed(
        lambda: proxy_kl_loss(
            q_proxy, k_proxy, q, k, lse, layout, softmax_scale=scale, proxy_softmax_scale=scale
        ).backward(),
        [q_proxy, k_proxy],
    )["ms"]
    # Each layout head serves H_q / H_p query heads; 3.5x the forward for forward + backward.
    main_flops = 3.5 * layout.flops(HEAD_DIM) * (HEADS_Q // HEADS_PROXY)
    score_flops = 2 * PROXY_HEAD_DIM * HEADS_PROXY * seq_len * (seq_len + 1) / 2
    record = dict(
        seq_len=seq_len,
        impl="flash_msa",
        fwd_bwd_ms=round(total["ms"], 4),
        selection_ms=round(selection_ms, 4),
        block_scores_ms=round(scores_ms, 4),
        main_attention_ms=round(main_ms, 4),
        kl_ms=round(total["ms"] - selection_ms - main_ms, 4),
        kl_kernels_ms=round(kl_kernels_ms, 4),
        block_scores_tflops=round(score_flops / scores_ms / 1e9, 1),
        main_attention_tflops=round(main_flops / main_ms / 1e9, 1),
        density=layout.density,
        peak_gib=round(total["peak_gib"], 3),
    )
    print(
        f"S={seq_len:>8,} flash_msa  total {record['fwd_bwd_ms']:9.3f} ms = selection "
        f"{selection_ms:.3f} (block_scores {scores_ms:.3f}, {record['block_scores_tflops']} "
        f"TF/s) + main {main_ms:.3f} ({record['main_attention_tflops']} TF/s) + KL "
        f"{record['kl_ms']:.3f} (kernels {kl_kernels_ms:.3f}); peak {record['peak_gib']:.2f} GiB",
        flush=True,
    )
    return record, layout


def cudnn_dense_ms(seq_len: int, device) -> tuple[float, str]:
    """Median ms of dense causal cuDNN SDPA forward + backward at seq_len, and how it got GQA:
    natively (enable_gqa) or with K and V repeated to H_q heads where cuDNN refuses that."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    tensors = random_inputs(seq_len, device)
    q, k, v, dout = (tensors[name].transpose(1, 2) for name in ("q", "k", "v", "dout"))

    def step(gqa: bool):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            if gqa:
                out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                repeat = HEADS_Q // HEADS_KV
                out = scaled_dot_product_attention(
                    q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
                    is_causal=True,
                )  # fmt: skip
        out.backward(dout)

    try:
        step(True)
        gqa = True
    except RuntimeError as error:  # no cuDNN kernel for unequal head counts
        print(f"cuDNN refused enable_gqa ({str(error).splitlines()[0]}); repeating K/V")
        gqa = False
    leaves = [tensors[name] for name in ("q", "k", "v")]
    return timed(lambda: step(gqa), leaves)["ms"], "enable_gqa" if gqa else "repeat_kv"


def run_dense(seq_len: int, device, measured: dict) -> dict:
    """cuDNN dense causal fwd+bwd: measured up to DENSE_MEASURED_UP_TO, estimated beyond
    from that length's time (causal work grows as S^2). measured caches seq_len -> result."""
    base = min(seq_len, DENSE_MEASURED_UP_TO)
    if base not in measured:
        measured[base] = cudnn_dense_ms(base, device)
        free_memory()
    base_ms, gqa = measured[base]
    ms = base_ms * (seq_len / base) ** 2
    flops = 3.5 * 4 * HEAD_DIM * seq_len * seq_len / 2 * HEADS_Q
    record = dict(
        seq_len=seq_len,
        impl="sdpa_cudnn",
        fwd_bwd_ms=round(ms, 4),
        fwd_bwd_tflops=round(flops / ms / 1e9, 1),
        gqa=gqa,
        estimated=base != seq_len,
    )
    label = f"estimated from {base:,} x {(seq_len / base) ** 2:g}" if base != seq_len else gqa
    print(f"S={seq_len:>8,} sdpa_cudnn total {ms:9.3f} ms ({label})", flush=True)
    return record


def flex_block_mask(layout: BlockLayout, heads_q: int):
    """The layout as a FlexAttention BlockMask of (q_block, kv_block) tiles with kv indices per
    query head, [B, H_q, nq, nk]; query head h reads layout head h // (H_q / layout_heads).
    A row's last block is its diagonal (selection keeps it, and rows list blocks ascending):
    partial, with a causal mask_mod; the others are full (no mask work)."""
    from torch.nn.attention.flex_attention import BlockMask

    device, nnz = layout.device, layout.nnz
    num_rows = layout.num_layouts * layout.num_q_blocks
    rows = layout.entry_rows()  # [nnz], flat row of each entry
    counts = layout.row_counts()  # [L * nq]
    slots = torch.arange(nnz, device=device) - layout.row_offsets[:, :-1].flatten().long()[rows]
    diagonal = slots == counts[rows] - 1  # [nnz]
    columns = layout.col_indices
    # Entries past a row's count are never read: zeros keep them in range.
    full_indices = torch.zeros(num_rows, layout.num_kv_blocks, dtype=torch.int32, device=device)
    full_indices[rows[~diagonal], slots[~diagonal]] = columns[~diagonal]
    partial_indices = torch.zeros_like(full_indices)
    partial_indices[rows[diagonal], 0] = columns[diagonal]

    def per_head(tensor):  # [L * nq, ...] -> [B, H_q, nq, ...]
        tensor = tensor.view(layout.layout_batch, layout.layout_heads, layout.num_q_blocks,
                             *tensor.shape[1:])  # fmt: skip
        return tensor.repeat_interleave(heads_q // layout.layout_heads, dim=1)

    def causal(batch, head, q_index, kv_index):
        return q_index >= kv_index

    return BlockMask.from_kv_blocks(
        per_head(torch.ones_like(counts, dtype=torch.int32)),
        per_head(partial_indices),
        per_head((counts - 1).int()),
        per_head(full_indices),
        BLOCK_SIZE=(layout.q_block, layout.kv_block),
        mask_mod=causal,
        seq_lengths=(layout.seq_len_q, layout.seq_len_kv),
    )


def flex_tiles_dividing_blocks():
    """A context in which Inductor compiles flex with tiles whose query rows divide the 64-row
    blocks: forward 64 x 64, backward dK/dV 32 x 64 and dQ 64 x 32 (3 stages, 4 warps each),
    the tiles its max_autotune picked at 32K. Its one default backward tile on sm90 at D=128
    has 128 query rows (NoValidChoicesError), and max_autotune took 111 s at 32K and did not
    finish within 8 minutes at 128K."""
    from torch._inductor.choices import InductorChoices
    from torch._inductor.template_heuristics.triton import FlexBwDConfig, FlexConfig

    # Patched on the class, not set as V's thread-local handler: autograd compiles the
    # backward on its own device thread.
    tiles = contextlib.ExitStack()
    for method, config in (
        ("get_flex_attention_fwd_configs", FlexConfig(64, 64, 3, 4)),
        ("get_flex_attention_bwd_configs", FlexBwDConfig(32, 64, 64, 32, 3, 4)),
    ):
        tiles.enter_context(mock.patch.object(InductorChoices, method, return_value=[config]))
    return tiles


def flex_fwd_bwd(inputs: dict, layout: BlockLayout) -> tuple[dict, float]:
    """Compiled FlexAttention fwd+bwd over layout, and the relative difference of its output
    from block_sparse_attn_func's."""
    q, k, v, dout = (inputs[name] for name in ("q", "k", "v", "dout"))
    block_mask = flex_block_mask(layout, HEADS_Q)
    q_t, k_t, v_t = (t.transpose(1, 2) for t in (q, k, v))  # flex takes [B, H, S, D]
    flex = compiled_flex()

    def forward():
        return flex(q_t, k_t, v_t, block_mask=block_mask, enable_gqa=True).transpose(1, 2)

    started = time.perf_counter()
    with flex_tiles_dividing_blocks():
        out = forward()  # with grad: a no_grad call would compile anew
        out.backward(dout)
    print(f"flex compiled in {time.perf_counter() - started:.0f} s", flush=True)
    for tensor in (q, k, v):
        tensor.grad = None
    with torch.no_grad():
        difference = relative_difference(out, block_sparse_attn_func(q, k, v, layout, causal=True))
    del out
    free_memory()
    return timed(lambda: forward().backward(dout), [q, k, v]), difference


def run_flex(seq_len: int, inputs: dict, layout: BlockLayout, main_ms: float) -> dict:
    """FlexAttention on flash_msa's layout; recorded as skipped, with the reason, when it fails
    (at 1M its per-head block indices alone take 32 GiB each)."""
    record = dict(seq_len=seq_len, impl="flex")
    try:
        timing, difference = flex_fwd_bwd(inputs, layout)
    except Exception as error:  # the peer's failure (memory, compilation) is recorded, not fatal
        timing, reason = None, f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    free_memory()  # after the except block: its traceback no longer holds the tensors
    if timing is None:
        print(f"S={seq_len:>8,} flex       skipped ({reason})", flush=True)
        return {**record, "skipped": reason}
    record.update(
        fwd_bwd_ms=round(timing["ms"], 4),
        rel_diff_vs_flash_msa=difference,
        peak_gib=round(timing["peak_gib"], 3),
    )
    print(
        f"S={seq_len:>8,} flex       total {timing['ms']:9.3f} ms (main attention only; "
        f"flash_msa's {main_ms:.3f}), rel. diff. {difference:.1e}",
        flush=True,
    )
    return record


def run_length(seq_len: int, device, dense_measured: dict) -> list[dict]:
    dense = run_dense(seq_len, device, dense_measured)
    inputs = random_inputs(seq_len, device)
    msa, layout = run_msa(seq_len, inputs)
    free_memory()
    flex = run_flex(seq_len, inputs, layout, msa["main_attention_ms"])
    del inputs, layout
    free_memory()
    return [msa, flex, dense]


def write_reports(records: list[dict], meta: dict, out_dir: pathlib.Path) -> None:
    (out_dir / "msa.json").write_text(json.dumps(records, indent=1))
    by_length: dict[int, dict] = {}
    for record in records:
        by_length.setdefault(record["seq_len"], {})[record["impl"]] = record
    lines = [
        "# MSA training step: selection, main attention, KL",
        "",
        f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}; {meta['date']}. "
        f"bf16, B=1, H_q={HEADS_Q}, H_kv={HEADS_KV}, D={HEAD_DIM}; proxy H_p={HEADS_PROXY}, "
        f"H_pk={HEADS_PROXY_KEYS}, D_p={PROXY_HEAD_DIM}; top_k {TOP_K}, q_block {Q_BLOCK}, "
        f"kv_block {KV_BLOCK}; causal. Forward + backward ms, medians of do_bench. KL = total "
        "minus selection and main attention. Flex runs the main attention only, on the same "
        "blocks, with tiles of 32 and 64 query rows. Dense figures marked * are estimated "
        "from 128K (x (S / 128K)^2). Each row's date is in msa.json.",
        "",
        "| S | flash_msa ms | selection ms | block_scores TFLOP/s | main attention ms | "
        "main TFLOP/s | KL ms | peak GiB | flex ms (main only) | main speed-up vs flex | "
        "cuDNN dense ms | speed-up vs dense cuDNN |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for seq_len, impls in by_length.items():
        msa, flex, dense = impls["flash_msa"], impls.get("flex", {}), impls.get("sdpa_cudnn")
        if "fwd_bwd_ms" in flex:
            flex_ms = f"{flex['fwd_bwd_ms']:.3f}"
            versus_flex = f"{flex['fwd_bwd_ms'] / msa['main_attention_ms']:.2f}x"
        else:
            flex_ms = "failed (msa.json says why)" if "skipped" in flex else "-"
            versus_flex = "-"
        dense_ms = "-" if dense is None else (
            f"{dense['fwd_bwd_ms']:,.1f}{'*' if dense['estimated'] else ''}"
        )  # fmt: skip
        speedup = "-" if dense is None else f"{dense['fwd_bwd_ms'] / msa['fwd_bwd_ms']:.1f}x"
        lines.append(
            f"| {seq_len:,} | {msa['fwd_bwd_ms']:.3f} | {msa['selection_ms']:.3f} | "
            f"{msa['block_scores_tflops']} | {msa['main_attention_ms']:.3f} | "
            f"{msa['main_attention_tflops']} | {msa['kl_ms']:.3f} | {msa['peak_gib']:.2f} | "
            f"{flex_ms} | {versus_flex} | {dense_ms} | {speedup} |"
        )
    (out_dir / "msa.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq-lens", default="32k,128k,1m", help="e.g. 32k,128k,1m")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    meta = run_metadata(device)
    out_dir = results_dir(args.out, meta)
    seq_lens = sorted(parse_length(text) for text in args.seq_lens.split(","))
    records = kept_records(out_dir / "msa.json", "seq_len", seq_lens)
    dense_measured = {}
    for seq_len in seq_lens:
        records += [{**record, **meta} for record in run_length(seq_len, device, dense_measured)]
        records.sort(key=lambda record: record["seq_len"])
        write_reports(records, meta, out_dir)  # partial results survive a timeout
    print(f"wrote {out_dir}/msa.json and msa.md")


if __name__ == "__main__":
    main()
