"""flash_msa.integrations.transformers on tiny random-init Llama and Qwen2 models (float32,
the torch backend on the CPU), against transformers' own SDPA attention."""

import subprocess
import sys
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flash_msa import patterns  # noqa: E402
from flash_msa.integrations import transformers as flash_msa_hf  # noqa: E402

TOLERANCE = 1e-5
VOCAB = 128
TINY = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    dtype=torch.float32,
)
# Qwen2 with its own sliding window on layer 1 (layer 0 attends in full).
QWEN2_SLIDING = dict(use_sliding_window=True, sliding_window=12, max_window_layers=1)
# Qwen2-MoE keeps its sliding window in the mask alone: its attention call gets none.
QWEN2_MOE_SLIDING = dict(
    use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"] * 2,
    num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)  # fmt: skip


@pytest.fixture(scope="module")
def name():
    return flash_msa_hf.register()


def tiny_model(kind: str, seed: int = 0, **overrides):
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    return model_class(config_class(**TINY, **overrides)).eval()


def logits(model, implementation: str, input_ids, **inputs):
    model.set_attn_implementation(implementation)
    return model(input_ids, use_cache=False, **inputs).logits


def tokens(*shape, seed: int = 1):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def window_block_mask(seq_len: int, window: int, block: int) -> torch.Tensor:
    """bool [S, S]: causal pairs whose key block reaches back to the window of the query
    block's first token, as the sliding_window pattern's blocks are defined."""
    i = torch.arange(seq_len)[:, None]
    j = torch.arange(seq_len)[None, :]
    first_kv_block = (torch.clamp(i // block * block - window, min=0)) // block
    return (j <= i) & (j // block >= first_kv_block)


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=TOLERANCE)


def test_import_leaves_transformers_unimported():
    code = (
        "import sys, flash_msa, flash_msa.integrations.transformers; "
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_register_adds_attention_and_mask_functions(name):
    assert name == flash_msa_hf.ATTENTION_NAME
    assert name in transformers.AttentionInterface()
    assert name in transformers.AttentionMaskInterface()
    with pytest.raises(ValueError, match="without 'flash'"):
        flash_msa_hf.register("flash_msa")
    assert flash_msa_hf.register(name) == name  # again: the same function, nothing changes
    from flash_msa.integrations import transformers_msa

    flash_msa_hf._register(transformers_msa.ATTENTION_NAME, transformers_msa.attention_forward)
    for taken in ("sdpa", "eager", "paged|sdpa", transformers_msa.ATTENTION_NAME):
        with pytest.raises(ValueError, match=f"name {taken!r} is taken"):
            flash_msa_hf.register(taken)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_dense_causal_equals_sdpa(name, kind, tmp_path):
    model = tiny_model(kind)
    input_ids = tokens(2, 45)  # not a multiple of the 128-token blocks
    expected = logits(model, "sdpa", input_ids)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path, attn_implementation=name).eval()
    assert loaded.config._attn_implementation == name
    close(loaded(input_ids, use_cache=False).logits, expected)


def test_sliding_window_layout_equals_masked_sdpa(name):
    model = tiny_model("llama")
    model.config.flash_msa = {"pattern": "sliding_window", "window": 20, "block_size": 16}
    input_ids = tokens(2, 64)
    mask = window_block_mask(64, 20, 16)
    assert not mask.tril().all()  # the layout drops blocks: not the dense attention
    expected = logits(model, "sdpa", input_ids, attention_mask=mask.expand(2, 1, 64, 64))
    close(logits(model, name, input_ids), expected)


def test_per_layer_patterns(name):
    model = tiny_model("llama")
    window = {"pattern": "sliding_window", "window": 20, "block_size": 16}
    model.config.flash_msa = ["causal", window]
    masks = [torch.ones(64, 64, dtype=torch.bool).tril(), window_block_mask(64, 20, 16)]

    def masked_sdpa(module, query, key, value, attention_mask, scaling=None, **kwargs):
        groups = query.shape[1] // key.shape[1]
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=masks[module.layer_idx], scale=scaling
        )
        return out.transpose(1, 2), None

    transformers.AttentionInterface.register("test_per_layer_masked_sdpa", masked_sdpa)
    input_ids = tokens(2, 64)
    expected = logits(model, "test_per_layer_masked_sdpa", input_ids)
    close(logits(model, name, input_ids), expected)


def test_model_sliding_window_equals_sdpa(name):
    model = tiny_model("qwen2", **QWEN2_SLIDING)
    input_ids = tokens(2, 40)
    expected = logits(model, "sdpa", input_ids)
    close(logits(model, name, input_ids), expected)  # dense layout, the window masked in
    # Layer 1 (the sliding one) over window blocks that cover the model's window.
    model.config.flash_msa = [
        "causal",
        {"pattern": "sliding_window", "window": 11, "block_size": 16},
    ]
    close(logits(model, name, input_ids), expected)
    # Dilated blocks skip the block before the diagonal, which the window reaches into.
    model.config.flash_msa = {"pattern": "dilated", "window": 32, "dilation": 2, "block_size": 16}
    with pytest.raises(ValueError, match="sliding window of 12 tokens"):
        logits(model, name, input_ids)


def test_a_window_in_the_mask_alone_equals_sdpa(name):
    """Qwen2-MoE's window reaches the layers through the mask only: it is read off the mask
    and applied, alone and within packed documents."""
    model = tiny_model("qwen2_moe", **QWEN2_MOE_SLIDING)
    input_ids = tokens(2, 40)
    close(logits(model, name, input_ids), logits(model, "sdpa", input_ids))
    lengths = [13, 20, 7]
    packed = tokens(1, 40, seed=2)
    expected = [logits(model, "sdpa", part) for part in packed.split(lengths, dim=1)]
    position_ids = torch.cat([torch.arange(length) for length in lengths])[None]
    close(logits(model, name, packed, position_ids=position_ids), torch.cat(expected, dim=1))


@pytest.mark.parametrize(
    "mask_function, window",
    [
        (lambda b, h, q, kv: kv <= q, None),
        (lambda b, h, q, kv: (kv <= q) & (kv > q - 5), 5),
        (lambda b, h, q, kv: (kv <= q) & (kv > q - 3) & ((kv >= 10) == (q >= 10)), 3),
    ],
    ids=["causal", "window", "documents and window"],
)
def test_document_mask_reads_the_window(mask_function, window):
    assert flash_msa_hf.document_mask(2, 20, 20, mask_function=mask_function).window == window


def test_document_mask_refuses_other_masks():
    """Same-parity keys: every token looks like a document of its own by its neighbour, but
    sees keys two back."""
    with pytest.raises(ValueError, match="not causal attention within documents"):
        flash_msa_hf.document_mask(1, 20, 20, mask_function=lambda b, h, q, kv: (kv <= q)
                                   & (kv % 2 == q % 2))  # fmt: skip


@pytest.mark.parametrize("kind, overrides", [("llama", {}), ("qwen2", QWEN2_SLIDING)])
def test_packed_position_ids_equal_separate_sequences(name, kind, overrides):
    model = tiny_model(kind, **overrides)
    lengths = [13, 20, 15]
    documents = [tokens(1, length, seed=seed) for seed, length in enumerate(lengths)]
    expected = torch.cat([logits(model, "sdpa", document) for document in documents], dim=1)
    position_ids = torch.cat([torch.arange(length) for length in lengths])[None]
    packed = logits(model, name, torch.cat(documents, dim=1), position_ids=position_ids)
    close(packed, expected)
    # With use_cache on (the default) transformers leaves the documents out of the mask.
    cached = model(torch.cat(documents, dim=1), position_ids=position_ids).logits
    close(cached, expected)


def test_packed_cu_seq_lens_equal_separate_sequences(name):
    model = tiny_model("qwen2")
    lengths = [13, 20, 15]
    documents = [tokens(1, length, seed=seed) for seed, length in enumerate(lengths)]
    expected = torch.cat([logits(model, "sdpa", document) for document in documents], dim=1)
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = collator([{"input_ids": document[0].tolist()} for document in documents])
    assert batch["cu_seq_lens_q"].tolist() == [0, 13, 33, 48]
    batch.pop("labels")
    close(logits(model, name, **batch), expected)
    # An all-ones attention_mask keeps transformers from packing by position_ids: the
    # documents then come from cu_seq_lens_q alone.
    batch["attention_mask"] = torch.ones(1, 48, dtype=torch.long)
    close(logits(model, name, **batch), expected)
    batch.pop("attention_mask")
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, 10, 48], dtype=torch.int32)
    with pytest.raises(ValueError, match="disagree"):
        logits(model, name, **batch)
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0.0, 13.5, 48.0])
    with pytest.raises(TypeError, match="cu_seq_lens_q must be an int tensor .* got torch.float32"):
        logits(model, name, **batch)


