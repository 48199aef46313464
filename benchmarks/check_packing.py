"""Does GQA packing (PACK > 1 query heads per tile) compute the right thing on this GPU?

    python benchmarks/check_packing.py

Runs the forward and backward with packing on and off for a few head dims and prints the
relative error of each against the float64 reference.
"""

from __future__ import annotations

import torch

from flash_msa import patterns
from flash_msa.ops.triton import attention_backward, attention_forward, configs
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.testing import random_qkv, relative_error


def main() -> None:
    for head_dim in (32, 64, 96, 128):
        layout = patterns.random_blocks(1000, 4, block_size=64, device="cuda")
        q, k, v = random_qkv(2, 1000, 8, head_dim, heads_kv=2, dtype=torch.bfloat16,
                             device="cuda", seed=head_dim)  # fmt: skip
        mask = layout_mask(layout, 2, 8, causal=True)
        exact = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out, _ = attention_reference(*exact, mask)
        grad_out = torch.randn_like(q)
        ref_grads = torch.autograd.grad(ref_out, exact, grad_out.double())
        for pack in (False, True):
            configs.PACK_GQA = pack
            options = dict(causal=True, window_size=(-1, -1), softmax_scale=head_dim**-0.5)
            out, lse = attention_forward(q, k, v, layout, **options)
            grads = attention_backward(grad_out, q, k, v, out, lse, layout, **options)
            errors = [relative_error(out, ref_out)] + [
                relative_error(g, r) for g, r in zip(grads, ref_grads, strict=True)
            ]
            print(f"D={head_dim:4d} pack={pack!s:5s} out/dq/dk/dv rel err: "
                  + " ".join(f"{e:.2e}" for e in errors), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
