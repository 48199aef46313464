"""flash_msa.integrations.transformers_msa on tiny random-init Llama, Qwen2 and Mistral models
(float32, msa_func's kernels through the Triton interpreter on the CPU), against transformers'
own SDPA attention and the eager msa_reference."""

import subprocess
import sys
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from flash_msa.integrations import transformers_msa as msa_hf  # noqa: E402
from flash_msa.msa import msa_func, msa_reference  # noqa: E402
from flash_msa.rotary import apply_rotary, rotary_tables  # noqa: E402

TOLERANCE = 1e-5
VOCAB = 128
TINY = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    dtype=torch.float32,
)
# 16-token query blocks and 32-token kv blocks; 2 proxy heads serve 2 query heads each.
MSA = dict(num_proxy_heads=2, proxy_head_dim=16, q_block=16, kv_block=32)


def tiny_model(kind: str = "llama", seed: int = 0, **overrides):
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    return model_class(config_class(**TINY, **overrides)).eval()


def converted(kind: str = "llama", top_k: int = 2, warmup: bool = False, **overrides):
    model = msa_hf.convert_to_msa(tiny_model(kind, **overrides), top_k=top_k, **MSA)
    msa_hf.set_msa_warmup(model, warmup)
    return model


def logits(model, input_ids, implementation: str = msa_hf.ATTENTION_NAME, **inputs):
    model.set_attn_implementation(implementation)
    return model(input_ids, use_cache=False, **inputs).logits


def tokens(*shape, seed: int = 1):
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def close(actual, expected, tolerance=TOLERANCE):
    torch.testing.assert_close(actual, expected, rtol=0, atol=tolerance)


