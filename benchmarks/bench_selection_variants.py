"""Where select_tokens' time goes: the kernel as it stands against edits of its source, on
bench_msa's local proxies (bf16 and FP8 scores, H_p 4, H_pk 1, D_p 128, top_k 16, kv_block
128), medians of 5 timed calls after one untimed (autotuning) call.

    python3 benchmarks/bench_selection_variants.py [--seq-len 512k] [--variants A,B,C]

A: the Triton kernel of flash_msa/msa/token_selection.py as it stands.
B: without the running top-k (each block's row maxima only folded into one running max):
   A minus B is the top-k's share.
C: the top-k update skipped when no row of the program takes the block (one reduction over
   the program's rows, and so one barrier, per block); checked equal to A.
G: select_tokens as it runs on sm_90, the Gluon kernel (token_selection_gluon.py); checked
   equal to A.
A, B and C run the Triton kernel wherever the Gluon one would take the call.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import pathlib
import tempfile
import types

import bench_msa
import torch
from common import median_ms

from flash_msa.bench import parse_length
from flash_msa.msa.fp8 import FP8

SOURCE = (pathlib.Path(__file__).parents[1] / "flash_msa/msa/token_selection.py").read_text()
UPDATE = """        slot_scores, slot_blocks, worst = enter_block(
            slot_scores, slot_blocks, worst, score, block, slots, TOP_K
        )
"""
AFTER_WALK = "    blocks, columns = ranked_blocks("
VARIANTS = {
    "A": SOURCE,
    "B": SOURCE.replace(UPDATE, "        worst = tl.maximum(worst, score)\n").replace(
        AFTER_WALK,
        "    slot_blocks += (worst > 3e38).to(tl.int32)[:, None]  # keeps the walk live\n"
        + AFTER_WALK,
    ),
    "C": SOURCE.replace(
        UPDATE,
        "        if tl.max((score > worst).to(tl.int32)) > 0:\n"
        + "".join("    " + line + "\n" for line in UPDATE.splitlines()),
    ),
    "G": SOURCE,
}


def load_variant(name: str, folder: pathlib.Path):
    """The variant's source as a module of its own (its ops renamed, so they do not clash)."""
    assert UPDATE in SOURCE and AFTER_WALK in SOURCE, "token_selection.py changed: edit VARIANTS"
    path = folder / f"token_selection_{name}.py"
    path.write_text(VARIANTS[name].replace('"flash_msa::', f'"flash_msa_variant_{name}::'))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # Triton reads the kernels' source from the file
    if name != "G":
        module.token_selection_gluon = types.SimpleNamespace(supports=lambda *args: False)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=parse_length, default=parse_length("512k"))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    seq_len = args.seq_len
    q_proxy, k_proxy = (t.bfloat16() for t in bench_msa.local_proxies(seq_len, "cuda"))
    flops = bench_msa.HEADS_PROXY * seq_len**2 / 2 * bench_msa.PROXY_HEAD_DIM * 2  # causal
    expected = {}
    print("| variant | scores | ms | TFLOP/s (causal proxy products) | selection equal to A |\n"
          "|---|---|---|---|---|")  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        for name in args.variants.split(","):
            module = load_variant(name, pathlib.Path(folder))
            for scores, dtype in (("bf16", None), ("fp8", FP8)):
                select = functools.partial(
                    module.select_tokens, q_proxy, k_proxy, top_k=bench_msa.TOP_K,
                    kv_block=bench_msa.KV_BLOCK, score_dtype=dtype,
                )  # fmt: skip

                selected = select()
                ms = median_ms(select, repeats=5)
                if name == "A":
                    expected[scores] = selected
                equal = "-" if name == "B" or scores not in expected else (
                    "yes" if torch.equal(selected, expected[scores]) else "no")  # fmt: skip
                print(f"| {name} | {scores} | {ms:.2f} | {flops / ms / 1e9:.0f} | {equal} |",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
