"""msa_checkpoint_context: a checkpointed msa_func selects once, and its gradients are those
of the call without checkpointing (to fp32 rounding)."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from flash_msa.msa import interface, msa_checkpoint_context, msa_func

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
SELECTORS = {"block": "block_scores", "token": "select_tokens"}  # what each selection runs


def _inputs(seed: int):
    """q_proxy, k_proxy, q, k, v: [1, 200, H, D] with H_q 4, H_kv 2, H_p 2, H_pk 1. The proxies
    are multiples of 1/4, so every proxy logit is exact in fp32 whatever the order of its sum:
    a recomputed selection is the first one (the interpreter's sums are not bitwise repeatable
    across calls, and a near tie that rounds the other way selects another block)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(2, 16), (1, 16), (4, 16), (2, 16), (2, 16)]
    tensors = [torch.randn(1, 200, heads, dim, generator=generator) for heads, dim in shapes]
    tensors[:2] = [torch.round(proxy * 4) / 4 for proxy in tensors[:2]]
    return [tensor.to(DEVICE).requires_grad_() for tensor in tensors]


def _step(granularity, *tensors):
    """The loss of one attention call (output and KL loss), like a layer's."""
    out, kl_loss = msa_func(*tensors, top_k=2, q_block=32, kv_block=64, granularity=granularity)
    return (out * torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum() + kl_loss


@pytest.mark.parametrize("granularity", ["block", "token"])
@pytest.mark.parametrize("keep_selection", [False, True])
def test_checkpointed_selection_runs_once_and_gradients_match(
    granularity, keep_selection, monkeypatch
):
    tensors = _inputs(seed=len(granularity))
    expected = torch.autograd.grad(_step(granularity, *tensors), tensors)

    selector = getattr(interface, SELECTORS[granularity])
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return selector(*args, **kwargs)

    monkeypatch.setattr(interface, SELECTORS[granularity], counted)
    context = {"context_fn": msa_checkpoint_context} if keep_selection else {}
    loss = checkpoint(_step, granularity, *tensors, use_reentrant=False, **context)
    grads = torch.autograd.grad(loss, tensors)
    # Plain checkpointing selects again in the recomputation; the context keeps the first.
    assert len(calls) == (1 if keep_selection else 2)
    for name, got, want in zip(("q_proxy", "k_proxy", "q", "k", "v"), grads, expected,
                               strict=True):  # fmt: skip
        # The same kernels on the same selection: equal up to fp32 rounding (the interpreter's
        # sums are not bitwise repeatable across processes).
        torch.testing.assert_close(got, want, msg=lambda text, name=name: f"{name}: {text}")