def test_import_leaves_transformers_unimported():
    code = (
        "import sys, flash_msa.integrations.transformers_msa; "
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_warmup_equals_sdpa(kind):
    model = converted(kind, warmup=True)
    assert model.config._attn_implementation == msa_hf.ATTENTION_NAME
    assert model.config.flash_msa_msa == dict(
        top_k=2,
        **MSA,
        granularity="token",
        score_dtype=None,
        rope_base=model.config.rope_parameters["rope_theta"],
        warmup=True,
    )
    input_ids = tokens(1, 72)  # not a multiple of the blocks
    actual = logits(model, input_ids)
    close(actual, logits(model, input_ids, "sdpa"))
    assert msa_hf.collect_kl_loss(model) > 0


def test_sparse_with_every_block_equals_sdpa():
    model = converted(top_k=3)  # 72 tokens: 3 kv blocks
    input_ids = tokens(2, 72)
    close(logits(model, input_ids), logits(model, input_ids, "sdpa"))


def test_sparse_equals_msa_reference():
    """Each layer's output and KL loss equal msa_reference (float64) on the layer's own
    projections, rotated as the model rotates them and the proxy by flash_msa.rotary."""
    model = converted(top_k=2)
    seen = {}

    def keep_input(module, args, kwargs):
        seen[module.layer_idx] = [kwargs["hidden_states"], kwargs["position_embeddings"]]

    def keep_output(module, args, output):
        seen[module.layer_idx].append(output[0])

    layers = [layer.self_attn for layer in model.model.layers]
    for layer in layers:
        layer.register_forward_pre_hook(keep_input, with_kwargs=True)
        layer.register_forward_hook(keep_output)
    seq_len, settings = 130, model.config.flash_msa_msa
    logits(model, tokens(1, seq_len))
    kl_losses = []
    for layer in layers:
        hidden, (cos, sin), output = seen[layer.layer_idx]
        heads = (1, seq_len, -1, layer.head_dim)
        q, k = (projection(hidden).view(heads).transpose(1, 2)
                for projection in (layer.q_proj, layer.k_proj))  # fmt: skip
        q, k = (t.transpose(1, 2) for t in apply_rotary_pos_emb(q, k, cos, sin))
        v = layer.v_proj(hidden).view(heads)
        proxy = layer.proxy_proj(hidden).view(1, seq_len, 3, settings["proxy_head_dim"])
        proxy = apply_rotary(proxy, *rotary_tables(seq_len, 16, base=settings["rope_base"]))
        out, kl_loss, mask = msa_reference(
            *(t.double() for t in (proxy[:, :, :2], proxy[:, :, 2:], q, k, v)), top_k=2,
            q_block=16, kv_block=32, softmax_scale=layer.scaling,
        )  # fmt: skip
        assert mask.sum(-1).amax() <= 2 * 32  # 2 of up to 5 causal blocks per token: sparse
        close(output, layer.o_proj(out.float().reshape(1, seq_len, -1)))
        kl_losses.append(kl_loss)
    collected = msa_hf.collect_kl_loss(model)
    assert collected.dtype == torch.float32 and collected.dim() == 0
    close(collected.double(), torch.stack(kl_losses).mean(), tolerance=1e-6)


def test_gradients_reach_the_proxy_through_the_kl_loss_only():
    model = converted(top_k=1).train()
    input_ids = tokens(1, 64)
    model(input_ids, labels=input_ids, use_cache=False).loss.backward()
    proxies = {name for name, _ in model.named_parameters() if "proxy_proj" in name}
    assert len(proxies) == 2
    task_grads = {}
    for name, parameter in model.named_parameters():
        if name in proxies:
            assert parameter.grad is None or not parameter.grad.any(), name
        else:
            assert parameter.grad is not None, name
            task_grads[name] = parameter.grad.clone()
    kl_loss = msa_hf.collect_kl_loss(model)
    assert kl_loss.requires_grad
    kl_loss.backward()
    for name, parameter in model.named_parameters():
        if name in proxies:
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
        else:
            assert torch.equal(parameter.grad, task_grads[name]), name


def test_packed_rows_equal_separate_documents():
    """Documents starting on kv-block boundaries select as they do alone, even sparse;
    two rows with documents run as one packed sequence."""
    model = converted(top_k=2)
    lengths = [[32, 64], [96]]
    documents = [tokens(1, length, seed=seed) for seed, length in enumerate([32, 64, 96])]
    expected, kl_losses = [], []
    for document in documents:
        expected.append(logits(model, document))
        kl_losses.append(msa_hf.collect_kl_loss(model) * document.shape[1])
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    input_ids = torch.cat([torch.cat(documents[:2], dim=1), documents[2]])
    packed = logits(model, input_ids, position_ids=position_ids)
    close(packed, torch.cat([torch.cat(expected[:2], dim=1), expected[2]]))
    close(msa_hf.collect_kl_loss(model), sum(kl_losses) / 192)


def test_rows_compute_in_a_batch_as_they_do_alone():
    """A row's blocks start at its first token: rows of 80 tokens (not a multiple of
    kv_block 32) holding packed documents give, sparse, the logits and KL they give alone."""
    model = converted(top_k=2)
    input_ids = tokens(2, 80)
    position_ids = torch.cat([torch.arange(30), torch.arange(50)])[None]
    alone, kl_losses = [], []
    for row in input_ids.split(1):
        alone.append(logits(model, row, position_ids=position_ids))
        kl_losses.append(msa_hf.collect_kl_loss(model))
    batched = logits(model, input_ids, position_ids=position_ids.expand(2, -1))
    close(batched, torch.cat(alone))
    close(msa_hf.collect_kl_loss(model), sum(kl_losses) / 2)


def test_packed_cu_seq_lens_equal_separate_documents_in_warmup():
    model = converted("qwen2", warmup=True)
    documents = [tokens(1, length, seed=seed) for seed, length in enumerate([13, 40, 27])]
    expected = torch.cat([logits(model, document) for document in documents], dim=1)
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = collator([{"input_ids": document[0].tolist()} for document in documents])
    batch.pop("labels")
    close(logits(model, **batch), expected)


def test_save_and_load_round_trip(tmp_path):
    model = converted(top_k=2)
    input_ids = tokens(1, 96)
    expected = logits(model, input_ids)
    model.save_pretrained(tmp_path)
    loaded = msa_hf.load_msa_model(tmp_path)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert loaded.config._attn_implementation == msa_hf.ATTENTION_NAME
    assert loaded.config.flash_msa_msa == model.config.flash_msa_msa
    weights = loaded.state_dict()
    assert weights.keys() == model.state_dict().keys()
    for name, weight in model.state_dict().items():
        assert torch.equal(weights[name], weight), name
    torch.testing.assert_close(logits(loaded.eval(), input_ids), expected, rtol=0, atol=0)
    # A plain from_pretrained drops the proxies, and says so when asked to run MSA.
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="load_msa_model"):
        logits(plain, input_ids)
    with pytest.raises(ValueError, match=r"holds MSA settings .* load it with load_msa_model"):
        msa_hf.convert_to_msa(plain, **MSA)  # would start the proxies afresh
    tiny_model().save_pretrained(tmp_path / "unconverted")
    with pytest.raises(ValueError, match="no MSA settings"):
        msa_hf.load_msa_model(tmp_path / "unconverted")
    with pytest.raises(TypeError, match="config must be a transformers PretrainedConfig"):
        msa_hf.load_msa_model(tmp_path, config="x")
    with pytest.raises(ValueError, match="config is a LlamaConfig, but Qwen2ForCausalLM takes"):
        msa_hf.load_msa_model(tmp_path, model_class=transformers.Qwen2ForCausalLM)


