"""The needle LM: every variant's forward and backward at a tiny size, shared parameters
alike across variants, and the sparse variants equal to dense where they keep every key."""

import dataclasses

import pytest
import torch

from flash_msa import _env
from flash_msa.niah.model import VARIANTS, ModelConfig, NeedleLM, init_parameters
from flash_msa.niah.tasks import NeedleConfig, training_batch

NEEDLES = NeedleConfig()
# Sparse at 128 tokens: a window of 32 + 16 sinks in blocks of 16, one key block of 64.
TINY = ModelConfig(
    vocab_size=NEEDLES.vocab_size, layers=2, dim=64, heads=4, kv_heads=2, window=32, sinks=16,
    block_size=16, top_k=1, q_block=64, kv_block=64,
)  # fmt: skip
needs_triton = pytest.mark.skipif(
    not _env.can_run_triton(torch.device("cpu")),
    reason="the models run on the CPU, where oracle_topk and msa need TRITON_INTERPRET=1",
)


def model_of(variant: str, config: ModelConfig = TINY, seed: int = 0) -> NeedleLM:
    model = NeedleLM(variant, config)
    init_parameters(model, seed)
    return model


@needs_triton
@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_and_backward_of_every_variant(variant):
    batch = training_batch(0, 128, 1, NEEDLES, seed=0)
    model = model_of(variant)
    for warmup in (False, True) if variant == "msa" else (False,):
        model.zero_grad(set_to_none=True)
        logits, kl_loss = model(batch.tokens, batch.positions, warmup=warmup)
        assert logits.shape == (len(batch.positions), NEEDLES.vocab_size)
        assert logits.dtype == torch.float32 and logits.isfinite().all()
        loss = torch.nn.functional.cross_entropy(logits, batch.targets)
        if variant == "msa":
            assert kl_loss.dim() == 0 and kl_loss.isfinite() and kl_loss >= 0
            loss = loss + 0.1 * kl_loss
        else:
            assert kl_loss is None
        loss.backward()
        for name, parameter in model.named_parameters():
            assert parameter.grad is not None and parameter.grad.isfinite().all(), name
        assert model.layers[0].attention.qkv_proj.weight.grad.abs().sum() > 0
        if variant == "msa":  # the proxy learns from the KL loss alone
            assert model.layers[0].attention.proxy_proj.weight.grad.abs().sum() > 0


def test_variants_share_parameter_names_and_initial_values():
    dense = model_of("dense").state_dict()
    for variant in VARIANTS[1:]:
        other = model_of(variant).state_dict()
        shared = dense.keys() & other.keys()
        assert shared == dense.keys()
        assert all(torch.equal(dense[name], other[name]) for name in shared)
        extra = other.keys() - dense.keys()
        proxies = {f"layers.{i}.attention.proxy_proj.weight" for i in range(2)}
        assert extra == (proxies if variant == "msa" else set())
    reseeded = model_of("dense", seed=1).state_dict()
    assert not torch.equal(dense["embed.weight"], reseeded["embed.weight"])


def test_window_within_its_window_equals_dense():
    config = dataclasses.replace(TINY, window=128)  # every key of 100 tokens in the window
    batch = training_batch(1, 100, 2, NEEDLES, seed=0)
    dense, window = model_of("dense", config), model_of("window", config)
    expected, _ = dense(batch.tokens, batch.positions)
    got, _ = window(batch.tokens, batch.positions)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    short, _ = model_of("window")(batch.tokens, batch.positions)  # window 32: it differs
    assert not torch.allclose(short, expected, atol=1e-3)


@needs_triton
@pytest.mark.parametrize("variant", ["oracle_topk", "msa"])
def test_selections_keeping_every_block_equal_dense(variant):
    config = dataclasses.replace(TINY, top_k=2)  # 2 key blocks of 64: all of 128 tokens
    batch = training_batch(2, 128, 1, NEEDLES, seed=0)
    expected, _ = model_of("dense", config)(batch.tokens, batch.positions)
    got, _ = model_of(variant, config)(batch.tokens, batch.positions)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(dim=62), r"dim \(--dim\) 62 must be a multiple of heads \(--heads\)"),
        (dict(kv_heads=3), "multiple of kv_heads"),
        (dict(layers=0), r"layers \(--layers\) must be a positive int"),
        (dict(rope_base=1.0), "rope_base must be a finite number > 1"),
        (dict(rope_base=float("nan")), "rope_base must be a finite number > 1"),
        (dict(rope_base="abc"), "rope_base must be a finite number > 1"),
        (dict(dim=12), r"head_dim 3 = dim \(--dim\) / heads \(--heads\) must be even"),
    ],
)
def test_config_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **changes)


def test_unknown_variant_and_bad_tokens():
    with pytest.raises(ValueError, match="variant must be one of"):
        NeedleLM("sparse", TINY)
    with pytest.raises(ValueError, match=r"tokens must be \[batch, seq_len\]"):
        model_of("dense")(torch.zeros(8, dtype=torch.long), torch.zeros(1, dtype=torch.long))


@pytest.mark.parametrize(("granularity", "q_block"), [("token", 16), ("block", 64)])
def test_msa_tiles(granularity, q_block):
    """msa per token tiles its work as msa_func's default does (16 tokens where a proxy head
    serves 2 query heads), whatever q_block is; per block it selects per q_block queries."""
    config = dataclasses.replace(TINY, granularity=granularity)
    assert [layer.attention.q_block for layer in NeedleLM("msa", config).layers] == [q_block] * 2
