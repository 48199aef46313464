"""MSAAttention: rotary embeddings, argument checks, gradient routing, and training steps that
match the same layer attending through the float64 msa_reference."""

import pytest
import torch
from torch import nn

from flash_msa.modules import MSAAttention
from flash_msa.msa import msa_reference
from flash_msa.rotary import apply_rotary, rotary_tables

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
TINY = dict(num_kv_heads=2, num_proxy_heads=2, proxy_head_dim=16, top_k=2, q_block=16,
            kv_block=32)  # fmt: skip


def _grad_norm(parameter: torch.Tensor) -> float:
    return 0.0 if parameter.grad is None else float(parameter.grad.norm())


def test_rotary_matches_complex_rotation():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 50, 3, 8, generator=generator, dtype=torch.float64)
    cos, sin = rotary_tables(50, 8, base=500.0)
    # Channel pair (i, i + D/2) as the complex number x_i + 1j x_(i+D/2), times e^(1j angle).
    frequencies = 500.0 ** (-torch.arange(4, dtype=torch.float64) / 4)  # base^(-2i / D)
    angles = torch.arange(50, dtype=torch.float64)[:, None] * frequencies  # [S, D / 2]
    turns = torch.polar(torch.ones_like(angles), angles)[:, None, :]  # [S, 1, D / 2]
    rotated = torch.complex(x[..., :4], x[..., 4:]) * turns
    expected = torch.cat([rotated.real, rotated.imag], dim=-1)
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"tables \[50, 4\] do not fit x \[2, 50, 3, 6\]"):
        apply_rotary(x[..., :6], cos, sin)
    with pytest.raises(ValueError, match="rotary dim must be a positive even int, got 7"):
        rotary_tables(50, 7)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(embed_dim=30), "embed_dim 30 must be divisible by num_heads 4"),
        (dict(num_kv_heads=0), "num_kv_heads must be a positive int, got 0"),
        (dict(num_proxy_heads=3), "num_heads 4 must be a multiple of num_proxy_heads 3"),
        (dict(num_proxy_heads=1), "num_proxy_heads 1 must be a multiple of num_kv_heads 2"),
        (dict(num_proxy_kv_heads=4), "num_proxy_heads 2 must be a multiple of num_proxy_kv_heads"),
        (dict(proxy_head_dim=15), "proxy_head_dim 15 must be even"),
        (dict(embed_dim=12, num_heads=4), "head_dim 3 must be even"),
        (dict(top_k=0), "top_k must be a positive int, got 0"),
        (dict(q_block=48), r"q_block must be one of \(16, 32, 64, 128\), got 48"),
        (dict(q_block=64, kv_block=32), "q_block 64 must be <= kv_block 32"),
        (dict(rope_base=0.5), "rope_base must be > 1, got 0.5"),
    ],
)
def test_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MSAAttention(**{"embed_dim": 32, "num_heads": 4, **TINY, **kwargs})


def test_shapes_and_gradient_routing():
    torch.manual_seed(0)
    layer = MSAAttention(32, 4, **TINY, device=DEVICE)
    x = torch.randn(2, 96, 32, device=DEVICE)
    out, kl_loss = layer(x)
    assert out.shape == (2, 96, 32) and kl_loss.shape == () and kl_loss.item() > 0
    with pytest.raises(ValueError, match=r"x must be \[batch, seq_len, embed_dim\] with embed"):
        layer(x[..., :16])

    # The task loss trains q, k, v and the output; selection passes nothing to the proxy.
    out.square().mean().backward()
    assert _grad_norm(layer.qkv_proj.weight) > 0 and _grad_norm(layer.out_proj.weight) > 0
    assert _grad_norm(layer.proxy_proj.weight) == 0
    # kl_loss trains the proxy only.
    layer.zero_grad(set_to_none=True)
    layer(x)[1].backward()
    assert _grad_norm(layer.proxy_proj.weight) > 0
    assert _grad_norm(layer.qkv_proj.weight) == 0 and _grad_norm(layer.out_proj.weight) == 0


class _ReferenceMSAAttention(MSAAttention):
    """MSAAttention attending through msa_reference in float64."""

    def attend(self, q_proxy, k_proxy, q, k, v, warmup):
        out, kl_loss, _ = msa_reference(
            *(tensor.double() for tensor in (q_proxy, k_proxy, q, k, v)),
            top_k=self.top_k, q_block=self.q_block, kv_block=self.kv_block, warmup=warmup,
        )  # fmt: skip
        return out.to(q.dtype), kl_loss.to(q.dtype)


class _TinyModel(nn.Module):
    """Two residual MSA layers: the second's kl_loss also trains the first, through its input."""

    def __init__(self, layer_class):
        super().__init__()
        self.layers = nn.ModuleList(
            layer_class(32, 4, **TINY, bias=True, device=DEVICE) for _ in range(2)
        )

    def forward(self, x, warmup):
        kl_total = 0.0
        for layer in self.layers:
            out, kl_loss = layer(x, warmup=warmup)
            x, kl_total = x + out, kl_total + kl_loss
        return x, kl_total


def test_training_steps_match_reference():
    torch.manual_seed(0)
    model = _TinyModel(MSAAttention)
    reference = _TinyModel(_ReferenceMSAAttention)
    reference.load_state_dict(model.state_dict())
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    x = torch.randn(2, 96, 32, device=DEVICE)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference)]
    for warmup in (True, False, False):  # a warm-up step, then steps on selected blocks
        losses = []
        for m, optimizer in zip((model, reference), optimizers, strict=True):
            optimizer.zero_grad()
            out, kl_loss = m(x, warmup)
            loss = out.square().mean() + 0.5 * kl_loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    trained = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        expected = trained[name].detach()
        error = float((parameter.detach() - expected).norm() / expected.norm())
        assert error < 1e-4, f"{name}: relative difference {error:.2e}"
        # Every parameter moved, the proxy's included: the comparison covers real updates.
        moved = float((expected - initial[name]).norm() / initial[name].norm())
        assert moved > 1e-3, f"{name} barely moved ({moved:.1e})"
