"""The Gluon forward on one H200, unmasked and masked, against flash-msa's Triton forward.

The unmasked path's go/no-go (dense non-causal attention at 16K must reach 600 TFLOP/s) and
the masked path (dense causal at 16K and 32K, a causal window of 4096 + 128 sinks, 16
random blocks a row and 16 packed documents of 8K, causal within each, at 128K), each
beside flash-msa's Triton forward in the same run.

    PYTHONPATH=$PWD python benchmarks/bench_gluon_forward.py [--out DIR] [--seq-len 16k]
        [--cases causal-16k,causal-32k,window-128k,topk16-128k,documents-16x8k]

bf16, B=1, H=16, D=128, blocks of 128. The unmasked case (--seq-len) has every block active
(the all-active CSR of patterns.from_dense_mask); the masked cases (--cases, '' for none) are
causal=True over common.py's layouts (causal: the lower block triangle; window: sliding
window 4096 + 128 global tokens; top-k: 16 blocks a row; documents: the causal blocks of
each document, with its document ids), where the diagonal and window-edge blocks are
partial. The Gluon variants (2 stages): a program per tile or persistent (a program per SM,
tiles taken at run time), the query blocks heaviest first or ascending (masked cases),
ping-pong on / off (unmasked). Each first passes a correctness check against float64
(error of out and lse at most 2x PyTorch's in bf16, outputs poisoned with NaN beforehand,
persistent variants on 7 programs that walk several tiles each; unmasked: dense and a random
block-sparse CSR with an empty row at S=1024; masked: causal at S=1000, causal window +
sinks at S=2048 and causal ragged documents at S=1500, B=2, H=4), then is timed
(triton.testing.do_bench, median); beside them flash-msa's Triton forward on the same CSR and
masks (autotuned) and SDPA cuDNN where the attention is dense. TFLOP/s: 4 S^2 D H dense,
half that dense causal and per document (as bench_attention and the anchors count it), 4 *
128^2 * D per active block and head for the window and top-k. Each Gluon variant runs in a
child process under a time limit: one that fails to compile, errs, computes wrongly or hangs
records why, and the others still run. One line per record on stdout; DIR/gluon_forward.json
and gluon_forward.md (DIR defaults to benchmarks/results/<gpu>/).
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
    K,
    causal_layout,
    failure,
    markdown_table,
    parse_length,
    random_tensors,
    results_dir,
    run_metadata,
    timed,
    topk_layout,
    window_layout,
    write_report,
)

from flash_msa import patterns

HEADS = 16
TARGET_TFLOPS = 600.0
CHECK_SEQ_LEN = 1024
# Variants: launch options of attention_forward (2 stages, ping-pong, one program per tile,
# query blocks heaviest first by default); persistent: one program per SM instead;
# ascending: the query blocks in ascending order instead.
MASKED_VARIANTS = [dict(), dict(persistent=True), dict(ascending=True),
                   dict(persistent=True, ascending=True)]  # fmt: skip
UNMASKED_VARIANTS = [dict(), dict(persistent=True), dict(pingpong=False)]
# name: sequence length, layout (seq_len, device) -> BlockLayout, document length (packed
# documents of that many tokens, causal within each) or None; all causal
MASKED_CASES = {
    "causal-16k": (16 * K, causal_layout, None),
    "causal-32k": (32 * K, causal_layout, None),
    "window-128k": (128 * K, window_layout, None),
    "topk16-128k": (128 * K, topk_layout, None),
    "documents-16x8k": (128 * K, lambda seq_len, device: document_layout(seq_len, 8 * K, device),
                        8 * K),
}
CHECK_PROGRAMS = 7  # persistent variants are checked with programs that walk several tiles
VARIANT_TIMEOUT_S = 90  # compile, check and time one variant
BUDGET_S = 420  # variants not started by then are recorded as skipped
RESULT = "RESULT "  # prefix of a child's JSON line
TRITON = "triton (flash-msa)"
SDPA = "sdpa_cudnn"


def variant_name(variant: dict) -> str:
    programs = "persistent" if variant.get("persistent") else "a program per tile"
    order = ", ascending" if variant.get("ascending") else ""
    turns = "" if variant.get("pingpong", True) else ", no pingpong"
    return f"gluon {programs}{order}{turns}"


def launch_options(variant: dict, layout, device) -> dict:
    """attention_forward's options for a variant on a layout: persistent is one program per
    SM, ascending the query blocks in order."""
    options = {key: value for key, value in variant.items()
               if key not in ("persistent", "ascending")}  # fmt: skip
    if variant.get("persistent"):
        options["programs"] = torch.cuda.get_device_properties(device).multi_processor_count
    options["row_order"] = (
        torch.arange(layout.num_q_blocks, dtype=torch.int32, device=device)
        if variant.get("ascending") else layout.heavy_rows_first()
    )  # fmt: skip
    return options


def document_layout(seq_len: int, length: int, device):
    """The causal blocks of documents of `length` tokens packed back to back."""
    cu_seqlens = torch.arange(0, seq_len + 1, length, dtype=torch.int32, device=device)
    return patterns.causal(seq_len, device=device) & patterns.documents(cu_seqlens)


def packed_documents(seq_len: int, length: int, device) -> torch.Tensor:
    """int32 [1, S]: the document ids of documents of `length` tokens back to back."""
    return (torch.arange(seq_len, device=device) // length).int()[None]


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


def case_of(name: str, seq_len: int):
    """(sequence length, layout builder, causal, document length or None) of a case:
    "dense-<S>" or a masked one."""
    if name in MASKED_CASES:
        length, build, documents = MASKED_CASES[name]
        return length, build, True, documents
    return seq_len, dense_layout, False, None


def case_flops(name: str, seq_len: int, layout) -> float:
    dense = 4 * seq_len * seq_len * HEAD_DIM * HEADS
    if name.startswith("dense"):
        return dense
    if name.startswith("causal"):
        return dense / 2
    documents = MASKED_CASES.get(name, (0, None, None))[2]
    if documents is not None:  # causal within each document
        return seq_len // documents * 4 * documents * documents * HEAD_DIM * HEADS / 2
    return layout.flops(HEAD_DIM) * HEADS


def poisoned():
    """torch.empty / empty_like filling floating buffers with NaN (unwritten outputs fail)."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(tensor):
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    return (
        mock.patch.object(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw))),
        mock.patch.object(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw))),
    )


