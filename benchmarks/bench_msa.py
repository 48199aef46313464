"""One MSA training step (selection, main attention, KL) against dense cuDNN attention and
FlexAttention on the same selected blocks, on one GPU.

    python benchmarks/bench_msa.py [--seq-lens 32k,128k,1m] [--scores bf16,fp8] [--out DIR]

bf16, B=1, H_q=64, H_kv=4, D=128; proxy H_p=4, H_pk=1, D_p=128; top_k 16, q_block 64,
kv_block 128; causal. Per length and granularity ("token": each query token's blocks;
"block": one choice per query block), msa_func forward + backward (out.backward(dout) and
kl_loss.backward() in one pass) is timed whole and in parts: selection (msa.interface.select),
main attention (block_sparse_attn_func over the selection, forward + backward) and KL (the
total minus those two: the KL loss forward + backward and the glue; the KL kernels alone,
given the main lse, are timed too); records carry a `granularity` key, and a `scores` key
("bf16", or "fp8": score_dtype float8_e4m3fn; --scores picks which run).
Dense cuDNN SDPA (fwd+bwd) is measured up to 128K and estimated beyond as the 128K time times
(S / 128K)^2 (marked "estimated"). FlexAttention (compiled) runs the selected layout as a
BlockMask with per-head kv indices [1, H_q, nq, nk] (common.flex_block_mask); where it fails
(at 1M those indices do not fit) the record keeps its error.
Writes DIR/msa.json and msa.md after each length (DIR defaults to benchmarks/results/<gpu>/),
keeping the records of the variants this run leaves out.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from unittest import mock

import torch
from common import (
    HEAD_DIM,
    K,
    compiled_flex,
    failed_cell,
    failure,
    flex_block_mask,
    free_memory,
    kept_records,
    markdown_table,
    parse_length,
    random_tensors,
    relative_difference,
    results_dir,
    run_metadata,
    timed,
    write_report,
)

from flash_msa import BlockLayout, block_sparse_attn_func, patterns
from flash_msa.msa import msa_func, proxy_kl_loss
from flash_msa.msa.fp8 import FP8
from flash_msa.msa.interface import GRANULARITIES, MsaSelection, select

HEADS_Q, HEADS_KV, HEADS_PROXY, HEADS_PROXY_KEYS = 64, 4, 4, 1
PROXY_HEAD_DIM = HEAD_DIM
TOP_K, Q_BLOCK, KV_BLOCK = 16, 64, 128  # q_block: granularity block's selection unit
DENSE_MEASURED_UP_TO = 128 * K
FLEX_TOKEN_MASK_UP_TO = 128 * K  # its per-token mask [H_p, S, nk] bool: 0.5 GiB at 128K
FLEX_TOKEN_TILE = 64  # query rows of flex's block mask for per-token selections
LOCAL_WINDOW = 4096  # proxies "local": keys correlated over this many tokens
PROXIES = ("random", "local")


def random_inputs(seq_len: int, device, proxies: str = "random") -> dict[str, torch.Tensor]:
    """bf16 q_proxy, k_proxy, q, k, v (requiring grad) and dout, [1, S, H, D] each, seeded;
    proxies "local" replaces the proxies' values by local_proxies'."""
    heads = dict(q_proxy=HEADS_PROXY, k_proxy=HEADS_PROXY_KEYS, q=HEADS_Q, k=HEADS_KV)
    heads.update(v=HEADS_KV, dout=HEADS_Q)
    grads = ("q_proxy", "k_proxy", "q", "k", "v")
    tensors = random_tensors(seq_len, heads, device=device, requires_grad=grads)
    if proxies == "local":
        with torch.no_grad():
            q_proxy, k_proxy = local_proxies(seq_len, device)
            tensors["q_proxy"].copy_(q_proxy)
            tensors["k_proxy"].copy_(k_proxy)
    return tensors


def local_proxies(seq_len: int, device, window: int = LOCAL_WINDOW, seed: int = 2):
    """q_proxy [1, S, H_p, D_p], k_proxy [1, S, H_pk, D_p] whose logits favour recent keys:
    k_proxy a moving average of white noise over `window` tokens (unit variance, so keys
    |i - j| apart correlate by 1 - |i - j| / window), each proxy head's query its token's key
    plus as much independent noise. Each token's best blocks are then its recent ones, shared
    with its neighbours', as a trained proxy's selections overlap."""
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (1, seq_len, HEADS_PROXY_KEYS, PROXY_HEAD_DIM)
    noise = torch.randn(shape, generator=generator, device=device, dtype=torch.float64)
    sums = torch.nn.functional.pad(noise.cumsum(1), (0, 0, 0, 0, 1, 0))  # [1, S + 1, H_pk, D_p]
    starts = (torch.arange(1, seq_len + 1, device=device) - window).clamp(min=0)
    k_proxy = (sums[:, 1:] - sums[:, starts]) / window**0.5
    own_key = k_proxy.repeat_interleave(HEADS_PROXY // HEADS_PROXY_KEYS, 2)  # [1, S, H_p, D_p]
    q_proxy = own_key + torch.randn(own_key.shape, generator=generator, device=device,
                                    dtype=torch.float64)  # fmt: skip
    return q_proxy, k_proxy


def token_blocks(selection: MsaSelection, seq_len: int) -> torch.Tensor:
    """bool [L, S, nk]: the kv blocks each query token of each layout head reads."""
    layout, words = selection
    rows = layout.entry_rows()  # [nnz]
    bits = torch.arange(layout.q_block, device=rows.device)  # [q_block]
    tokens = (rows % layout.num_q_blocks)[:, None] * layout.q_block + bits  # [nnz, q_block]
    chosen = tokens < seq_len
    if words is not None:
        chosen &= (words[:, None] >> bits & 1).bool()
    entry = torch.arange(rows.numel(), device=rows.device)[:, None].expand_as(tokens)[chosen]
    blocks = torch.zeros(layout.num_layouts, seq_len, layout.num_kv_blocks, dtype=torch.bool,
                         device=rows.device)  # fmt: skip
    blocks[rows[entry] // layout.num_q_blocks, tokens[chosen],
           layout.col_indices[entry].long()] = True  # fmt: skip
    return blocks


def attended_pairs(selection: MsaSelection, seq_len: int, chunk: int = 1 << 22) -> int:
    """The (query, key <= query) pairs the main attention computes, summed over layout heads:
    per entry (tile, block, word) and query t of the tile whose bit is set, the block's keys
    up to the query, a chunk of entries at a time (at 1M tokens nothing [S, nk] fits)."""
    layout, words = selection
    rows = layout.entry_rows() % layout.num_q_blocks  # [nnz]
    bits = torch.arange(layout.q_block, device=rows.device)  # [q_block]
    total = 0
    for first in range(0, rows.numel(), chunk):
        part = slice(first, first + chunk)
        queries = rows[part, None] * layout.q_block + bits  # [n, q_block]
        first_keys = layout.col_indices[part, None].long() * layout.kv_block  # [n, 1]
        keys = (queries - first_keys + 1).clamp(0, layout.kv_block)  # [n, q_block]
        chosen = queries < seq_len
        if words is not None:
            chosen &= (words[part, None] >> bits & 1).bool()
        total += int((keys * chosen).sum())
    return total


def run_msa(
    seq_len: int, inputs: dict, granularity: str, q_block: int, proxies: str, scores: str
) -> tuple[dict, MsaSelection]:
    """msa_func forward + backward, whole and split; returns the record and the selection.
    Under granularity "token" q_block is only the main attention's query tile; scores "fp8"
    selects with FP8 scores."""
    leaves = [inputs[name] for name in ("q_proxy", "k_proxy", "q", "k", "v")]
    q_proxy, k_proxy, q, k, v = leaves
    dout = inputs["dout"]
    options = dict(top_k=TOP_K, q_block=q_block, kv_block=KV_BLOCK, granularity=granularity,
                   score_dtype=FP8 if scores == "fp8" else None)  # fmt: skip
    scale = HEAD_DIM**-0.5

    def step():
        out, kl_loss = msa_func(q_proxy, k_proxy, q, k, v, **options)
        torch.autograd.backward([out, kl_loss], [dout, None])

    def selection():
        return select(
            q_proxy, k_proxy, **options, proxy_softmax_scale=scale, warmup=False,
            document_ids=None, cu_seqlens=None,
        )  # fmt: skip

    total = timed(step, leaves)
    with torch.no_grad():
        selection_ms = timed(selection)["ms"]
        chosen, kl_chosen = selection()  # the main attention's and the KL's tiles
    free_memory()
    layout, query_masks = chosen
    main_ms = timed(
        lambda: block_sparse_attn_func(
            q, k, v, layout, causal=True, query_masks=query_masks
        ).backward(dout),
        [q, k, v],
    )["ms"]
    with torch.no_grad():
        lse = block_sparse_attn_func(
            q, k, v, layout, causal=True, return_lse=True, query_masks=query_masks
        )[1]
    kl_kernels_ms = timed(
        lambda: proxy_kl_loss(
            q_proxy, k_proxy, q, k, lse, kl_chosen.layout, softmax_scale=scale,
            proxy_softmax_scale=scale, query_masks=kl_chosen.query_masks,
        ).backward(),
        [q_proxy, k_proxy],
    )["ms"]  # fmt: skip
    # Each layout head serves H_q / H_p query heads; 3.5x the forward for forward + backward.
    pairs = attended_pairs(chosen, seq_len)
    main_flops = 3.5 * 4 * HEAD_DIM * pairs * (HEADS_Q // HEADS_PROXY)
    record = dict(
        seq_len=seq_len,
        impl="flash_msa",
        granularity=granularity,
        q_block=q_block,
        proxies=proxies,
        scores=scores,
        fwd_bwd_ms=round(total["ms"], 4),
        selection_ms=round(selection_ms, 4),
        main_attention_ms=round(main_ms, 4),
        kl_ms=round(total["ms"] - selection_ms - main_ms, 4),
        kl_kernels_ms=round(kl_kernels_ms, 4),
        main_attention_tflops=round(main_flops / main_ms / 1e9, 1),
        attended_pairs=pairs,
        density=layout.density,
        peak_gib=round(total["peak_gib"], 3),
    )
    print(
        f"S={seq_len:>8,} flash_msa {granularity:5s} q{q_block:<3d} {scores} {proxies} proxies "
        f"total {record['fwd_bwd_ms']:9.3f} ms = "
        f"selection {selection_ms:.3f} + main {main_ms:.3f} "
        f"({record['main_attention_tflops']} TF/s) + KL {record['kl_ms']:.3f} (kernels "
        f"{kl_kernels_ms:.3f}); peak {record['peak_gib']:.2f} GiB",
        flush=True,
    )
    return record, chosen


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


def tile_union(chosen: torch.Tensor, kv_block: int) -> BlockLayout:
    """The layout of FLEX_TOKEN_TILE-row query tiles over the kv blocks any of their tokens
    read, of per-token blocks chosen bool [H_p, S, nk]: flex's per-head block indices take
    [H_q, S / q_block, nk] int32 twice over (full and partial) and twice again transposed for
    the backward, 16 GiB at 128K for tiles of 8 rows."""
    heads, seq_len, kv_blocks = chosen.shape
    padded = -seq_len % FLEX_TOKEN_TILE
    tiles = torch.nn.functional.pad(chosen, (0, 0, 0, padded))  # [H_p, S', nk]
    tiles = tiles.view(heads, -1, FLEX_TOKEN_TILE, kv_blocks).any(2)  # [H_p, S' / tile, nk]
    return patterns.from_dense_mask(
        tiles, seq_len_q=seq_len, q_block=FLEX_TOKEN_TILE, kv_block=kv_block
    )


def flex_fwd_bwd(inputs: dict, selection: MsaSelection) -> tuple[dict, float]:
    """Compiled FlexAttention fwd+bwd over the selection (per-token ones through a mask_mod
    reading each token's blocks, over FLEX_TOKEN_TILE-row tiles), and the relative difference
    of its output from block_sparse_attn_func's."""
    q, k, v, dout = (inputs[name] for name in ("q", "k", "v", "dout"))
    layout, query_masks = selection
    flex_layout, chosen = layout, None
    if query_masks is not None:
        chosen = token_blocks(selection, q.shape[1])  # [H_p, S, nk]
        flex_layout = tile_union(chosen, layout.kv_block)
    block_mask = flex_block_mask(flex_layout, HEADS_Q, token_blocks=chosen)
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
        ours = block_sparse_attn_func(q, k, v, layout, causal=True, query_masks=query_masks)
        difference = relative_difference(out, ours)
    del out
    free_memory()
    return timed(lambda: forward().backward(dout), [q, k, v]), difference


def run_flex(seq_len: int, inputs: dict, selection: MsaSelection, granularity: str,
             proxies: str, main_ms: float) -> dict:  # fmt: skip
    """FlexAttention on flash_msa's selection (from `proxies`); recorded with its error when
    it fails (at 1M its per-head block indices alone take 32 GiB each)."""
    record = dict(seq_len=seq_len, impl="flex", granularity=granularity, proxies=proxies)
    if granularity == "token" and seq_len > FLEX_TOKEN_MASK_UP_TO:
        record["error"] = (
            f"not run: the per-token mask [H_p, S, S / {KV_BLOCK}] bool takes "
            f"{HEADS_PROXY * seq_len * seq_len // KV_BLOCK / 2**30:.0f} GiB"
        )
        print(f"S={seq_len:>8,} flex       {record['error']}", flush=True)
        return record
    try:
        timing, difference = flex_fwd_bwd(inputs, selection)
    except Exception as error:  # the peer's failure (memory, compilation) is recorded, not fatal
        timing, record["error"] = None, failure(error)
    free_memory()  # after the except block: its traceback no longer holds the tensors
    if timing is None:
        print(f"S={seq_len:>8,} flex {granularity:5s} failed: {record['error']}", flush=True)
        return record
    record.update(
        fwd_bwd_ms=round(timing["ms"], 4),
        rel_diff_vs_flash_msa=difference,
        peak_gib=round(timing["peak_gib"], 3),
    )
    print(
        f"S={seq_len:>8,} flex {granularity:5s} total {timing['ms']:9.3f} ms (main attention; "
        f"flash_msa's {main_ms:.3f}), rel. diff. {difference:.1e}",
        flush=True,
    )
    return record


def run_length(
    seq_len: int, device, dense_measured: dict, variants, flex: bool, proxies: list[str]
) -> list[dict]:
    """Dense cuDNN, then per kind of proxies each (granularity, q_block, scores) variant and, with
    flex, FlexAttention on the first variant's selection of each (proxies, granularity)."""
    records = [run_dense(seq_len, device, dense_measured)]
    peers_run = set()
    for kind in proxies:
        inputs = random_inputs(seq_len, device, kind)
        for granularity, q_block, scores in variants:
            msa, selection = run_msa(seq_len, inputs, granularity, q_block, kind, scores)
            free_memory()
            records.append(msa)
            if flex and (kind, granularity) not in peers_run:
                peers_run.add((kind, granularity))
                records.append(run_flex(seq_len, inputs, selection, granularity, kind,
                                        msa["main_attention_ms"]))  # fmt: skip
            del selection
            free_memory()
        del inputs
        free_memory()
    return records


def computed_cell(msa: dict) -> str:
    """Main TFLOP/s over the pairs its matmuls compute, whole tiles (q_block rows x kv_block
    keys per active block of the layout, the causal diagonal's included; the active blocks
    from the record's density), and the share of those pairs the selection holds; "-" for
    records from before attended_pairs was kept."""
    if "attended_pairs" not in msa:
        return "-"
    q_block = msa.get("q_block", Q_BLOCK)
    seq_len = msa["seq_len"]
    tiles = HEADS_PROXY * -(-seq_len // q_block) * -(-seq_len // KV_BLOCK)
    share = msa["attended_pairs"] / (round(msa["density"] * tiles) * q_block * KV_BLOCK)
    return f"{msa['main_attention_tflops'] / share:.1f} ({share:.3f})"


def msa_cells(msa: dict, peers: dict) -> list:
    """One flash_msa record's row: its parts, flex on a selection of the same granularity and
    proxies, dense cuDNN (peers: (impl, granularity or None, proxies) -> record, of the same
    length; records without proxies, dense ones among them, count as random's)."""
    proxies = msa.get("proxies", "random")
    flex = peers.get(("flex", msa["granularity"], proxies), {})
    dense = peers.get(("sdpa_cudnn", None, "random"))
    if "fwd_bwd_ms" in flex:
        flex_ms = f"{flex['fwd_bwd_ms']:.3f}"
        versus_flex = f"{flex['fwd_bwd_ms'] / msa['main_attention_ms']:.2f}x"
    else:
        flex_ms, versus_flex = failed_cell(flex) if "error" in flex else "-", "-"
    if dense is None:
        dense_ms = speedup = "-"
    else:
        dense_ms = f"{dense['fwd_bwd_ms']:,.1f}{'*' if dense['estimated'] else ''}"
        speedup = f"{dense['fwd_bwd_ms'] / msa['fwd_bwd_ms']:.1f}x"
    return [
        f"{msa['seq_len']:,}",
        msa["granularity"],
        msa.get("q_block", Q_BLOCK),
        proxies,
        msa.get("scores", "bf16"),
        f"{msa['fwd_bwd_ms']:.3f}",
        f"{msa['selection_ms']:.3f}",
        f"{msa['main_attention_ms']:.3f}",
        msa["main_attention_tflops"],
        computed_cell(msa),
        f"{msa['kl_ms']:.3f}",
        f"{msa['peak_gib']:.2f}",
        flex_ms,
        versus_flex,
        dense_ms,
        speedup,
    ]


def write_reports(records: list[dict], meta: dict, out_dir) -> None:
    peers: dict[int, dict] = {}
    for record in records:
        key = (record["impl"], record.get("granularity"), record.get("proxies", "random"))
        peers.setdefault(record["seq_len"], {})[key] = record
    columns = ["S", "granularity", "q_block", "proxies", "scores", "flash_msa ms", "selection ms",
               "main attention ms", "main TFLOP/s",
               "main TFLOP/s over the tiles computed (share of their pairs selected)", "KL ms",
               "peak GiB", "flex ms (main only)",
               "main speed-up vs flex (flex ms / main ms)", "cuDNN dense ms",
               "speed-up vs dense cuDNN (cuDNN ms / flash_msa ms)"]  # fmt: skip
    rows = [
        (record, msa_cells(record, peers[record["seq_len"]]))
        for record in records
        if record["impl"] == "flash_msa" and "granularity" in record
    ]
    write_report(
        out_dir,
        "msa",
        records,
        meta=meta,
        title="MSA training step: selection, main attention, KL",
        notes=f"bf16, B=1, H_q={HEADS_Q}, H_kv={HEADS_KV}, D={HEAD_DIM}; proxy H_p={HEADS_PROXY}, "
        f"H_pk={HEADS_PROXY_KEYS}, D_p={PROXY_HEAD_DIM}; top_k {TOP_K}, kv_block {KV_BLOCK}; "
        "causal. Granularity token: each query token's own blocks (MiniMax's; q_block is "
        "then the main attention's query tile: the union of its tokens' blocks with a bit "
        "per token, or for q_block 1 a row per token over exactly its blocks); block: one "
        f"choice per {Q_BLOCK}-query block. Proxies random: i.i.d. normal (an untrained "
        "proxy, each token's choices independent of its neighbours'); local: keys a moving "
        f"average of noise over {LOCAL_WINDOW} tokens, queries their own key plus noise "
        "(recent blocks chosen, neighbours' choices overlapping). Forward + backward ms, "
        "medians of do_bench. KL = total minus selection and main attention. Main TFLOP/s over the "
        "(query, key <= query) pairs the selection holds, and over the pairs its matmuls "
        "compute: q_block rows x kv_block keys of every block of the layout (per token: the "
        "union of the tile's tokens' blocks), the causal diagonal's whole. Flex runs the main "
        "attention only, on the same selection (per token: a mask_mod reading each token's "
        f"blocks over {FLEX_TOKEN_TILE}-row tiles of their union, every block partial), with "
        "tiles of 32 and 64 query rows. Dense figures marked * are estimated from 128K "
        "(x (S / 128K)^2).",
        body=markdown_table(columns, rows),
    )


def record_key(record: dict) -> tuple:
    """What a record measures: (seq_len, impl, granularity, q_block, proxies, scores), the
    proxies and scores of records from before those keys existed being random and bf16."""
    return (record["seq_len"], record["impl"], record.get("granularity"), record.get("q_block"),
            record.get("proxies", "random"), record.get("scores", "bf16"))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-lens", default="32k,128k,1m", help="e.g. 32k,128k,1m")
    parser.add_argument("--granularities", default=",".join(GRANULARITIES))
    parser.add_argument(
        "--token-q-blocks", default="16", help="query tiles of granularity token, e.g. 16,64"
    )
    parser.add_argument("--no-flex", action="store_true", help="leave FlexAttention out")
    parser.add_argument(
        "--scores", default="bf16", help="score dtypes each variant runs with: bf16, fp8 or both"
    )
    parser.add_argument("--proxies", default="random", help=f"some of {','.join(PROXIES)}")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    scores_run = args.scores.split(",")
    if set(scores_run) - {"bf16", "fp8"}:
        parser.error(f"--scores takes bf16, fp8 or bf16,fp8, got {args.scores!r}")
    granularities = args.granularities.split(",")
    variants = [
        (granularity, q_block, scores)
        for granularity in granularities
        for q_block in (
            [int(text) for text in args.token_q_blocks.split(",")]
            if granularity == "token"
            else [Q_BLOCK]
        )
        for scores in scores_run
    ]
    proxies = args.proxies.split(",")
    if set(proxies) - set(PROXIES):
        parser.error(f"--proxies takes some of {','.join(PROXIES)}, got {args.proxies!r}")
    device = torch.device("cuda")
    meta = run_metadata(device)
    out_dir = results_dir(args.out, device)
    seq_lens = sorted(parse_length(text) for text in args.seq_lens.split(","))
    flex = not args.no_flex  # run_length's flex records
    measured = [
        *((s, impl, None, None, "random", "bf16") for s in seq_lens
          for impl in ("sdpa_cudnn", "flash_msa", "flex")),  # dense, and pre-granularity rows
        *((s, "flash_msa", granularity, q_block, kind, scores) for s in seq_lens
          for kind in proxies for granularity, q_block, scores in variants),
        *((s, "flex", granularity, None, kind, "bf16") for s in seq_lens for kind in proxies
          for granularity in granularities if flex),
    ]  # fmt: skip
    records = kept_records(out_dir / "msa.json", record_key, measured)
    dense_measured = {}
    for seq_len in seq_lens:
        records += [
            {**record, **meta}
            for record in run_length(
                seq_len, device, dense_measured, variants, flex, proxies
            )
        ]
        records.sort(key=lambda record: record["seq_len"])
        write_reports(records, meta, out_dir)  # partial results survive a timeout
    print(f"wrote {out_dir}/msa.json and msa.md")


if __name__ == "__main__":
    main()
