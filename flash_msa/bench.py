"""Side-by-side measurement of flash-msa and its peers: the standard layouts, the peers' masks
(FlexAttention's BlockMask of the same blocks, SDPA's dense mask), timing, FLOP counts and
the bar chart. `flash-msa bench` runs these; the scripts under benchmarks/ share them."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import os
import pathlib
import platform
import statistics
import subprocess
from collections.abc import Callable, Iterable

import torch
import triton

from flash_msa import _env, patterns
from flash_msa.layout import BlockLayout
from flash_msa.ops.fastest import elapsed_ms
from flash_msa.ops.interface import block_sparse_attn_func, block_sparse_attn_varlen_func
from flash_msa.reference import layout_mask
from flash_msa.sequences import document_ids_of

K, M = 1024, 1024 * 1024
FWD_BWD_FLOPS = 3.5  # forward + backward FLOPs over the forward's (the backward recomputes P)


# ---- layouts -------------------------------------------------------------------------


def parse_length(text: str) -> int:
    """'32k' -> 32768, '1m' -> 1048576, '5000' -> 5000."""
    text = text.strip().lower()
    units = {"k": K, "m": M}
    try:
        return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a token count: write e.g. 4096, 32k or 1m (k = 1024, m = 1024^2)"
        ) from None


def topk_layout(seq_len: int, device) -> BlockLayout:
    """16 blocks per row: its own, the previous one, and 14 random earlier blocks."""
    blocks = -(-seq_len // 128)
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


def causal_layout(seq_len: int, device) -> BlockLayout:
    """Every causal pair: dense causal attention."""
    return patterns.causal(seq_len, device=device)


def document_lengths(seq_len: int) -> list[int]:
    """Four packed documents of halving lengths: S/2, S/4, S/8 and the rest."""
    lengths = [seq_len // 2, seq_len // 4, seq_len // 8]
    return [*lengths, seq_len - sum(lengths)]


@dataclasses.dataclass(frozen=True)
class Case:
    """One layout at one length, causal: what flash-msa computes and its peers must match."""

    name: str
    layout: BlockLayout
    cu_seqlens: torch.Tensor | None  # int32 [N + 1] of packed documents, or None
    dense_causal: bool  # every causal pair: SDPA's causal kernels compute the same

    @property
    def document_ids(self) -> torch.Tensor | None:
        """int32 [S]: each token's document, or None."""
        return None if self.cu_seqlens is None else document_ids_of(self.cu_seqlens)

    def flops(self, heads_q: int, head_dim: int) -> float:
        """Forward FLOPs over the computed pairs: the layout's active blocks, or for causal
        documents (one of S tokens for dense causal) half of each document's square, the
        count FlashAttention reports."""
        if self.dense_causal or self.cu_seqlens is not None:
            bounds = (
                [0, self.layout.seq_len_q] if self.cu_seqlens is None else self.cu_seqlens.tolist()
            )
            lengths = [end - start for start, end in zip(bounds, bounds[1:], strict=False)]
            return sum(4 * head_dim * length * length / 2 for length in lengths) * heads_q
        return self.layout.flops(head_dim) * heads_q


# name -> what the layout keeps, in a sentence for --help and the reports
LAYOUTS = {
    "window": "sliding window of 4096 tokens + 128 sink tokens",
    "topk": "top-k 16 blocks of 128 per row: its own, the previous one, 14 random earlier ones",
    "causal": "dense causal",
    "documents": "4 packed documents (S/2, S/4, S/8 and the rest), causal within each (varlen)",
}


def build_case(name: str, seq_len: int, device) -> Case:
    """The Case of a LAYOUTS name at seq_len tokens on device."""
    if name == "documents":
        bounds = [0]
        for length in document_lengths(seq_len):
            bounds.append(bounds[-1] + length)
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
        layout = patterns.causal(seq_len, cu_seqlens=cu_seqlens, device=device)
        return Case(name, layout, cu_seqlens, dense_causal=False)
    builders = {"window": window_layout, "topk": topk_layout, "causal": causal_layout}
    if name not in builders:
        raise ValueError(f"unknown layout {name!r}: choose among {', '.join(LAYOUTS)}")
    return Case(name, builders[name](seq_len, device), None, dense_causal=name == "causal")