def check_inputs(masked: bool, device) -> dict:
    """name -> (q, k, v, layout, causal, document ids or None) of the correctness checks of
    a path."""
    from flash_msa.testing import random_qkv

    if not masked:
        tensors = random_tensors(CHECK_SEQ_LEN, dict(q=HEADS, k=HEADS, v=HEADS), device=device,
                                 requires_grad=(), seed=11)  # fmt: skip
        return {
            "dense": (*tensors.values(), dense_layout(CHECK_SEQ_LEN, device), False, None),
            "sparse": (*tensors.values(), sparse_layout(CHECK_SEQ_LEN, device), False, None),
        }
    windowed = patterns.sliding_window(2048, 512, device=device) | patterns.global_tokens(
        2048, 128, device=device
    )
    lengths = torch.tensor([300, 1, 700, 499], device=device)  # ragged, one of a token
    documents = torch.repeat_interleave(torch.arange(4, device=device), lengths).int()
    return {
        "causal": (*random_qkv(2, 1000, 4, HEAD_DIM, dtype=torch.bfloat16, device=device,
                               seed=12), patterns.causal(1000, device=device), True, None),
        "window": (*random_qkv(2, 2048, 4, HEAD_DIM, dtype=torch.bfloat16, device=device,
                               seed=13), windowed, True, None),
        "documents": (*random_qkv(2, 1500, 4, HEAD_DIM, dtype=torch.bfloat16, device=device,
                                  seed=14), patterns.causal(1500, device=device), True,
                      documents[None].repeat(2, 1)),
    }  # fmt: skip


def check(forward, variant: dict, masked: bool, device) -> dict:
    """Errors of out and lse against float64 beside PyTorch's in bf16."""
    from flash_msa.reference import attention_reference, layout_mask
    from flash_msa.testing import relative_error

    scale = HEAD_DIM**-0.5
    report, passed = {}, True
    for name, (q, k, v, layout, causal, documents) in check_inputs(masked, device).items():
        options = launch_options(variant, layout, device)
        if variant.get("persistent"):
            options["programs"] = CHECK_PROGRAMS
        first, second = poisoned()
        with first, second:
            out, lse = forward(q, k, v, layout.row_offsets, layout.col_indices,
                               softmax_scale=scale, causal=causal, document_ids=documents,
                               **options)  # fmt: skip
        torch.cuda.synchronize()
        mask = layout_mask(layout, q.shape[0], q.shape[2], causal=causal,
                           document_ids=documents)  # fmt: skip
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


