"""What the benchmarks share: cases, run metadata and reports, and (re-exported from
flash_msa.bench, which `flash-msa bench` uses too) the layouts, the peers' masks, timing and
the bar chart.

Every script imports this module and the flash_msa package, never another script.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import pathlib
import re
from collections.abc import Callable
from typing import NamedTuple

import torch

from flash_msa import bench, patterns
from flash_msa.bench import (  # noqa: F401  (re-exported: the scripts import them from here)
    K,
    M,
    causal_layout,
    compiled_flex,
    failure,
    flex_block_mask,
    free_memory,
    parse_length,
    relative_difference,
    timed,
    topk_layout,
    wall_ms,
    window_layout,
    write_chart,
)
from flash_msa.layout import BlockLayout

HEAD_DIM = 128
ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---- cases ---------------------------------------------------------------------------


def msa_layout(seq_len: int, device) -> BlockLayout:
    """MSA's main attention, block-shared: per kv head (4 layout heads) and query block of
    64, its own kv block of 128 and the 15 best earlier ones by random scores, causal."""
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (4, -(-seq_len // 64), -(-seq_len // 128))
    scores = torch.rand(shape, device=device, generator=generator)
    return patterns.topk(scores, 16, seq_len_q=seq_len, q_block=64, kv_block=128,
                         fixed_counts=True)  # fmt: skip


def longformer_layout(seq_len: int, device) -> BlockLayout:
    """Longformer, non-causal: a sliding window of 2048 tokens on each side (the keys at
    most 2048 tokens from the query: 33 blocks a row) and 128 global tokens, which every
    query sees and which see every key (a dense row)."""
    return patterns.longformer(seq_len, 2048, 128, causal=False, device=device)


def bigbird_layout(seq_len: int, device) -> BlockLayout:
    """BigBird, non-causal: a sliding window of 1024 tokens on each side (17 blocks), 256
    global tokens (2 dense rows and columns) and 16 random blocks per row (seed 0)."""
    return patterns.bigbird(seq_len, 1024, 256, 16, causal=False, device=device)


def irregular_layout(seq_len: int, device) -> BlockLayout:
    """Causal rows of very uneven lengths: row r keeps its own block and random earlier
    ones, min(c_r, r + 1) blocks in all, c_r = floor(2^(8u)) for u uniform in [0, 1), so
    log-uniform from 1 to 255 (seed 0)."""
    blocks = -(-seq_len // 128)
    generator = torch.Generator(device=device).manual_seed(0)
    scores = torch.rand(blocks, blocks, device=device, generator=generator)
    rows = torch.arange(blocks, device=device)
    scores[rows, rows] = 2.0  # above every random score: always kept
    scores[rows[:, None] < rows] = -1.0  # below every random score: past the diagonal
    counts = torch.exp2(8 * torch.rand(blocks, device=device, generator=generator)).long()
    ranks = scores.argsort(dim=1, descending=True).argsort(dim=1)  # 0: the row's highest
    keep = ranks < torch.minimum(counts, rows + 1)[:, None]
    return patterns.from_dense_mask(keep, seq_len_q=seq_len)


def dense_flops(seq_len: int, heads_q: int, *, causal: bool) -> float:
    """Forward FLOPs of dense attention at head dim HEAD_DIM: 4 * HEAD_DIM per pair, all
    S x S pairs of each query head, or under causal half of them (the count FlashAttention
    reports)."""
    return 4 * HEAD_DIM * seq_len * seq_len * heads_q / (2 if causal else 1)


class Case(NamedTuple):
    seq_len: int
    heads_q: int
    heads_kv: int
    layout: Callable[[int, object], BlockLayout]  # (seq_len, device) -> layout
    dense: bool  # dense peers (FA4, SDPA) run too: the S x S attention fits
    causal: bool = True  # keys j <= i only; else every pair of every active block

    @property
    def summary(self) -> str:
        """What the layout keeps, in a sentence: its builder's docstring's first paragraph."""
        return " ".join(inspect.getdoc(self.layout).split("\n\n")[0].split())

    def flops(self, layout: BlockLayout) -> float:
        """Forward FLOPs of flash-msa and its block-sparse peers on the case's layout: half
        the square for dense causal (the dense peers' count), else every pair of every
        active block."""
        if self.layout is causal_layout:
            return dense_flops(self.seq_len, self.heads_q, causal=True)
        # each layout head serves heads_q / layout_heads query heads
        return layout.flops(HEAD_DIM) * (self.heads_q // layout.layout_heads)


# bf16, B=1, D=128, block 128
CASES = {
    "causal-32k": Case(32 * K, 16, 16, causal_layout, True),
    "causal-128k": Case(128 * K, 16, 16, causal_layout, True),
    "window-128k": Case(128 * K, 16, 16, window_layout, True),
    "window-1m": Case(M, 16, 16, window_layout, False),
    "topk16-128k": Case(128 * K, 16, 16, topk_layout, True),
    "topk16-1m": Case(M, 16, 16, topk_layout, False),
    "topk16-gqa32x8-128k": Case(128 * K, 32, 8, topk_layout, False),
    "topk16-gqa64x4-128k": Case(128 * K, 64, 4, topk_layout, False),
    # MSA's main attention: H_q 64, H_kv 4, a layout per kv head, q_block 64
    "msa-main-128k": Case(128 * K, 64, 4, msa_layout, False),
    # non-causal, with dense global rows
    "longformer-128k": Case(128 * K, 16, 16, longformer_layout, False, causal=False),
    "bigbird-128k": Case(128 * K, 16, 16, bigbird_layout, False, causal=False),
    # causal rows of 1 to 255 blocks: the heaviest-rows-first launch order and load balance
    "irregular-128k": Case(128 * K, 16, 16, irregular_layout, False),
}

# name -> document lengths (packed back to back, causal within each), H = 16
VARLEN_CASES = {
    "varlen-1x128k": [128 * K],
    "varlen-16x8k": [8 * K] * 16,
    "varlen-skewed-128k": [64 * K, 32 * K, 16 * K, 8 * K, 4 * K, 2 * K, K, K],
}


# bf16 [1, S, H, D] inputs of head dim HEAD_DIM: random_tensors(seq_len, heads, *, device,
# requires_grad, seed=1) and random_inputs(seq_len, heads_q, heads_kv, device).
random_tensors = functools.partial(bench.random_tensors, head_dim=HEAD_DIM, dtype=torch.bfloat16)
random_inputs = functools.partial(bench.random_inputs, head_dim=HEAD_DIM, dtype=torch.bfloat16)


# ---- peers ---------------------------------------------------------------------------


def median_ms(function, repeats: int = 3) -> float:
    """Median of `repeats` timed calls after an untimed one, by CUDA events."""
    function()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[repeats // 2]


def selection_agreement(expected: torch.Tensor, actual: torch.Tensor, chunk: int = 1 << 16):
    """Share of expected's kept blocks (select_tokens' [B, H_p, S, top_k], -1 padding) that
    actual's row also holds, a chunk of tokens at a time; a float in [0, 1]."""
    kept = shared = 0
    for first in range(0, expected.shape[2], chunk):
        rows = slice(first, first + chunk)
        wanted, got = expected[:, :, rows], actual[:, :, rows]
        real = wanted >= 0
        found = (wanted[..., :, None] == got[..., None, :]).any(-1)  # [B, H_p, n, top_k]
        kept += int(real.sum())
        shared += int((found & real).sum())
    return shared / max(kept, 1)