def random_tensors(
    seq_len: int,
    heads: dict[str, int],
    *,
    head_dim: int,
    dtype: torch.dtype,
    device,
    requires_grad: Iterable[str],
    seed: int = 1,
) -> dict[str, torch.Tensor]:
    """[1, S, H, D] tensors named as in heads (name -> H), drawn in that order from one seed;
    those named in requires_grad require grad."""
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {
        name: torch.randn(
            1, seq_len, count, head_dim, generator=generator, device=device, dtype=dtype
        )
        for name, count in heads.items()
    }
    for name in requires_grad:
        tensors[name].requires_grad_()
    return tensors


def random_inputs(seq_len: int, heads_q: int, heads_kv: int, device, *, head_dim: int, dtype):
    """q [1, S, H_q, D], k, v [1, S, H_kv, D] (requiring grad) and dout like q."""
    heads = dict(q=heads_q, k=heads_kv, v=heads_kv, dout=heads_q)
    tensors = random_tensors(
        seq_len, heads, head_dim=head_dim, dtype=dtype, device=device,
        requires_grad=("q", "k", "v"),
    )  # fmt: skip
    return tuple(tensors.values())


# ---- peers ---------------------------------------------------------------------------


def compiled_flex():
    """flex_attention compiled with dynamic=False (after a second shape, automatic dynamic
    shapes would slow its kernels), with dynamo's caches cleared."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    return torch.compile(flex_attention, dynamic=False)


def flex_block_mask(
    layout: BlockLayout,
    heads_q: int,
    document_ids: torch.Tensor | None = None,
    token_blocks: torch.Tensor | None = None,
    *,
    causal: bool = True,
):
    """The layout as a FlexAttention BlockMask of the same (q_block, kv_block) tiles under a
    causal mask_mod (and, with document_ids int [S], one of a single document): the blocks
    holding the causal diagonal or a document boundary are partial (mask_mod applied), the
    others full (no mask work), the split create_block_mask makes and FlashAttention-4's
    FLASH backend requires (it refuses partial blocks alone). Indices [B, H, nq, nk] with
    B = layout_batch and H = 1 for a shared layout, else H_q (query head h reads layout
    head h // (H_q / layout_heads)). token_blocks, bool [layout_heads, S, nk] (layout_batch 1):
    per query token the kv blocks it reads (MSA's per-token selection): every block is partial
    and the mask_mod reads it. With causal=False every block is full, under a mask_mod that
    keeps the pairs inside the sequence: FlexAttention masks a ragged last block itself, and
    its FLASH backend reads the block indices only under a mask_mod that is not trivial
    (under none it attends to every block)."""
    from torch.nn.attention.flex_attention import BlockMask

    if not causal and (document_ids is not None or token_blocks is not None):
        raise ValueError(
            "flex_block_mask with causal=False masks no pairs inside its blocks: "
            "document_ids and token_blocks need causal=True"
        )
    device, num_rows = layout.device, layout.num_layouts * layout.num_q_blocks
    rows = layout.entry_rows()  # [nnz] flat row: layout * nq + query block
    query_blocks = rows % layout.num_q_blocks
    first_keys = layout.col_indices.long() * layout.kv_block  # [nnz]
    # Under causal a block needs the mask when its last key comes after its first query.
    partial = causal & (first_keys + layout.kv_block - 1 > query_blocks * layout.q_block)
    if document_ids is not None:
        # Documents are contiguous: a block before the diagonal lies in one document when its
        # first key and its last query do.
        last_queries = ((query_blocks + 1) * layout.q_block).clamp(max=layout.seq_len_q) - 1
        partial |= document_ids[first_keys] != document_ids[last_queries]

    def ordered(chosen):  # counts [B, H, nq], indices [B, H, nq, nk]: the chosen ones first
        chosen_rows = rows[chosen]
        counts = torch.bincount(chosen_rows, minlength=num_rows)
        starts = counts.cumsum(0) - counts
        slots = torch.arange(chosen_rows.numel(), device=device) - starts[chosen_rows]
        # Slots past a row's count are never read: zeros keep them in range.
        indices = torch.zeros(num_rows, layout.num_kv_blocks, dtype=torch.int32, device=device)
        indices[chosen_rows, slots] = layout.col_indices[chosen]
        return per_head(counts.int()), per_head(indices)

    def per_head(tensor):  # [L * nq, ...] -> [B, H, nq, ...]
        tensor = tensor.view(
            layout.layout_batch, layout.layout_heads, layout.num_q_blocks, *tensor.shape[1:]
        )
        if layout.layout_heads == 1:
            return tensor
        return tensor.repeat_interleave(heads_q // layout.layout_heads, dim=1)

    def in_sequence(batch, head, q_index, kv_index):
        return (q_index < layout.seq_len_q) & (kv_index < layout.seq_len_kv)

    def causal_pairs(batch, head, q_index, kv_index):
        return q_index >= kv_index

    def causal_documents(batch, head, q_index, kv_index):
        return (q_index >= kv_index) & (document_ids[q_index] == document_ids[kv_index])

    if not causal:
        mask_mod = in_sequence
    else:
        mask_mod = causal_pairs if document_ids is None else causal_documents
    if token_blocks is not None:
        group = heads_q // token_blocks.shape[0]
        partial = torch.ones_like(partial)

        def mask_mod(batch, head, q_index, kv_index):
            chosen = token_blocks[head // group, q_index, kv_index // layout.kv_block]
            return (q_index >= kv_index) & chosen

    partial_counts, partial_indices = ordered(partial)
    full_counts, full_indices = ordered(~partial)
    return BlockMask.from_kv_blocks(
        partial_counts,
        partial_indices,
        full_counts,
        full_indices,
        BLOCK_SIZE=(layout.q_block, layout.kv_block),
        mask_mod=mask_mod,
        seq_lengths=(layout.seq_len_q, layout.seq_len_kv),
    )


def dense_mask_bytes(seq_len: int, dtype: torch.dtype) -> int:
    """Memory of SDPA on a dense [S, S] mask: the bool mask, the temporaries of building it
    (three more), and the additive mask SDPA converts it to in dtype."""
    return seq_len * seq_len * (4 + torch.finfo(dtype).bits // 8)


def failure(error: BaseException) -> str:
    """A peer's error as one line for the records: its type and first line."""
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:200]}".replace("|", "/")  # for markdown tables


