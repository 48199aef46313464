"""The Gluon forward's go/no-go on one H200: dense non-causal attention at 16K must reach
600 TFLOP/s.

    PYTHONPATH=$PWD python benchmarks/bench_gluon_forward.py [--out DIR] [--seq-len 16k]

bf16, B=1, H=16, D=128, every 128 x 128 block active (the all-active CSR of
patterns.from_dense_mask). Each Gluon variant (num_stages 2 / 3, ping-pong on / off) first
passes a correctness check at S=1024 (dense and a random block-sparse CSR with an empty row,
against float64: error of out and lse at most 2x PyTorch's in bf16, outputs poisoned with NaN
beforehand), then is timed (triton.testing.do_bench, median); beside them flash-msa's Triton
forward on the same CSR (autotuned) and SDPA (cuDNN, dense). TFLOP/s = 4 S^2 D H / time.
Each Gluon variant runs in a child process under a time limit: one that fails to compile,
errs, computes wrongly or hangs records why, and the others still run. One line per variant
on stdout; DIR/gluon_forward.json and gluon_forward.md (DIR defaults to
benchmarks/results/<gpu>/).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from unittest import mock

import torch
from common import (
    HEAD_DIM,
    failure,
    markdown_table,
    parse_length,
    random_tensors,
    results_dir,
    run_metadata,
    timed,
    write_report,
)

from flash_msa import patterns

HEADS = 16
TARGET_TFLOPS = 600.0
CHECK_SEQ_LEN = 1024
# Turn-taking alternates, so that a failure of one mode still leaves the other's figures.
VARIANTS = [
    dict(num_stages=3, pingpong=True),
    dict(num_stages=3, pingpong=False),
    dict(num_stages=2, pingpong=True),
    dict(num_stages=2, pingpong=False),
]
VARIANT_TIMEOUT_S = 60  # compile, check and time one variant
BUDGET_S = 120  # variants not started by then are recorded as skipped
RESULT = "RESULT "  # prefix of a child's JSON line
PEERS = ("sdpa_cudnn", "triton (flash-msa)")


def variant_name(variant: dict) -> str:
    turns = "pingpong" if variant["pingpong"] else "no pingpong"
    return f"gluon stages={variant['num_stages']} {turns}"


def dense_layout(seq_len: int, device):
    blocks = seq_len // 128
    mask = torch.ones(blocks, blocks, dtype=torch.bool)
    return patterns.from_dense_mask(mask, seq_len_q=seq_len, block_size=128, device=device)


def sparse_layout(seq_len: int, device, density: float = 0.4, seed: int = 5):
    """A random block mask shared by every head: block 0 of each row, row 2 empty."""
    blocks = seq_len // 128
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(blocks, blocks, generator=generator) < density
    mask[:, 0] = True
    mask[2] = False
    return patterns.from_dense_mask(mask, seq_len_q=seq_len, block_size=128, device=device)


def poisoned():
    """torch.empty / empty_like filling floating buffers with NaN (unwritten outputs fail)."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(tensor):
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    return (
        mock.patch.object(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw))),
        mock.patch.object(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw))),
    )


def check(forward, variant: dict, device) -> dict:
    """Errors of out and lse against float64 beside PyTorch's in bf16, dense and sparse."""
    from flash_msa.reference import attention_reference, layout_mask
    from flash_msa.testing import relative_error

    tensors = random_tensors(CHECK_SEQ_LEN, dict(q=HEADS, k=HEADS, v=HEADS), device=device,
                             requires_grad=(), seed=11)  # fmt: skip
    q, k, v = tensors.values()
    scale = HEAD_DIM**-0.5
    report, passed = {}, True
    for name, layout in (("dense", dense_layout(CHECK_SEQ_LEN, device)),
                         ("sparse", sparse_layout(CHECK_SEQ_LEN, device))):  # fmt: skip
        first, second = poisoned()
        with first, second:
            out, lse = forward(q, k, v, layout.row_offsets, layout.col_indices,
                               softmax_scale=scale, **variant)  # fmt: skip
        torch.cuda.synchronize()
        mask = layout_mask(layout, 1, HEADS)
        exact = attention_reference(q.double(), k.double(), v.double(), mask, scale)
        same_dtype = attention_reference(q, k, v, mask, scale)
        for label, mine, theirs, truth in zip(("out", "lse"), (out, lse), same_dtype, exact,
                                              strict=True):  # fmt: skip
            error, torch_error = relative_error(mine, truth), relative_error(theirs, truth)
            ok = error <= 2 * torch_error + 1e-6
            passed &= ok
            report[f"{name}_{label}"] = dict(error=error, torch_error=torch_error, ok=ok)
    report["passed"] = passed
    return report