def failed_cell(record: dict) -> str:
    """A report cell for a record that holds a failure (the full text is in the JSON)."""
    return f"failed: {record['error'][:80]}"


# ---- runs ----------------------------------------------------------------------------


def source_digest(package: pathlib.Path = ROOT / "flash_msa") -> str:
    """sha256 of the package's **/*.py (this tree's flash_msa by default) concatenated in byte
    order of their paths, 12 hex digits (benchmarks/gpu_tests.sh heads its log with it too):
    right where a copied tree has no .git."""
    digest = hashlib.sha256()
    root = package.parent
    paths = sorted(path.relative_to(root).as_posix() for path in package.glob("**/*.py"))
    for path in paths:
        digest.update((root / path).read_bytes())
    return digest.hexdigest()[:12]


def run_metadata(device: torch.device) -> dict:
    """The device and its memory, torch and triton versions, the date, the commit and the
    digest of flash_msa's sources: merged into every record of the run."""
    return dict(
        bench.device_metadata(device), commit=bench.source_commit(),
        source_sha256=source_digest(),
    )  # fmt: skip


def gpu_folder(name: str) -> str:
    """The results folder of a GPU named `name`: its model ("NVIDIA H100 80GB HBM3" -> h100,
    "NVIDIA H200" -> h200, "NVIDIA A100-SXM4-80GB" -> a100), else the name's last word."""
    model = re.search(r"\b[A-Z]\d{2,4}\b", name)
    return (model.group(0) if model else name.split()[-1]).lower()


def results_dir(out: str | None, device: torch.device, suffix: str = "") -> pathlib.Path:
    """out, or benchmarks/results/<gpu><suffix>/ (gpu_folder, e.g. h200, or h200x8 for suffix
    "x8"; cpu on the CPU), created if missing."""
    if out is None:
        gpu = device.type == "cuda"
        folder = gpu_folder(torch.cuda.get_device_name(device)) if gpu else "cpu"
        out = ROOT / "benchmarks" / "results" / f"{folder}{suffix}"
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