# impl -> what it is, in the reports
IMPLS = {
    "flash_msa": "flash-msa",
    "flex": "FlexAttention (compiled), the same blocks and element masks",
    "sdpa": "SDPA: dense causal (cuDNN or flash on CUDA) for dense causal, else a dense "
    "boolean mask of the same pairs",
}


def implementations(
    case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str
) -> dict[str, Callable[[], torch.Tensor] | str]:
    """impl -> a zero-argument call returning out [1, S, H_q, D] on q, k, v [1, S, H, D] (so
    the gradients reach them), or the reason the impl is skipped."""
    device, seq_len = q.device, q.shape[1]
    group = q.shape[2] // k.shape[2]
    layout, document_ids = case.layout, case.document_ids
    if case.cu_seqlens is None:

        def flash_msa():
            return block_sparse_attn_func(q, k, v, layout, causal=True, backend=backend)

    else:
        longest = max(document_lengths(seq_len))

        def flash_msa():
            out = block_sparse_attn_varlen_func(
                q[0], k[0], v[0], case.cu_seqlens, longest, layout, causal=True, backend=backend
            )
            return out[None]

    calls: dict[str, Callable[[], torch.Tensor] | str] = {"flash_msa": flash_msa}
    q_t, k_t, v_t = (t.transpose(1, 2) for t in (q, k, v))  # flex and SDPA take [B, H, S, D]
    if device.type == "cuda":
        flex, block_mask = compiled_flex(), flex_block_mask(layout, q.shape[2], document_ids)

        def flex_attention():
            out = flex(q_t, k_t, v_t, block_mask=block_mask, enable_gqa=group > 1)
            return out.transpose(1, 2)

        calls["flex"] = flex_attention
    else:
        calls["flex"] = "no CUDA device: FlexAttention's compiled kernels are measured on a GPU"
    calls["sdpa"] = _sdpa(case, q_t, k_t, v_t, group)
    return calls


