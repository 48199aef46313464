"""torch.compile(model, fullgraph=True) of a whole decoder (embedding, blocks of attention and
MLP, norm, LM head) with the library's layers: one graph, no break, eager's outputs and
gradients."""

import functools

import pytest
import torch
from torch import nn

from flash_msa import FlashSparseAttention, MSAAttention, _env, patterns
from flash_msa.testing import relative_error

VOCAB, DIM, HEADS, KV_HEADS, LAYERS, SEQ_LEN = 64, 32, 4, 2, 2, 64


class Block(nn.Module):
    """Pre-norm decoder block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention = attention
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.SiLU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, DIM] -> (x [B, S, DIM], the block's KL loss: 0 without MSA)."""
        attended = self.attention(self.attention_norm(x))
        attended, kl_loss = attended if isinstance(attended, tuple) else (attended, x.new_zeros(()))
        x = x + attended
        return x + self.mlp(self.mlp_norm(x)), kl_loss


class Decoder(nn.Module):
    """tokens [B, S] -> (logits [B, S, VOCAB], the mean KL loss of the blocks)."""

    def __init__(self, attention: functools.partial):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(attention()) for _ in range(LAYERS))
        self.norm, self.lm_head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, kl_losses = self.embedding(tokens), []
        for block in self.blocks:
            x, kl_loss = block(x)
            kl_losses.append(kl_loss)
        return self.lm_head(self.norm(x)), torch.stack(kl_losses).mean()


def sparse_attention(backend: str, device: str) -> functools.partial:
    """A FlashSparseAttention factory: a fixed window + sinks layout on `device` (a layout
    built in the graph would run a builder under tracing)."""
    layout = patterns.sliding_window(SEQ_LEN, 32, block_size=16, device=device)
    layout = layout | patterns.global_tokens(SEQ_LEN, 16, block_size=16, device=device)
    return functools.partial(
        FlashSparseAttention, DIM, HEADS, num_kv_heads=KV_HEADS, block_size=16, pattern=layout,
        backend=backend,
    )  # fmt: skip


def msa_attention() -> functools.partial:
    return functools.partial(
        MSAAttention, DIM, HEADS, num_kv_heads=KV_HEADS, num_proxy_heads=2, proxy_head_dim=16,
        top_k=2, q_block=16, kv_block=16,
    )  # fmt: skip


def step(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor):
    """One training step's loss (next-token cross-entropy + 0.1 KL) and its gradients."""
    model.zero_grad()
    logits, kl_loss = model(tokens)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()) + 0.1 * kl_loss
    loss.backward()
    return [loss.detach(), logits.detach(), kl_loss.detach()], [
        parameter.grad.clone() for parameter in model.parameters()
    ]


def assert_one_graph_matching_eager(attention: functools.partial, device: str, tolerance: float):
    torch.manual_seed(0)
    model = Decoder(attention).to(device)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ_LEN + 1), generator=generator).to(device)
    tokens, targets = tokens[:, :-1], tokens[:, 1:]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got, got_grads = step(compiled, tokens, targets)
    counters = torch._dynamo.utils.counters
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1  # the whole forward, traced once
    want, want_grads = step(model, tokens, targets)
    assert all(grad.abs().sum() > 0 for grad in want_grads)  # every parameter is reached
    for actual, expected in zip(got + got_grads, want + want_grads, strict=True):
        assert relative_error(actual, expected) < tolerance


def test_sparse_attention_model_compiles_to_one_graph():
    """The torch backend on the CPU: the custom op holds the backend, the rest is torch."""
    assert_one_graph_matching_eager(sparse_attention("torch", "cpu"), "cpu", 1e-6)


@pytest.mark.skipif(
    not _env.interpreting(), reason="MSA's Triton kernels on the CPU need TRITON_INTERPRET=1"
)
def test_msa_model_compiles_to_one_graph():
    """MSA: block scores, top-k selection, the main attention and the KL custom op in one
    graph (its Triton kernels through the interpreter)."""
    assert_one_graph_matching_eager(msa_attention(), "cpu", 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sparse", "msa"])
def test_model_compiles_to_one_graph_on_the_gpu(attention):
    """The same with the GPU kernels (backend "auto")."""
    factory = sparse_attention("auto", "cuda") if attention == "sparse" else msa_attention()
    assert_one_graph_matching_eager(factory, "cuda", 1e-5)
