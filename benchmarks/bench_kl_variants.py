"""Where the Gluon KL rows kernel's time goes: the kernel as it stands against edits of its
source, on bench_msa's inputs (bf16, H_q 64, H_kv 4, H_p 4, H_pk 1, D = D_p = 128, top_k 16,
kv_block 128) and their per-token selection over 16-token tiles (the KL's), local proxies;
the loss alone and with its gradients (the rows kernel writes the q_proxy gradient and the
tiles dk_proxy reads), medians of 3 timed calls after one untimed.

    python3 benchmarks/bench_kl_variants.py [--seq-len 1m] [--variants A,E]

A: flash_msa/msa/kl_gluon.py as it stands.
E: the teacher's exponentials left out (probabilities taken as the exponents themselves):
   A minus E is what the exponentials cost beyond what runs under the products.
Each variant's loss and q_proxy gradient are compared with A's (largest difference; E's
differ).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import pathlib
import tempfile
from unittest import mock

import bench_msa
import torch
from common import median_ms

from flash_msa import block_sparse_attn_func
from flash_msa.bench import parse_length
from flash_msa.msa import kl, proxy_kl_loss
from flash_msa.msa.interface import select

SOURCE = (pathlib.Path(__file__).parents[1] / "flash_msa/msa/kl_gluon.py").read_text()
EXPONENTIALS = "    probs = gl.exp2(s * qk_scale_log2 - gl.expand_dims(lse, 0))"
VARIANTS = {
    "A": SOURCE,
    "E": SOURCE.replace(EXPONENTIALS, "    probs = s * qk_scale_log2 - gl.expand_dims(lse, 0)"),
}


def load_variant(name: str, folder: pathlib.Path):
    """The variant's source as a module of its own (Triton reads the kernels from the file)."""
    assert EXPONENTIALS in SOURCE, "kl_gluon.py changed: edit VARIANTS"
    path = folder / f"kl_gluon_{name}.py"
    path.write_text(VARIANTS[name])
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=parse_length, default=parse_length("1m"))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    device, scale = torch.device("cuda"), bench_msa.HEAD_DIM**-0.5
    inputs = bench_msa.random_inputs(args.seq_len, device, "local")
    q_proxy, k_proxy, q, k, v = (inputs[name] for name in ("q_proxy", "k_proxy", "q", "k", "v"))
    with torch.no_grad():
        (layout, masks), _ = select(
            q_proxy, k_proxy, top_k=bench_msa.TOP_K, q_block=16, kv_block=bench_msa.KV_BLOCK,
            granularity="token", proxy_softmax_scale=scale, warmup=False, document_ids=None,
            cu_seqlens=None,
        )  # fmt: skip
        lse = block_sparse_attn_func(q, k, v, layout, causal=True, return_lse=True,
                                     query_masks=masks)[1]  # fmt: skip
    loss = functools.partial(
        proxy_kl_loss, q_proxy.detach().requires_grad_(), k_proxy, q, k, lse, layout,
        softmax_scale=scale, proxy_softmax_scale=scale, query_masks=masks,
    )  # fmt: skip
    print("| variant | loss ms | loss + gradients ms | loss | largest difference from A: loss "
          "/ dq_proxy |\n|---|---|---|---|---|")  # fmt: skip
    reference = None
    with tempfile.TemporaryDirectory() as folder:
        for name in args.variants.split(","):
            with mock.patch.object(kl, "kl_gluon", load_variant(name, pathlib.Path(folder))):
                with torch.no_grad():
                    times = [median_ms(loss)]
                times.append(median_ms(loss))
                value = loss()
                outputs = (value.detach(), torch.autograd.grad(value, loss.args[0])[0])
            reference = outputs if reference is None else reference
            differences = [(mine.float() - theirs.float()).abs().max().item()
                           for mine, theirs in zip(outputs, reference, strict=True)]  # fmt: skip
            print(f"| {name} | {times[0]:.1f} | {times[1]:.1f} | {outputs[0].item():.6f} "
                  f"| {differences[0]:.2e} / {differences[1]:.2e} |", flush=True)  # fmt: skip

if __name__ == "__main__":
    main()
