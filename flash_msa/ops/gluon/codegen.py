"""The Gluon kernels' sm_90 code without a GPU: compile for Hopper, then read what the
ptxas Triton bundles reports and the SASS.

Needs a process in which TRITON_INTERPRET is not set (the tests run it in a subprocess).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess

import triton

from flash_msa.testing import PTXAS, assemble_for_sm90

CUOBJDUMP = os.path.join(os.path.dirname(PTXAS), "cuobjdump")
TARGET = ("cuda", 90, 32)
SETMAXNREG = r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)"


def available() -> str | None:
    """Why the sm_90 compile cannot run here, or None if it can."""
    try:
        import triton.experimental.gluon  # noqa: F401
    except ImportError:
        return "this Triton has no Gluon dialect"
    for tool in (PTXAS, CUOBJDUMP):
        if not os.path.exists(tool):
            return f"this Triton build bundles no {os.path.basename(tool)}"
    return None


def descriptor_type(dtype: str, *block: int) -> str:
    """The signature type of a TMA descriptor argument of blocks `block` (e.g. rows,
    head_dim) in the default NVMMA shared layout ("bf16", "fp16", "fp32" or "fp8e4nv")."""
    from triton.experimental.gluon import language as gl

    element = {"bf16": gl.bfloat16, "fp16": gl.float16, "fp32": gl.float32,
               "fp8e4nv": gl.float8e4nv}[dtype]  # fmt: skip
    layout = gl.NVMMASharedLayout.get_default_for(list(block), element)
    return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout!r}>"


def partition_spill_stores(sass: str) -> int:
    """The spill stores (STL) after the first setmaxnreg (USETMAXREG): in the partitions'
    own code rather than in the launch code before they take their register budgets."""
    partitions = sass[sass.find("USETMAXREG"):] if "USETMAXREG" in sass else sass
    return len(re.findall(r"\bSTL\b", partitions))


def overlapped_exponentials(sass: str) -> int:
    """The most MUFU.EX2 that sit between a wgmma wait leaving groups in flight
    (WARPGROUP.DEPBAR.LE gsb0, 0x1 or more) and the next full wait (..., 0x0): the
    exponentials that run while the matmuls still in flight do (the forward's P V; the dQ
    kernel's dS K and dP), 0 if ptxas hoisted the full wait above them."""
    best, count = 0, None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE" in line:
            if not re.search(r"gsb0, 0x0\b", line):
                count = 0
            elif count is not None:
                best, count = max(best, count), None
        elif count is not None and "MUFU.EX2" in line:
            count += 1
    return best


def instructions_under_mma(sass: str, opcode: str) -> int:
    """The most `opcode` instructions that sit between the issue of a warpgroup MMA (HGMMA,
    QGMMA for FP8) and the next wait for MMAs (WARPGROUP.DEPBAR): the work that runs while
    it does."""
    best, count = 0, None
    for line in sass.splitlines():
        if re.search(r"\b[HQ]GMMA\.", line):
            count = 0 if count is None else count
        elif "WARPGROUP.DEPBAR" in line:
            if count is not None:
                best, count = max(best, count), None
        elif count is not None and re.search(rf"\b{re.escape(opcode)}\b", line):
            count += 1
    return best


def sass_fingerprint(sass: str) -> str:
    """A digest of the instructions of a cuobjdump listing, without addresses and encodings
    and with immediates of five hex digits or more replaced (shared-memory offsets, which
    move with the bytes warp_specialize passes to its partitions): equal for equal code."""
    instructions = []
    for line in sass.splitlines():
        match = re.match(r"\s*/\*[0-9a-f]+\*/\s*(.*?)\s*;", line)
        if match:
            instruction = " ".join(match.group(1).split())
            instructions.append(re.sub(r"0x[0-9a-f]{5,}", "IMM", instruction))
    return hashlib.sha256("\n".join(instructions).encode()).hexdigest()[:16]


def compile_forward(
    workdir: str, *, head_dim: int = 128, dtype: str = "bf16", num_stages: int = 2,
    pingpong: bool = True, masks=None, persistent: bool = False, pack: int = 1,
) -> dict:  # fmt: skip
    """Compile forward._forward_kernel for sm_90a with the forward.Masks `masks` (None: none,
    the path of full blocks; masks.query: per-token query masks), persistent or a program
    per tile, tiles of 128 / pack positions x pack query heads, and report {"registers": what
    ptxas allocates a thread at launch, "max_register": 1 + the highest register the SASS names
    (the consumers' need under setmaxnreg), "setmaxnreg": the per-warpgroup budgets, "spills":
    bytes of spill stores, "partition_spill_stores": see partition_spill_stores, "shared": bytes
    of shared memory, "wgmma": whether it uses Hopper's warpgroup MMA, "overlapped_exps": see
    overlapped_exponentials, "warnings": ptxas's warnings (e.g. wgmma serialised),
    "fingerprint": see sass_fingerprint, "sass": path of the SASS}."""
    from flash_msa.ops.gluon import forward

    masks = forward.Masks() if masks is None else masks
    half = forward.half_block(pack, head_dim)
    types = dict(
        q_desc=descriptor_type(dtype, *half), o_desc=descriptor_type(dtype, *half),
        k_desc=descriptor_type(dtype, forward.BLOCK_N, head_dim),
        v_desc=descriptor_type(dtype, forward.BLOCK_N, head_dim),
        lse="*fp32", row_order="*i32", next_tile="*i32", row_offsets="*i32", col_indices="*i32",
        query_masks="*i64", qk_scale="fp32", out=f"*{dtype}",
        document_first="*i32", document_last="*i32",
    )  # fmt: skip
    constexprs = dict(NUM_STAGES=num_stages, PINGPONG=pingpong, PERSISTENT=persistent,
                      **masks.constexprs(), HAS_QUERY_MASKS=masks.query, PACK=pack)  # fmt: skip
    turns = "pingpong" if pingpong else "plain"
    programs = "_persistent" if persistent else ""
    packed = f"_pack{pack}" if pack > 1 else ""
    name = (f"forward_d{head_dim}_{dtype}_s{num_stages}_{turns}{programs}{packed}"
            f"{_mask_flags(masks)}")  # fmt: skip
    return compile_kernel(forward._forward_kernel, types, constexprs, workdir, name)


def compile_backward(
    workdir: str, *, head_dim: int = 128, dtype: str = "bf16", num_stages: int = 2,
    grad_q: str = "atomic", masks=None, pack: int = 1, align: int = 2048,
) -> dict:  # fmt: skip
    """Compile backward._backward_kernel for sm_90a (grad_q: its mode, as in
    backward.attention_backward; masks.query: per-token query masks; query blocks of
    128 / pack positions x pack query heads; align: the walks' alignment, none in the
    "ordered" mode) and report as compile_forward does."""
    from flash_msa.ops.gluon import backward, forward

    masks = forward.Masks() if masks is None else masks
    rows = dict(k_desc=backward.BLOCK_N, v_desc=backward.BLOCK_N, dk_desc=backward.HALF_N,
                dv_desc=backward.HALF_N)  # fmt: skip
    types = {name: descriptor_type(dtype, count, head_dim) for name, count in rows.items()}
    half = forward.half_block(pack, head_dim)
    types.update(
        q_desc=descriptor_type(dtype, *half), do_desc=descriptor_type(dtype, *half),
        dq_desc=descriptor_type("fp32", *forward.half_block(pack, head_dim // 2)), lse="*fp32",
        delta="*fp32", grad_k=f"*{dtype}", grad_v=f"*{dtype}",
        t_row_offsets="*i32", t_col_indices="*i32", qk_scale="fp32", softmax_scale="fp32",
        document_first="*i32", document_last="*i32", counters="*i32", turns="*i32",
        query_masks="*i64",
    )  # fmt: skip
    constexprs = dict(NUM_STAGES=num_stages, GRAD_Q=grad_q != "triton",
                      ORDERED=grad_q == "ordered", ALIGN=0 if grad_q == "ordered" else align,
                      **masks.constexprs(),
                      HAS_QUERY_MASKS=masks.query, PACK=pack)  # fmt: skip
    packed = f"_pack{pack}" if pack > 1 else ""
    name = (f"backward_d{head_dim}_{dtype}_s{num_stages}_{grad_q}{packed}"
            f"{_mask_flags(masks)}")  # fmt: skip
    return compile_kernel(backward._backward_kernel, types, constexprs, workdir, name)


def compile_grad_q(
    workdir: str, *, head_dim: int = 128, dtype: str = "bf16", num_stages: int = 2,
    masks=None, pack: int = 1,
) -> dict:  # fmt: skip
    """Compile dq.dq_kernel for sm_90a (masks and pack as in compile_forward) and report as
    compile_forward does."""
    from flash_msa.ops.gluon import dq, forward

    masks = forward.Masks() if masks is None else masks
    half = forward.half_block(pack, head_dim)
    types = dict(
        q_desc=descriptor_type(dtype, *half), do_desc=descriptor_type(dtype, *half),
        dq_desc=descriptor_type(dtype, *half),
        k_desc=descriptor_type(dtype, forward.BLOCK_N, head_dim),
        v_desc=descriptor_type(dtype, forward.BLOCK_N, head_dim),
        lse="*fp32", delta="*fp32", row_order="*i32", row_offsets="*i32", col_indices="*i32",
        query_masks="*i64", qk_scale="fp32", softmax_scale="fp32", grad_q=f"*{dtype}",
        document_first="*i32", document_last="*i32",
    )  # fmt: skip
    constexprs = dict(NUM_STAGES=num_stages, **masks.constexprs(), HAS_QUERY_MASKS=masks.query,
                      PACK=pack)  # fmt: skip
    packed = f"_pack{pack}" if pack > 1 else ""
    name = f"grad_q_d{head_dim}_{dtype}_s{num_stages}{packed}{_mask_flags(masks)}"
    return compile_kernel(dq.dq_kernel, types, constexprs, workdir, name)


def _mask_flags(masks) -> str:
    return "".join(f"_{name}" for name, value in masks._asdict().items() if value)


def compile_kernel(kernel, types: dict, constexprs: dict, workdir: str, name: str) -> dict:
    """Compile a Gluon kernel for sm_90a (arguments not in types are i32; 4 warps a
    partition's default, at most forward.MAX_REGISTERS registers at launch) and report as
    compile_forward does."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from flash_msa.ops.gluon import forward

    signature = {
        arg: "constexpr" if arg in constexprs else types.get(arg, "i32") for arg in kernel.arg_names
    }
    compiled = triton.compile(
        GluonASTSource(kernel, signature, constexprs), target=GPUTarget(*TARGET),
        options=dict(num_warps=4, maxnreg=forward.MAX_REGISTERS),
    )  # fmt: skip
    assembled = assemble_for_sm90(compiled.asm["ptx"], workdir, name)
    cubin = assembled["cubin"]
    sass = subprocess.run(
        [CUOBJDUMP, "-sass", cubin], capture_output=True, text=True, check=True
    ).stdout
    sass_path = os.path.join(workdir, name + ".sass")
    with open(sass_path, "w") as handle:
        handle.write(sass)
    registers = [int(number) for number in re.findall(r"\bR(\d+)\b", sass)]
    return dict(
        registers=assembled["registers"],
        max_register=max(registers) + 1 if registers else 0,
        setmaxnreg=sorted({int(n) for n in re.findall(SETMAXNREG, compiled.asm["ptx"])}),
        spills=assembled["spills"],
        partition_spill_stores=partition_spill_stores(sass),
        shared=compiled.metadata.shared,
        wgmma="wgmma.mma_async" in compiled.asm["ptx"],
        overlapped_exps=overlapped_exponentials(sass),
        warnings=assembled["warnings"],
        fingerprint=sass_fingerprint(sass),
        sass=sass_path,
    )