def _sdpa(case: Case, q_t, k_t, v_t, group: int) -> Callable[[], torch.Tensor] | str:
    """SDPA on q_t [1, H_q, S, D], k_t, v_t [1, H_kv, S, D]: causal through cuDNN / flash on
    CUDA for dense causal; else on a dense bool mask of the case's pairs where it fits."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    device, seq_len = q_t.device, q_t.shape[2]
    on_gpu = device.type == "cuda"
    if case.dense_causal:
        kernels = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]

        def causal():
            with sdpa_kernel(kernels, set_priority=True) if on_gpu else contextlib.nullcontext():
                out = scaled_dot_product_attention(
                    q_t, k_t, v_t, is_causal=True, enable_gqa=group > 1
                )
            return out.transpose(1, 2)

        return causal
    needed, free = dense_mask_bytes(seq_len, q_t.dtype), _env.available_bytes(device)
    if needed > free / 2:
        return (
            f"a dense {seq_len} x {seq_len} mask needs {needed / 2**30:.1f} GiB, more than "
            f"half the {free / 2**30:.1f} GiB free"
        )
    document_ids = case.document_ids
    mask = layout_mask(
        case.layout, 1, 1, causal=True,
        document_ids=None if document_ids is None else document_ids[None],
    )  # fmt: skip  # [1, 1, S, S]
    # The masked kernels (memory-efficient, cuDNN) take no GQA: keys and values are repeated
    # per query head inside the call; the math kernel would hold H_q x S x S scores.
    kernels = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]

    def masked():
        keys, values = (t.repeat_interleave(group, dim=1) for t in (k_t, v_t))
        with sdpa_kernel(kernels) if on_gpu else contextlib.nullcontext():
            out = scaled_dot_product_attention(q_t, keys, values, attn_mask=mask)
        return out.transpose(1, 2)

    return masked


# ---- timing --------------------------------------------------------------------------


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def wall_ms(build: Callable[[], object], device: torch.device, repeats: int):
    """Median synchronised wall time of build() in ms over repeats calls (after one), and the
    last result: for work with host steps, such as building a layout."""
    result, samples = build(), []
    for _ in range(repeats):
        ms, result = elapsed_ms(build, device)
        samples.append(ms)
    return statistics.median(samples), result


def timed(step: Callable[[], object], grad_to_none=None, *, device=None) -> dict:
    """Median ms of step, after one call. On CUDA (device None or a CUDA device) over
    do_bench's runs, with the peak memory of those runs in GiB; on the CPU over wall-clock
    runs, as many as fill about half a second (3 to 100). The tensors of grad_to_none have
    their .grad set to None before every call, warm-up calls included: a gradient from the
    call before would otherwise be added to, with both alive at once."""

    def run():
        for tensor in grad_to_none or ():
            tensor.grad = None
        return step()

    if device is None or torch.device(device).type == "cuda":
        run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ms = triton.testing.do_bench(run, warmup=100, rep=500, return_mode="median")
        return dict(ms=ms, peak_gib=torch.cuda.max_memory_allocated() / 2**30)

    cpu = torch.device("cpu")
    first_ms, _ = wall_ms(run, cpu, repeats=1)
    repeats = min(100, max(3, int(500 / max(first_ms, 1e-3))))
    return dict(ms=wall_ms(run, cpu, repeats)[0])


def relative_difference(actual: torch.Tensor, expected: torch.Tensor, chunk: int = 64 * K):
    """||actual - expected|| / ||expected|| over [B, S, ...], in fp32 a chunk of S at a time."""
    error = norm = 0.0
    for start in range(0, expected.shape[1], chunk):
        a, e = (t[:, start : start + chunk].detach().float() for t in (actual, expected))
        error += float((a - e).square().sum())
        norm += float(e.square().sum())
    return (error / norm) ** 0.5


def measure(
    calls: dict[str, Callable[[], torch.Tensor] | str],
    impl: str,
    inputs: tuple[torch.Tensor, ...],
    *,
    modes: tuple[str, ...],
    flops: float,
    reference: torch.Tensor | None,
) -> tuple[dict, torch.Tensor | None]:
    """One impl of calls timed in modes ("fwd", "fwd_bwd") on inputs (q, k, v, dout): a record
    of ms, TFLOP/s over flops (the forward's) and, for a peer, its output's relative
    difference from reference (flash-msa's); a skip or a failure as its reason. Returns the
    record and the impl's output."""
    call = calls[impl]
    if isinstance(call, str):
        return dict(skipped=call), None
    q, k, v, dout = inputs
    record: dict = {}
    try:
        with torch.no_grad():
            out = call()
        if reference is not None:
            record["rel_diff_vs_flash_msa"] = relative_difference(out, reference)
        for mode in modes:
            step = call if mode == "fwd" else lambda: call().backward(dout)
            timing = timed(step, [q, k, v], device=q.device)
            factor = 1.0 if mode == "fwd" else FWD_BWD_FLOPS
            record[f"{mode}_ms"] = timing["ms"]
            record[f"{mode}_tflops"] = factor * flops / timing["ms"] / 1e9
            if "peak_gib" in timing:
                record[f"{mode}_peak_gib"] = timing["peak_gib"]
    except Exception as error:  # a peer's failure is recorded, not fatal; flash-msa's is
        if impl == "flash_msa":
            raise
        return dict(record, error=failure(error)), None
    finally:
        free_memory()
    return record, out


def speedups(records: list[dict]) -> None:
    """Adds to each peer's record flash-msa's speed-up over it per mode (peer ms / flash-msa
    ms: above 1 flash-msa is faster), where both were timed."""
    ours = {r["layout"]: r for r in records if r["impl"] == "flash_msa"}
    for record in records:
        base = ours.get(record["layout"])
        if record["impl"] == "flash_msa" or base is None:
            continue
        for mode in ("fwd", "fwd_bwd"):
            if f"{mode}_ms" in record and f"{mode}_ms" in base:
                record[f"{mode}_speedup"] = record[f"{mode}_ms"] / base[f"{mode}_ms"]


# ---- reports -------------------------------------------------------------------------


def source_commit() -> str:
    """FLASH_MSA_COMMIT where set (a copied tree's .git may be stale or absent), else git's
    short HEAD of the repository this package sits in, with "+modified" where the package's
    files differ from it (uncommitted changes, or a .git older than the tree), else
    "unknown"."""
    if os.environ.get("FLASH_MSA_COMMIT"):
        return os.environ["FLASH_MSA_COMMIT"]
    root = pathlib.Path(__file__).resolve().parents[1]

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                              timeout=10)  # fmt: skip

    try:
        found = git("rev-parse", "--show-toplevel", "--short", "HEAD")
        top, head = found.stdout.split() if found.returncode == 0 else ("", "")
        if not head or pathlib.Path(top).resolve() != root:
            return "unknown"
        changed = git("diff", "--quiet", "HEAD", "--", "flash_msa").returncode != 0
    except (OSError, ValueError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}+modified" if changed else head


def device_metadata(device: torch.device) -> dict:
    """The device and its memory, torch and triton versions and the date."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        processor = platform.processor() or platform.machine()
        name = f"CPU ({processor}, {torch.get_num_threads()} threads)"
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return dict(
        device=name,
        memory_gib=round(memory / 2**30, 1),
        torch=torch.__version__,
        triton=triton.__version__,
        date=datetime.date.today().isoformat(),
    )


def pyplot():
    """matplotlib.pyplot on the Agg backend, or an error naming the extra that installs it."""
    try:
        import matplotlib
    except ImportError as error:
        raise ModuleNotFoundError(
            "the bar chart needs matplotlib: pip install 'flash-msa[plot]'", name="matplotlib"
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_chart(
    path,
    categories: list[str],
    panels: dict[str, dict[str, list[float]]],
    *,
    ylabel: str,
    title: str,
    reference: float | None = None,
) -> None:
    """A PNG of grouped bars: one panel per entry of panels (panel title -> series name ->
    one value per category; 0 draws no bar), a dashed line at reference."""
    plt = pyplot()
    figure, axes = plt.subplots(
        1, len(panels), figsize=(max(10, 2.4 * len(categories)), 4.5), sharey=True, squeeze=False
    )
    for axis, (panel, series) in zip(axes[0], panels.items(), strict=True):
        width = 0.8 / len(series)
        for index, (label, values) in enumerate(series.items()):
            axis.bar(
                [x + index * width for x in range(len(categories))], values, width, label=label
            )
        if reference is not None:
            axis.axhline(reference, color="black", linestyle="--", linewidth=1)
        axis.set_xticks(
            [x + 0.4 - width / 2 for x in range(len(categories))],
            categories,
            rotation=30,
            ha="right",
        )
        axis.set_title(panel)
    axes[0][0].set_ylabel(ylabel)
    axes[0][0].legend()
    figure.suptitle(title)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)