def compiled_figures() -> dict:
    """Registers, spills and shared memory of the compiled Gluon kernel(s), if Triton keeps
    them where 3.6 does."""
    from flash_msa.ops.gluon import forward

    try:
        cache = forward._forward_kernel.device_caches[torch.cuda.current_device()][0]
        figures = [dict(registers=kernel.n_regs, spills=kernel.n_spills,
                        shared=kernel.metadata.shared) for kernel in cache.values()]  # fmt: skip
    except Exception as error:  # only a record's detail
        return dict(error=failure(error))
    return dict(kernels=figures)


def run_variant(variant: dict, seq_len: int) -> dict:
    """A child's work: check, then time the variant at seq_len."""
    from flash_msa.ops.gluon import attention_forward

    device = torch.device("cuda")
    record = dict(check=check(attention_forward, variant, device))
    if not record["check"]["passed"]:
        record["error"] = "wrong results (see check)"
        return record
    tensors = random_tensors(seq_len, dict(q=HEADS, k=HEADS, v=HEADS), device=device,
                             requires_grad=())  # fmt: skip
    q, k, v = tensors.values()
    layout = dense_layout(seq_len, device)
    record.update(timed(lambda: attention_forward(
        q, k, v, layout.row_offsets, layout.col_indices, softmax_scale=HEAD_DIM**-0.5, **variant
    )))  # fmt: skip
    record["compiled"] = compiled_figures()
    return record


