"""Shared test helpers: random inputs, error measures, sampled-row references, sm_90 compiles
(output poisoning is the poisoned_allocations fixture of tests/conftest.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import torch
import triton


def fp8_exact_proxies(
    batch: int,
    seq_len: int,
    heads: int,
    heads_keys: int,
    dim: int,
    kv_block: int,
    *,
    seed: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q_proxy [B, S, H_p, D_p], k_proxy [B, S, H_pk, D_p] that FP8 scoring
    (msa.fp8.quantize_proxies) holds without loss: multiples of 1/8 up to 7/8, each row
    holding a 7/8, the queries at odd positions scaled by 2 (so the rows' factors are 2^-9
    and 2^-8) and the keys of kv block c by 2^(c % 3) (so the blocks' factors differ, by
    powers of two). Every product and sum is then exact in fp32 (and the values in bf16):
    FP8 scores select and score as float64 does."""
    generator = torch.Generator().manual_seed(seed)

    def draw(heads_count):
        values = torch.randint(-6, 7, (batch, seq_len, heads_count, dim), generator=generator) / 8
        values[..., 0] = 7 / 8
        return values

    positions = torch.arange(seq_len)
    row_factors = 2.0 ** (positions % 2)  # [S]
    block_factors = 2.0 ** (positions // kv_block % 3)  # [S]
    q_proxy = draw(heads) * row_factors[:, None, None]
    return q_proxy.to(device), (draw(heads_keys) * block_factors[:, None, None]).to(device)


def random_qkv(
    batch: int,
    seq_len_q: int,
    heads_q: int,
    head_dim: int,
    *,
    seq_len_kv: int | None = None,
    heads_kv: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh normal q [B, S_q, H_q, D], k/v [B, S_kv, H_kv, D] from a seed (never zeros)."""
    seq_len_kv = seq_len_q if seq_len_kv is None else seq_len_kv
    heads_kv = heads_q if heads_kv is None else heads_kv
    generator = torch.Generator(device="cpu").manual_seed(seed)
    shapes = [
        (batch, seq_len_q, heads_q, head_dim),
        (batch, seq_len_kv, heads_kv, head_dim),
        (batch, seq_len_kv, heads_kv, head_dim),
    ]
    return tuple(
        torch.randn(shape, generator=generator, dtype=torch.float32)
        .to(device=device, dtype=dtype)
        .requires_grad_(requires_grad)
        for shape in shapes
    )


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64, over finite entries of expected;
    infinite entries (lse = -inf of empty rows) must match exactly, NaN never passes."""
    actual, expected = actual.detach().cpu().double(), expected.detach().cpu().double()
    if torch.isnan(actual).any():
        return float("inf")
    finite = torch.isfinite(expected)
    if not torch.equal(actual[~finite], expected[~finite]):
        return float("inf")
    difference = torch.linalg.vector_norm(actual[finite] - expected[finite])
    return float(difference / torch.linalg.vector_norm(expected[finite]).clamp_min(1e-30))


def sampled_rows_reference(q, k, v, layout, rows, grad_out, softmax_scale=None):
    """float32 out and dq of the query blocks `rows` of batch 0 under causal attention
    over their active blocks (layout head 0), one block row at a time: a check of long
    sequences whose full reference would not fit. q [1, S, H_q, D], k/v [1, S, H_kv, D];
    returns out and dq [len(rows) * q_block (cut at S), H_q, D]."""
    heads_q, heads_kv, head_dim = q.shape[2], k.shape[2], q.shape[3]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    outs, grads = [], []
    for row in rows:
        start, end = layout.row_offsets[0, row], layout.row_offsets[0, row + 1]
        blocks = layout.col_indices[start:end].long()
        within = torch.arange(layout.kv_block, device=q.device)
        keys = (blocks[:, None] * layout.kv_block + within).flatten()
        keys = keys[keys < k.shape[1]]  # [N]
        queries = row * layout.q_block + torch.arange(layout.q_block, device=q.device)
        queries = queries[queries < q.shape[1]]  # [M]
        q_rows = q[0, queries].detach().float().requires_grad_()  # [M, H_q, D]
        k_rows = k[0, keys].detach().float().repeat_interleave(heads_q // heads_kv, dim=1)
        v_rows = v[0, keys].detach().float().repeat_interleave(heads_q // heads_kv, dim=1)
        scores = torch.einsum("ihd,jhd->hij", q_rows, k_rows) * scale  # [H_q, M, N]
        scores = scores.masked_fill(keys[None, None, :] > queries[None, :, None], float("-inf"))
        out = torch.einsum("hij,jhd->ihd", scores.softmax(-1), v_rows)  # [M, H_q, D]
        out.backward(grad_out[0, queries].float())
        outs.append(out.detach())
        grads.append(q_rows.grad)
    return torch.cat(outs), torch.cat(grads)


def sampled_rows_errors(q, k, v, layout, out, grad_q, grad_out, check_rows: int):
    """Relative errors of out and dq (q.grad) on check_rows query blocks spread over the
    sequence, against sampled_rows_reference (causal, batch 0, layout head 0): the check of a
    long-sequence forward + backward whose dense reference would not fit. Returns
    (out_error, dq_error)."""
    rows = torch.linspace(0, layout.num_q_blocks - 1, check_rows).long().tolist()
    expected_out, expected_dq = sampled_rows_reference(q, k, v, layout, rows, grad_out)
    positions = torch.cat([
        torch.arange(row * layout.q_block, min((row + 1) * layout.q_block, q.shape[1]),
                     device=q.device)
        for row in rows
    ])  # fmt: skip
    return (
        relative_error(out[0, positions], expected_out),
        relative_error(grad_q[0, positions], expected_dq),
    )


# ---- GPU code generation without a GPU ------------------------------------------------------
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def assemble_for_sm90(ptx: str, workdir: str, name: str) -> dict:
    """Assemble PTX text for sm_90a with the ptxas Triton bundles: {"registers", "spills":
    bytes of spill stores, "warnings": ptxas's warning lines and its "Potential Performance
    Loss" notes (e.g. C7512: wgmma serialised for want of registers), "cubin": its path}."""
    path = os.path.join(workdir, f"{name}.ptx")
    with open(path, "w") as handle:
        handle.write(ptx)
    report = subprocess.run(
        [PTXAS, "-v", "--gpu-name=sm_90a", path, "-o", path + ".cubin"],
        capture_output=True, text=True, check=True,
    ).stderr  # fmt: skip
    return dict(
        registers=int(re.search(r"Used (\d+) registers", report).group(1)),
        spills=int(re.search(r"(\d+) bytes spill stores", report).group(1)),
        warnings=[line.strip() for line in report.splitlines()
                  if "warning" in line.lower() or "Performance Loss" in line],  # fmt: skip
        cubin=path + ".cubin",
    )


def compile_for_sm90(
    kernel, constexprs: dict, types: dict[str, str], num_warps: int, num_stages: int, workdir: str,
    aligned: bool = False,
) -> dict:
    """Compile a @triton.jit kernel for sm_90 (Hopper) on any machine, and read what Triton
    and the ptxas it bundles report: {"shared": bytes of shared memory, "registers",
    "spills": bytes of spill stores, "wgmma": whether it uses Hopper's tensor cores, "fp8":
    whether it multiplies e4m3 values, "pipelined": whether it loads ahead with cp.async}.

    constexprs: the kernel's constexpr values; types: Triton types of the other arguments
    ("*bf16", "*fp32", "fp32", ...; "i32" where absent). aligned: pointers and stride_*
    arguments specialised as divisible by 16, as the launcher does for such tensors (Triton
    pipelines pointer loads only then). Needs a process in which the kernel was decorated
    without TRITON_INTERPRET=1 (e.g. a subprocess)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {
        arg: "constexpr" if arg in constexprs else types.get(arg, "i32")
        for arg in kernel.arg_names
    }
    divisible = {
        (index,): [["tt.divisibility", 16]] for index, arg in enumerate(kernel.arg_names)
        if aligned and (signature[arg].startswith("*") or arg.startswith("stride_"))
    }  # fmt: skip
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs, divisible), target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )  # fmt: skip
    assembled = assemble_for_sm90(compiled.asm["ptx"], workdir, kernel.__name__)
    return dict(
        shared=compiled.metadata.shared,
        registers=assembled["registers"],
        spills=assembled["spills"],
        wgmma="wgmma" in compiled.asm["ptx"],
        fp8="e4m3" in compiled.asm["ptx"],
        pipelined="cp.async" in compiled.asm["ptx"],
    )


def sm90_reports(script: str, workdir, *args: str, timeout: int = 900) -> list[dict]:
    """Run `script`, Python that compiles kernels for sm_90 (with compile_for_sm90) and prints
    one JSON report a line, in a child process without TRITON_INTERPRET (an interpreted kernel
    never reaches GPU code generation), with argv [workdir, *args] and Triton's cache in
    workdir/cache; returns the reports (AssertionError with the child's stderr if it fails)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = os.path.join(workdir, "cache")
    result = subprocess.run(
        [sys.executable, "-c", script, str(workdir), *args], env=env, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]