def run_variant(variant: dict, name: str, seq_len: int) -> dict:
    """A child's work: check the variant's path, then time it on the case."""
    from flash_msa.ops.gluon import attention_forward

    device = torch.device("cuda")
    seq_len, build, causal, document_length = case_of(name, seq_len)
    record = dict(check=check(attention_forward, variant, causal, device))
    if not record["check"]["passed"]:
        record["error"] = "wrong results (see check)"
        return record
    tensors = random_tensors(seq_len, dict(q=HEADS, k=HEADS, v=HEADS), device=device,
                             requires_grad=())  # fmt: skip
    q, k, v = tensors.values()
    layout = build(seq_len, device)
    options = launch_options(variant, layout, device)
    documents = None if document_length is None else packed_documents(seq_len, document_length,
                                                                       device)  # fmt: skip
    record.update(timed(lambda: attention_forward(
        q, k, v, layout.row_offsets, layout.col_indices, softmax_scale=HEAD_DIM**-0.5,
        causal=causal, document_ids=documents, **options,
    )))  # fmt: skip
    record["compiled"] = compiled_figures()
    return record


def spawn_variant(variant: dict, name: str, seq_len: int) -> dict:
    """run_variant in a child process under VARIANT_TIMEOUT_S."""
    command = [sys.executable, __file__, "--variant", json.dumps(variant), "--case", name,
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


def time_peers(name: str, seq_len: int, device) -> list[dict]:
    """flash-msa's Triton forward on the case's CSR and masks, and SDPA cuDNN where the
    attention is dense (causal or not)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    from flash_msa.ops.triton import attention_forward as triton_forward

    seq_len, build, causal, document_length = case_of(name, seq_len)
    tensors = random_tensors(seq_len, dict(q=HEADS, k=HEADS, v=HEADS), device=device,
                             requires_grad=())  # fmt: skip
    q, k, v = tensors.values()
    scale = HEAD_DIM**-0.5
    layout = build(seq_len, device)
    q_t, k_t, v_t = (t.transpose(1, 2) for t in (q, k, v))

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return scaled_dot_product_attention(q_t, k_t, v_t, is_causal=causal, scale=scale)

    documents = None if document_length is None else packed_documents(seq_len, document_length,
                                                                       device)  # fmt: skip
    peers = {
        TRITON: lambda: triton_forward(
            q, k, v, layout, causal=causal, window_size=(-1, -1), softmax_scale=scale,
            document_ids=documents,
        ),
    }
    if name.startswith(("dense", "causal")):
        peers[SDPA] = sdpa
    records = []
    for impl, step in peers.items():
        try:
            records.append(dict(impl=impl, **timed(step)))
        except Exception as error:  # a peer's failure is a record, not the end of the run
            records.append(dict(impl=impl, error=failure(error)))
    return records


def describe(record: dict) -> str:
    impl = f"{record['case']:<12} {record['impl']:<28}"
    if "error" in record:
        return f"{impl} failed: {record['error'][:160]}"
    return f"{impl} {record['ms']:8.3f} ms {record['tflops']:7.1f} TFLOP/s"


def report_body(records: list[dict]) -> list[str]:
    reference = {(r["case"], r["impl"]): r["ms"] for r in records if "ms" in r}
    rows = []
    for record in records:
        checked = (record.get("check") or {}).get("passed")
        cells = [record["case"], record["impl"], {True: "pass", False: "FAIL", None: "-"}[checked]]
        if "error" in record:
            cells += [f"failed: {record['error'][:80]}", "-", "-", "-"]
        else:
            cells += [f"{record['ms']:.3f}", f"{record['tflops']:.1f}"]
            for peer in (TRITON, SDPA):
                peer_ms = reference.get((record["case"], peer))
                cells.append("-" if peer_ms is None else f"{peer_ms / record['ms']:.2f}x")
        rows.append((record, cells))
    columns = ["case", "impl", "check", "ms", "TFLOP/s", f"speed vs {TRITON}", f"speed vs {SDPA}"]
    return markdown_table(columns, rows)


def verdicts(records: list[dict], dense: str) -> list[str]:
    """The go/no-go of the unmasked case; the best Gluon variant against Triton per case."""
    lines = []
    for name in dict.fromkeys(r["case"] for r in records):
        gluon = [r for r in records if r["case"] == name and r["impl"].startswith("gluon")
                 and "tflops" in r]  # fmt: skip
        best = max(gluon, key=lambda r: r["tflops"], default=None)
        if best is None:
            lines.append(f"{name}: no Gluon variant ran")
            continue
        triton = next((r for r in records if r["case"] == name and r["impl"] == TRITON
                       and "ms" in r), None)  # fmt: skip
        versus = "" if triton is None else f", {triton['ms'] / best['ms']:.2f}x Triton"
        line = f"{name}: best {best['impl']} at {best['tflops']:.1f} TFLOP/s{versus}"
        if name == dense:
            go = "GO" if best["tflops"] >= TARGET_TFLOPS else "NO-GO"
            line = f"{go}: {line} (target {TARGET_TFLOPS:.0f})"
        lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder of the results (default "
                        "benchmarks/results/<gpu>/)")  # fmt: skip
    parser.add_argument("--seq-len", default="16k", help="the unmasked case's length (16k)")
    parser.add_argument("--cases", default=",".join(MASKED_CASES),
                        help=f"masked cases ({', '.join(MASKED_CASES)}; '' for none)")  # fmt: skip
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # a child's work
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    seq_len = parse_length(args.seq_len)
    if args.variant is not None:
        record = run_variant(json.loads(args.variant), args.case, seq_len)
        print(RESULT + json.dumps(record), flush=True)
        return
    masked = [name for name in args.cases.split(",") if name]
    unknown = set(masked) - set(MASKED_CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; choose among {list(MASKED_CASES)}")

    started = time.perf_counter()
    device = torch.device("cuda")
    meta = run_metadata(device)
    dense = f"dense-{args.seq_len}"
    print(f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}; B=1, H={HEADS}, "
          f"D={HEAD_DIM}, bf16; cases {', '.join([dense, *masked])}", flush=True)  # fmt: skip
    records = []
    for name, variants in ((dense, UNMASKED_VARIANTS),
                           *((name, MASKED_VARIANTS) for name in masked)):  # fmt: skip
        case_len, build, causal, _ = case_of(name, seq_len)
        flops = case_flops(name, case_len, build(case_len, device))
        case = dict(case=name, seq_len=case_len, batch=1, heads=HEADS, head_dim=HEAD_DIM,
                    dtype="bf16", causal=causal, flops=flops)  # fmt: skip
        found = []
        for variant in variants:
            if time.perf_counter() - started > BUDGET_S:
                record = dict(error=f"skipped: the run passed its {BUDGET_S} s budget")
            else:
                record = spawn_variant(variant, name, seq_len)
            found.append(dict(impl=variant_name(variant), **variant, **record))
        found += time_peers(name, seq_len, device)
        for record in found:
            if "ms" in record:
                record["tflops"] = flops / record["ms"] / 1e9
            records.append(dict(case, **meta, **record))
            print(describe(records[-1]), flush=True)
        torch.cuda.empty_cache()

    lines = verdicts(records, dense)
    print("\n".join(lines), f"({time.perf_counter() - started:.0f} s)", flush=True)
    out_dir = results_dir(args.out, device)
    notes = (
        f"Gluon forward, B=1, H={HEADS}, D={HEAD_DIM}, bf16, blocks of 128; {dense}: every "
        f"block active, non-causal; causal-*: the lower block triangle, causal; window-128k: "
        f"sliding window 4096 + 128 global tokens, causal; topk16-128k: 16 blocks a row, "
        f"causal; documents-16x8k: 16 documents of 8K, causal within each. Medians of "
        f"do_bench; TFLOP/s = 4 S^2 D H / time dense, half that dense causal and per "
        f"document, 4 * 128^2 * D * H per active block for the window and top-k. check: out "
        f"and lse of the Gluon variant within 2x PyTorch's bf16 error against float64 "
        f"(unmasked: dense and a random block-sparse CSR at S={CHECK_SEQ_LEN}; masked: causal "
        f"at S=1000, causal window + sinks at S=2048, ragged documents at S=1500). "
        + " ".join(f"{line}." for line in lines)
    )
    write_report(out_dir, "gluon_forward", records, meta=meta, title="Gluon forward",
                 notes=notes, body=report_body(records))  # fmt: skip
    print(f"wrote {out_dir / 'gluon_forward.json'} and .md", flush=True)


if __name__ == "__main__":
    main()