def test_fp8_scores_reach_msa_func_and_survive_saving(tmp_path):
    model = msa_hf.convert_to_msa(tiny_model(), top_k=2, score_dtype=torch.float8_e4m3fn, **MSA)
    assert model.config.flash_msa_msa["score_dtype"] == "float8_e4m3fn"
    calls = []

    def recording(*tensors, **options):
        calls.append(options["score_dtype"])
        return msa_func(*tensors, **options)

    with mock.patch.object(msa_hf, "msa_func", recording):
        assert logits(model, tokens(1, 64)).isfinite().all()
    assert calls == [torch.float8_e4m3fn] * model.config.num_hidden_layers
    model.save_pretrained(tmp_path)
    assert msa_hf.load_msa_model(tmp_path).config.flash_msa_msa == model.config.flash_msa_msa


def test_deterministic_reaches_msa_func():
    """model(..., deterministic=False) reaches every layer's msa_func (True when absent, as
    transformers' FlashAttention integration reads it); a non-bool is refused."""
    model = converted()
    calls = []

    def recording(*tensors, **options):
        calls.append(options["deterministic"])
        return msa_func(*tensors, **options)

    layers = model.config.num_hidden_layers
    with mock.patch.object(msa_hf, "msa_func", recording):
        logits(model, tokens(1, 64))
        assert calls == [True] * layers
        logits(model, tokens(1, 64), deterministic=False)
        assert calls[layers:] == [False] * layers
    with pytest.raises(TypeError, match="deterministic must be a bool, got int"):
        logits(model, tokens(1, 64), deterministic=0)


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"num_proxy_heads": 3}, ValueError, r"must divide the 4 query heads.*\[2, 4\]"),
        ({"num_proxy_heads": 1}, ValueError, "multiple of its 2 key-value heads"),
        ({"proxy_head_dim": 15}, ValueError, "even"),
        ({"top_k": 0}, ValueError, "top_k must be a positive int"),
        ({"q_block": 64, "kv_block": 32}, ValueError, r"q_block \(64\) must be <= kv_block"),
        ({"q_block": 4}, ValueError, "q_block 4 with H_q / H_p = 2 query heads"),
        ({"kv_block": 48}, ValueError, "kv_block"),
        ({"score_dtype": torch.float16}, ValueError, "score_dtype must be None"),
    ],
)
def test_bad_settings_are_refused(options, error, match):
    model = tiny_model()
    with pytest.raises(error, match=match):
        msa_hf.convert_to_msa(model, **{**MSA, **options})
    assert not hasattr(model.model.layers[0].self_attn, "proxy_proj")  # left as it was


