"""What the benchmarks share: cases, the peers' masks, timing, run metadata and reports.

Every script imports this module and the flash_msa package, never another script.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import os
import pathlib
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import triton

from flash_msa import patterns
from flash_msa.layout import BlockLayout

K, M = 1024, 1024 * 1024
HEAD_DIM = 128
ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---- cases ---------------------------------------------------------------------------


def parse_length(text: str) -> int:
    """'32k' -> 32768, '1m' -> 1048576, '5000' -> 5000."""
    text = text.strip().lower()
    units = {"k": K, "m": M}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


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


def causal_layout(seq_len: int, device) -> BlockLayout:
    return patterns.causal(seq_len, device=device)


class Case(NamedTuple):
    seq_len: int
    heads_q: int
    heads_kv: int
    layout: Callable[[int, object], BlockLayout]  # (seq_len, device) -> layout
    dense: bool  # dense peers (FA4, SDPA) run too: the S x S attention fits


# bf16, B=1, D=128, block 128, causal
CASES = {
    "causal-32k": Case(32 * K, 16, 16, causal_layout, True),
    "causal-128k": Case(128 * K, 16, 16, causal_layout, True),
    "window-128k": Case(128 * K, 16, 16, window_layout, True),
    "window-1m": Case(M, 16, 16, window_layout, False),
    "topk16-128k": Case(128 * K, 16, 16, topk_layout, True),
    "topk16-1m": Case(M, 16, 16, topk_layout, False),
    "topk16-gqa32x8-128k": Case(128 * K, 32, 8, topk_layout, False),
    "topk16-gqa64x4-128k": Case(128 * K, 64, 4, topk_layout, False),
}

# name -> document lengths (packed back to back, causal within each), H = 16
VARLEN_CASES = {
    "varlen-1x128k": [128 * K],
    "varlen-16x8k": [8 * K] * 16,
    "varlen-skewed-128k": [64 * K, 32 * K, 16 * K, 8 * K, 4 * K, 2 * K, K, K],
}


def random_tensors(
    seq_len: int, heads: dict[str, int], *, device, requires_grad: Iterable[str], seed: int = 1
) -> dict[str, torch.Tensor]:
    """bf16 [1, S, H, D] tensors named as in heads (name -> H), drawn in that order from one
    seed; those named in requires_grad require grad."""
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {
        name: torch.randn(
            1, seq_len, count, HEAD_DIM, generator=generator, device=device, dtype=torch.bfloat16
        )
        for name, count in heads.items()
    }
    for name in requires_grad:
        tensors[name].requires_grad_()
    return tensors


def random_inputs(seq_len: int, heads_q: int, heads_kv: int, device):
    """q [1, S, H_q, D], k, v [1, S, H_kv, D] (requiring grad) and dout like q."""
    heads = dict(q=heads_q, k=heads_kv, v=heads_kv, dout=heads_q)
    tensors = random_tensors(seq_len, heads, device=device, requires_grad=("q", "k", "v"))
    return tuple(tensors.values())


# ---- peers ---------------------------------------------------------------------------


def compiled_flex():
    """flex_attention compiled with dynamic=False (after a second shape, automatic dynamic
    shapes would slow its kernels), with dynamo's caches cleared."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    return torch.compile(flex_attention, dynamic=False)


def flex_block_mask(layout: BlockLayout, heads_q: int):
    """The layout as a FlexAttention BlockMask of the same (q_block, kv_block) tiles under a
    causal mask_mod: the blocks holding the causal diagonal are partial (mask_mod applied),
    the others full (no mask work), the split create_block_mask makes and FlashAttention-4's
    FLASH backend requires (it refuses partial blocks alone). Indices [B, H, nq, nk] with
    B = layout_batch and H = 1 for a shared layout, else H_q (query head h reads layout
    head h // (H_q / layout_heads))."""
    from torch.nn.attention.flex_attention import BlockMask

    device, num_rows = layout.device, layout.num_layouts * layout.num_q_blocks
    rows = layout.entry_rows()  # [nnz] flat row: layout * nq + query block
    query_blocks = rows % layout.num_q_blocks
    # A block needs the causal mask when its last key comes after its first query.
    partial = (layout.col_indices.long() + 1) * layout.kv_block - 1 > query_blocks * layout.q_block

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

    def causal(batch, head, q_index, kv_index):
        return q_index >= kv_index

    partial_counts, partial_indices = ordered(partial)
    full_counts, full_indices = ordered(~partial)
    return BlockMask.from_kv_blocks(
        partial_counts,
        partial_indices,
        full_counts,
        full_indices,
        BLOCK_SIZE=(layout.q_block, layout.kv_block),
        mask_mod=causal,
        seq_lengths=(layout.seq_len_q, layout.seq_len_kv),
    )


def failure(error: BaseException) -> str:
    """A peer's error as one line for the records: its type and first line."""
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:200]}".replace("|", "/")  # for markdown tables


def failed_cell(record: dict) -> str:
    """A report cell for a record that holds a failure (the full text is in the JSON)."""
    return f"failed: {record['error'][:80]}"