def spawn_variant(variant: dict, seq_len: int) -> dict:
    """run_variant in a child process under VARIANT_TIMEOUT_S."""
    command = [sys.executable, __file__, "--variant", json.dumps(variant),
               "--seq-len", str(seq_len)]  # fmt: skip
    try:
        child = subprocess.run(command, capture_output=True, text=True, timeout=VARIANT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return dict(error=f"timed out after {VARIANT_TIMEOUT_S} s (a hang, or a slow compile)")
    for line in child.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    lines = [line for line in (child.stderr or child.stdout).splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "no output"
    return dict(error=f"exit {child.returncode}: {last[:300]}", log="\n".join(lines[-40:]))


def time_peers(seq_len: int, device) -> list[dict]:
    """flash-msa's Triton forward on the all-active CSR and SDPA cuDNN dense."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    from flash_msa.ops.triton import attention_forward as triton_forward

    tensors = random_tensors(seq_len, dict(q=HEADS, k=HEADS, v=HEADS), device=device,
                             requires_grad=())  # fmt: skip
    q, k, v = tensors.values()
    scale = HEAD_DIM**-0.5
    layout = dense_layout(seq_len, device)
    q_t, k_t, v_t = (t.transpose(1, 2) for t in (q, k, v))

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return scaled_dot_product_attention(q_t, k_t, v_t, is_causal=False, scale=scale)

    peers = {
        "triton (flash-msa)": lambda: triton_forward(
            q, k, v, layout, causal=False, window_size=(-1, -1), softmax_scale=scale
        ),
        "sdpa_cudnn": sdpa,
    }
    records = []
    for impl, step in peers.items():
        try:
            records.append(dict(impl=impl, **timed(step)))
        except Exception as error:  # a peer's failure is a record, not the end of the run
            records.append(dict(impl=impl, error=failure(error)))
    return records


def describe(record: dict) -> str:
    if "error" in record:
        return f"{record['impl']:<28} failed: {record['error'][:160]}"
    return f"{record['impl']:<28} {record['ms']:8.3f} ms {record['tflops']:7.1f} TFLOP/s"


def report_body(records: list[dict], reference: dict[str, float]) -> list[str]:
    rows = []
    for record in records:
        checked = (record.get("check") or {}).get("passed")
        cells = [record["impl"], {True: "pass", False: "FAIL", None: "-"}[checked]]
        if "error" in record:
            cells += [f"failed: {record['error'][:80]}", "-", "-", "-"]
        else:
            cells += [f"{record['ms']:.3f}", f"{record['tflops']:.1f}"]
            for peer in PEERS:
                cells.append(f"{reference[peer] / record['ms']:.2f}x" if peer in reference else "-")
        rows.append((record, cells))
    columns = ["impl", "check", "ms", "TFLOP/s", *(f"speed vs {peer}" for peer in PEERS)]
    return markdown_table(columns, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder of the results (default "
                        "benchmarks/results/<gpu>/)")  # fmt: skip
    parser.add_argument("--seq-len", default="16k", help="sequence length (default 16k)")
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # a child's work
    args = parser.parse_args()
    seq_len = parse_length(args.seq_len)
    if args.variant is not None:
        print(RESULT + json.dumps(run_variant(json.loads(args.variant), seq_len)), flush=True)
        return

    started = time.perf_counter()
    device = torch.device("cuda")
    meta = run_metadata(device)
    flops = 4 * seq_len * seq_len * HEAD_DIM * HEADS
    case = dict(seq_len=seq_len, batch=1, heads=HEADS, head_dim=HEAD_DIM, dtype="bf16",
                causal=False, flops=flops)  # fmt: skip
    print(f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}; S={seq_len}, "
          f"B=1, H={HEADS}, D={HEAD_DIM}, bf16, dense non-causal", flush=True)  # fmt: skip
    records = []
    for variant in VARIANTS:
        if time.perf_counter() - started > BUDGET_S:
            record = dict(error=f"skipped: the run passed its {BUDGET_S} s budget")
        else:
            record = spawn_variant(variant, seq_len)
        records.append(dict(impl=variant_name(variant), **variant, **record))
        if "ms" in records[-1]:
            records[-1]["tflops"] = flops / records[-1]["ms"] / 1e9
        print(describe(records[-1]), flush=True)
    for record in time_peers(seq_len, device):
        if "ms" in record:
            record["tflops"] = flops / record["ms"] / 1e9
        records.append(record)
        print(describe(record), flush=True)
    records = [dict(case, **meta, **record) for record in records]

    gluon = [r for r in records if r["impl"].startswith("gluon") and "tflops" in r]
    best = max(gluon, key=lambda r: r["tflops"], default=None)
    verdict = (
        "no Gluon variant ran" if best is None else
        f"{'GO' if best['tflops'] >= TARGET_TFLOPS else 'NO-GO'}: best {best['impl']} at "
        f"{best['tflops']:.1f} TFLOP/s (target {TARGET_TFLOPS:.0f})"
    )  # fmt: skip
    print(verdict, f"({time.perf_counter() - started:.0f} s)", flush=True)
    reference = {r["impl"]: r["ms"] for r in records if "ms" in r}
    out_dir = results_dir(args.out, device)
    notes = (
        f"Dense non-causal forward, S={seq_len}, B=1, H={HEADS}, D={HEAD_DIM}, bf16, every "
        f"128 x 128 block active; medians of do_bench; TFLOP/s = 4 S^2 D H / time. check: "
        f"out and lse of the Gluon variant within 2x PyTorch's bf16 error against float64 at "
        f"S={CHECK_SEQ_LEN} (dense and a random block-sparse CSR). {verdict}."
    )
    write_report(out_dir, "gluon_forward", records, meta=meta, title="Gluon forward go/no-go",
                 notes=notes, body=report_body(records, reference))  # fmt: skip
    print(f"wrote {out_dir / 'gluon_forward.json'} and .md", flush=True)


if __name__ == "__main__":
    main()