def test_gradients_equal_sdpa(name):
    input_ids = tokens(2, 40)
    grads = {}
    for implementation in ("sdpa", name):
        model = tiny_model("llama").train()
        model.set_attn_implementation(implementation)
        model(input_ids, labels=input_ids, use_cache=False).loss.backward()
        grads[implementation] = {n: p.grad for n, p in model.named_parameters()}
    for parameter, grad in grads["sdpa"].items():
        assert grads[name][parameter] is not None, parameter
        close(grads[name][parameter], grad)
    assert grads[name]["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0


def test_dropout_in_training_only(name):
    model = tiny_model("llama", attention_dropout=0.5)
    input_ids = tokens(1, 32)
    evaluated = logits(model, name, input_ids)
    close(evaluated, logits(model, "sdpa", input_ids))
    model.train()
    torch.manual_seed(0)
    first = logits(model, name, input_ids)
    torch.manual_seed(1)
    second = logits(model, name, input_ids)
    assert (first - evaluated).abs().max() > 1e-3
    assert (first - second).abs().max() > 1e-3


def test_layout_built_once_per_length_and_device(name):
    model = tiny_model("llama")
    model.config.flash_msa = {"pattern": "sliding_window", "window": 24, "block_size": 16}
    builder = mock.create_autospec(patterns.sliding_window, side_effect=patterns.sliding_window)
    with mock.patch.object(patterns, "sliding_window", builder):
        logits(model, name, tokens(2, 56))
        logits(model, name, tokens(2, 56, seed=2))
    assert builder.call_count == 1
    layouts = [flash_msa_hf.layout_for(model.config, layer, 56) for layer in (0, 1)]
    assert layouts[0] is layouts[1]
    with pytest.raises(ValueError, match="device must name a torch device.*got 'gpu'"):
        flash_msa_hf.layout_for(model.config, 0, 56, device="gpu")
    with pytest.raises(ValueError, match=r"seq_len must be a positive int, got \[56\]"):
        flash_msa_hf.layout_for(model.config, 0, [56])


def test_deterministic_reaches_the_op(name):
    """model(..., deterministic=False) reaches every layer's block_sparse_attn_func (True when
    absent, as transformers' FlashAttention integration reads it); a non-bool is refused."""
    model = tiny_model("llama")
    op = mock.create_autospec(
        flash_msa_hf.block_sparse_attn_func, side_effect=flash_msa_hf.block_sparse_attn_func
    )
    with mock.patch.object(flash_msa_hf, "block_sparse_attn_func", op):
        logits(model, name, tokens(1, 24))
        logits(model, name, tokens(1, 24), deterministic=False)
    layers = model.config.num_hidden_layers
    flags = [call.kwargs["deterministic"] for call in op.call_args_list]
    assert flags == [True] * layers + [False] * layers
    with pytest.raises(TypeError, match="deterministic must be a bool, got str"):
        logits(model, name, tokens(1, 24), deterministic="no")


def test_padding_mask_is_refused(name):
    model = tiny_model("llama")
    attention_mask = torch.ones(2, 24, dtype=torch.long)
    attention_mask[1, :5] = 0
    with pytest.raises(ValueError, match="padding tokens.*DataCollatorWithFlattening"):
        logits(model, name, tokens(2, 24), attention_mask=attention_mask)
    logits(model, name, tokens(2, 24), attention_mask=torch.ones(2, 24))  # no padding: fine


@pytest.mark.parametrize(
    "inputs, match",
    [
        ({"attention_mask": torch.ones(1, 1, 24, 24, dtype=torch.bool)}, "explicit attention mask"),
        ({"output_attentions": True}, "output_attentions"),
        ({"attention_mask": torch.ones(1, 20)}, "attention_mask covers 20 tokens but the input "
                                                "holds 24"),
    ],
)
def test_unsupported_inputs_are_refused(name, inputs, match):
    with pytest.raises(ValueError, match=match):
        logits(tiny_model("llama"), name, tokens(1, 24), **inputs)


def test_bidirectional_mask_is_refused(name):
    model = tiny_model("llama")
    model.config.is_causal = False
    with pytest.raises(ValueError, match="later ones"):
        logits(model, name, tokens(1, 24))


def test_cached_decoding_is_refused(name):
    model = tiny_model("llama")
    model.set_attn_implementation(name)
    input_ids = tokens(1, 24)
    cache = model(input_ids, use_cache=True).cache  # the prefill runs
    with pytest.raises(ValueError, match="KV cache"):
        model(input_ids[:, -1:], cache=cache, use_cache=True)


@pytest.mark.parametrize(
    "spec, match",
    [
        ("strided", "not a layout builder"),
        ({"pattern": "topk"}, "not a layout builder"),
        ({"pattern": "sliding_window", "window": 64, "num_global": 8}, "longformer"),
        ({"pattern": "sliding_window"}, r"needs \['window'\]"),
        ({"pattern": "longformer", "window": 64, "num_global": 8, "causal": False}, "causal"),
        ({"pattern": "causal", "seq_len": 64}, "fills in"),
        (["causal"], "one spec per layer"),
        (3, "pattern name"),
    ],
)
def test_bad_specs_are_refused(name, spec, match):
    model = tiny_model("llama")
    model.config.flash_msa = spec
    with pytest.raises(ValueError, match=match):
        logits(model, name, tokens(1, 24))