# ---- timing --------------------------------------------------------------------------


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def timed(step: Callable[[], object], grad_to_none=None) -> dict:
    """Median ms of step over do_bench's runs, and the peak memory of those runs in GiB."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    ms = triton.testing.do_bench(
        step, warmup=100, rep=500, grad_to_none=grad_to_none, return_mode="median"
    )
    return dict(ms=ms, peak_gib=torch.cuda.max_memory_allocated() / 2**30)


def wall_ms(build: Callable[[], object], device: torch.device, repeats: int):
    """Median synchronised wall time of build() in ms over repeats calls (after one), and the
    last result: for work with host steps, such as building a layout."""
    result, samples = build(), []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = build()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(1e3 * (time.perf_counter() - start))
    return statistics.median(samples), result


def relative_difference(actual: torch.Tensor, expected: torch.Tensor, chunk: int = 64 * K):
    """||actual - expected|| / ||expected|| over [B, S, ...], in fp32 a chunk of S at a time."""
    error = norm = 0.0
    for start in range(0, expected.shape[1], chunk):
        a, e = (t[:, start : start + chunk].detach().float() for t in (actual, expected))
        error += float((a - e).square().sum())
        norm += float(e.square().sum())
    return (error / norm) ** 0.5


# ---- runs ----------------------------------------------------------------------------


def source_digest() -> str:
    """sha256 of flash_msa/**/*.py concatenated in byte order of their paths, 12 hex digits:
    the same as benchmarks/gpu_tests.sh writes, and right where a copied tree has no .git."""
    digest = hashlib.sha256()
    paths = sorted(path.relative_to(ROOT).as_posix() for path in ROOT.glob("flash_msa/**/*.py"))
    for path in paths:
        digest.update((ROOT / path).read_bytes())
    return digest.hexdigest()[:12]


def commit() -> str:
    """FLASH_MSA_COMMIT where set (a copied tree's .git may be stale or absent), else git's
    short HEAD of this repository, else "unknown"."""
    if os.environ.get("FLASH_MSA_COMMIT"):
        return os.environ["FLASH_MSA_COMMIT"]
    try:
        top, head = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, ValueError, subprocess.CalledProcessError):
        return "unknown"
    return head if pathlib.Path(top).resolve() == ROOT else "unknown"


def run_metadata(device: torch.device) -> dict:
    """The device and its memory, torch and triton versions, the date, the commit and the
    digest of flash_msa's sources: merged into every record of the run."""
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
        commit=commit(),
        source_sha256=source_digest(),
    )


def results_dir(out: str | None, device: torch.device) -> pathlib.Path:
    """out, or benchmarks/results/<gpu>/ (e.g. h200; cpu on the CPU), created if missing."""
    if out is None:
        gpu = device.type == "cuda"
        folder = torch.cuda.get_device_name(device).split()[-1].lower() if gpu else "cpu"
        out = ROOT / "benchmarks" / "results" / folder
    path = pathlib.Path(out)
    path.mkdir(parents=True, exist_ok=True)
    return path


def kept_records(path: pathlib.Path, key: Callable[[dict], object], measured) -> list[dict]:
    """The records (a JSON list at path, if any) whose key is not among those this run
    measures: a run of some cases keeps the latest figures of the others."""
    measured = set(measured)
    earlier = json.loads(path.read_text()) if path.exists() else []
    return [record for record in earlier if key(record) not in measured]


# ---- reports -------------------------------------------------------------------------


def markdown_table(columns: list[str], rows: list[tuple[dict, list]]) -> list[str]:
    """Table lines; rows are (record, cells), and each row ends with its record's commit
    ("-" for records from before commits were recorded)."""
    lines = ["| " + " | ".join([*columns, "commit"]) + " |", "|" + "---|" * (len(columns) + 1)]
    for record, cells in rows:
        lines.append("| " + " | ".join([*map(str, cells), record.get("commit", "-")]) + " |")
    return lines


def write_report(
    out_dir: pathlib.Path,
    name: str,
    records: list[dict],
    *,
    meta: dict,
    title: str,
    notes: str,
    body: list[str],
) -> None:
    """out_dir/name.json (the records) and name.md: the title, this run's device, versions,
    date and commit, the notes, then body (markdown lines, e.g. from markdown_table)."""
    (out_dir / f"{name}.json").write_text(json.dumps(records, indent=1) + "\n")
    run = (
        f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}; latest run "
        f"{meta['date']} at commit {meta.get('commit', '-')}. {notes} Each row's commit is in "
        f"its last column, its date and source digest in {name}.json."
    )
    (out_dir / f"{name}.md").write_text("\n".join([f"# {title}", "", run, "", *body]) + "\n")


def write_chart(
    path: pathlib.Path,
    categories: list[str],
    panels: dict[str, dict[str, list[float]]],
    *,
    ylabel: str,
    title: str,
    reference: float | None = None,
) -> None:
    """A PNG of grouped bars: one panel per entry of panels (panel title -> series name ->
    one value per category; 0 draws no bar), a dashed line at reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