def test_unsupported_models_are_refused():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        msa_hf.convert_to_msa(torch.nn.Linear(4, 4))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no attention layer"):
        msa_hf.convert_to_msa(gpt2)
    model = converted()
    with pytest.raises(ValueError, match="converted already"):
        msa_hf.convert_to_msa(model, **MSA)


def test_kl_loss_needs_a_forward():
    with pytest.raises(ValueError, match="no MSA layer"):
        msa_hf.collect_kl_loss(tiny_model())
    model = converted()
    with pytest.raises(ValueError, match=r"no MSA forward ran in layers \[0, 1\]"):
        msa_hf.collect_kl_loss(model)
    logits(model, tokens(1, 32))
    msa_hf.collect_kl_loss(model)
    with pytest.raises(ValueError, match="since the conversion or the last collect_kl_loss"):
        msa_hf.collect_kl_loss(model)
    logits(model, tokens(1, 32), "sdpa")  # dense SDPA: no KL loss, no hidden states kept
    assert model.model.layers[0].self_attn._msa_hidden_states is None
    with pytest.raises(ValueError, match="attn_implementation is 'sdpa'"):
        msa_hf.collect_kl_loss(model)


def test_warmup_flag_is_checked():
    with pytest.raises(ValueError, match="no MSA layer"):
        msa_hf.set_msa_warmup(tiny_model(), True)
    with pytest.raises(TypeError, match="warmup must be a bool"):
        msa_hf.set_msa_warmup(converted(), 1)


def test_unsupported_inputs_are_refused():
    model = converted()
    attention_mask = torch.ones(2, 32, dtype=torch.long)
    attention_mask[1, :5] = 0
    with pytest.raises(ValueError, match="padding tokens"):
        logits(model, tokens(2, 32), attention_mask=attention_mask)
    input_ids = tokens(1, 32)
    with pytest.raises(ValueError, match="explicit attention mask"):
        logits(model, input_ids, attention_mask=torch.ones(1, 1, 32, 32, dtype=torch.bool))
    cache = model(input_ids, use_cache=True).cache  # the prefill runs
    with pytest.raises(ValueError, match="KV cache"):
        model(input_ids[:, -1:], cache=cache, use_cache=True)
    dropout = converted(attention_dropout=0.1).train()
    with pytest.raises(ValueError, match="attention dropout 0.1"):
        logits(dropout, input_ids)
    with pytest.raises(ValueError, match="sliding window of 16 tokens over 32"):
        logits(converted("mistral", sliding_window=16), input_ids)


def test_inputs_of_the_wrong_type_are_refused():
    model = converted()
    input_ids = tokens(1, 64)
    with pytest.raises(TypeError, match="position_ids must be integers, got torch.float32"):
        model(input_ids, position_ids=torch.arange(64.0)[None], use_cache=False)
    with pytest.raises(TypeError, match="cu_seq_lens_q must be an int tensor"):
        model(input_ids, cu_seq_lens_q=[0, 32, 64], use_cache=False)


def test_settings_edited_after_the_conversion_are_checked():
    model = converted()
    input_ids = tokens(1, 64)
    settings = model.config.flash_msa_msa
    for changes, match in [
        (dict(score_dtype="float16"), "score_dtype must be None or one of"),
        (dict(num_proxy_heads=4), "proxy_proj was made for another count or size"),
        (dict(granularity=["token"]), r"granularity must be one of \('token', 'block'\)"),
    ]:
        model.config.flash_msa_msa = {**settings, **changes}
        with pytest.raises(ValueError, match=match):
            model(input_ids, use_cache=False)
    model.config.flash_msa_msa = {key: value for key, value in settings.items() if key != "top_k"}
    with pytest.raises(ValueError, match="must hold exactly"):
        model(input_ids, use_cache=False)


def test_load_msa_model_refuses_what_cannot_load(tmp_path):
    with pytest.raises(TypeError, match="model_class must be a transformers model class"):
        msa_hf.load_msa_model(tmp_path, model_class=int)
    with pytest.raises(TypeError, match="path must be a folder or a Hub id"):
        msa_hf.load_msa_model(None)
