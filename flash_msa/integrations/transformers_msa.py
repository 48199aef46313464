"""Hugging Face transformers: MiniMax Sparse Attention (msa_func) in a loaded model.

convert_to_msa(model) gives every attention layer of a model that dispatches through
transformers' AttentionInterface (Llama, Qwen2/3, Mistral, ...; separate q_proj, k_proj,
v_proj) a proxy projection and runs its attention on flash_msa.msa_func:

- `proxy_proj`, an nn.Linear (no bias) from the layer's input hidden states to
  num_proxy_heads proxy query heads and one proxy key head of proxy_head_dim each, in that
  order along the output features; PyTorch's default Linear initialisation, in the dtype and
  on the device of q_proj. Proxy head p selects the key blocks of the num_heads /
  num_proxy_heads query heads it serves, so num_proxy_heads must divide the query heads and
  be a multiple of the key-value heads.
- A forward pre-hook on each attention layer keeps its input hidden states, detached: the
  proxy learns from the KL loss alone (as MSAAttention's), and the KL loss sends no gradient
  into the model; selection is discrete, so the task loss sends none into the proxy.
- The proxy's rotary embeddings are flash_msa.rotary's (rotate-half) at the model's
  position_ids, with the base of the model config's rope theta (10000 when it has none),
  recorded at conversion; a rope scaling of the model's own rotary (llama3, yarn, ...) is
  not applied to the proxy, which learns its own scores.
- The registered attention function ("msa") calls msa_func, causal, with the model's
  scaling, and stores the layer's KL loss on the layer. collect_kl_loss(model) returns the
  mean over layers of the losses of the last forward (the mean, so that a KL coefficient
  does not depend on depth) and clears them.
- set_msa_warmup(model, True) attends densely (every causal block) while the proxy trains
  on the full causal context, as the MSA paper does before sparse training; False (the
  state after conversion) attends over the selected blocks.

The settings (top_k, num_proxy_heads, proxy_head_dim, q_block, kv_block, granularity,
score_dtype (None or "float8_e4m3fn"), rope_base and the warm-up flag) live in the model
config's `flash_msa_msa` entry and the proxy weights in the state dict, so save_pretrained
writes both; load_msa_model(path) builds the model with its proxy projections before
from_pretrained fills them in, and the loaded model computes the same logits. A plain
from_pretrained drops the proxy weights.

Packed documents (position_ids that restart, or DataCollatorWithFlattening's cu_seq_lens_q)
become msa_func's cu_seqlens; the blocks of a row start at its first token and run across
its document boundaries, so a row computes the same alone or in a batch. Padding
masks, explicit masks, KV caches (generation), attention dropout, a sliding window shorter
than the sequence and the options transformers.py refuses raise ValueError naming the fix;
to generate, switch the model to model.set_attn_implementation("sdpa") (the proxies then
sit unused).

This module imports transformers only inside its functions.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

from flash_msa.integrations.transformers import (
    _check_options,
    _documents,
    _packed_cu_seqlens,
    _register,
    deterministic_of,
    window_of,
)
from flash_msa.modules import _check_positive_ints
from flash_msa.msa import msa_func
from flash_msa.msa.fp8 import FP8, check_score_dtype
from flash_msa.msa.interface import (
    check_granularity,
    check_msa_blocks,
    default_q_block,
    msa_func_of_rows,
)
from flash_msa.rotary import apply_rotary, rotary_tables

# The attn_implementation of a converted model (no "flash": see transformers.ATTENTION_NAME).
ATTENTION_NAME = "msa"
# The model config's attribute with the MSA settings.
CONFIG_KEY = "flash_msa_msa"
SETTINGS = (
    "top_k",
    "num_proxy_heads",
    "proxy_head_dim",
    "q_block",
    "kv_block",
    "granularity",
    "score_dtype",
    "rope_base",
    "warmup",
)
DEFAULT_ROPE_BASE = 10000.0
# score_dtype as the config stores it (JSON holds no dtype) -> the dtype
SCORE_DTYPES = {None: None, "float8_e4m3fn": FP8}
# What each converted attention layer carries between its pre-hook, its attention and
# collect_kl_loss (plain attributes: never saved).
_HIDDEN_STATES = "_msa_hidden_states"
_KL_LOSS = "_msa_kl_loss"
# from_pretrained options that say where the checkpoint is, which its config shares.
_HUB_OPTIONS = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "proxies",
    "revision",
    "subfolder",
    "token",
    "trust_remote_code",
)


def _rope_base(config) -> float:
    """The rope theta of a transformers config (rope_parameters in 5.x, rope_theta before)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    base = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    return DEFAULT_ROPE_BASE if base is None else float(base)


def _score_dtype_name(score_dtype) -> str | None:
    """score_dtype (checked) as the config stores it."""
    check_score_dtype(score_dtype, torch.device("cpu"))
    return {dtype: name for name, dtype in SCORE_DTYPES.items()}[score_dtype]


def _settings(config) -> dict:
    settings = getattr(config, CONFIG_KEY, None)
    if not isinstance(settings, dict):
        raise ValueError(
            f"the model config has no MSA settings (config.{CONFIG_KEY} is {settings!r}): "
            "convert the model with convert_to_msa(model), or load a converted checkpoint "
            "with load_msa_model(path)"
        )
    return settings


def _check_settings(settings: dict) -> None:
    if sorted(settings) != sorted(SETTINGS):
        raise ValueError(
            f"config.{CONFIG_KEY} must hold exactly {list(SETTINGS)}, got {sorted(settings)}"
        )
    _check_positive_ints(
        top_k=settings["top_k"],
        num_proxy_heads=settings["num_proxy_heads"],
        proxy_head_dim=settings["proxy_head_dim"],
    )
    if settings["proxy_head_dim"] % 2:
        raise ValueError(
            f"proxy_head_dim {settings['proxy_head_dim']} must be even: rotary embeddings "
            "rotate pairs"
        )
    check_granularity(settings["granularity"])  # first: it sets q_block's default
    check_msa_blocks(settings["q_block"], settings["kv_block"], settings["granularity"])
    if not isinstance(settings["score_dtype"], (str, type(None))) or (
        settings["score_dtype"] not in SCORE_DTYPES
    ):
        raise ValueError(
            f"score_dtype must be None or one of {list(SCORE_DTYPES)[1:]}, got "
            f"{settings['score_dtype']!r}"
        )
    check_score_dtype(SCORE_DTYPES[settings["score_dtype"]], torch.device("cpu"))
    rope_base = settings["rope_base"]
    if type(rope_base) not in (int, float) or not 1 < rope_base < float("inf"):
        raise ValueError(f"rope_base must be a finite number > 1, got {rope_base!r}")
    if not isinstance(settings["warmup"], bool):
        raise TypeError(f"warmup must be a bool, got {settings['warmup']!r}")


def _attention_layers(model) -> list[nn.Module]:
    """The attention layers of a transformers model whose q, k, v projections are apart."""
    projections = ("q_proj", "k_proj", "v_proj")
    layers = [
        module for module in model.modules()
        if all(isinstance(getattr(module, name, None), nn.Linear) for name in projections)
    ]  # fmt: skip
    if not layers or not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"{type(model).__name__} has no attention layer that dispatches through "
            "transformers' AttentionInterface with separate q_proj, k_proj and v_proj "
            f"(found {len(layers)}); convert a model of that kind (Llama, Qwen2, Mistral, ...)"
        )
    return layers


def _check_layer(model, layer: nn.Module, settings: dict) -> None:
    num_proxy_heads = settings["num_proxy_heads"]
    name = f"{type(layer).__name__} (layer_idx {getattr(layer, 'layer_idx', None)})"
    if hasattr(layer, "proxy_proj"):
        raise ValueError(f"{name} already has a proxy_proj: the model is converted already")
    if getattr(layer, "config", None) is not model.config:
        raise ValueError(
            f"{name} reads another config than the model's (a composite model); convert its "
            "language model alone, e.g. convert_to_msa(model.language_model)"
        )
    if not getattr(layer, "is_causal", True):
        raise ValueError(f"{name} is bidirectional (is_causal=False), but MSA is causal")
    head_dim = getattr(layer, "head_dim", None)
    if not isinstance(head_dim, int) or layer.q_proj.out_features % head_dim:
        raise ValueError(f"{name} has head_dim {head_dim!r}, which does not split q_proj")
    heads_q = layer.q_proj.out_features // head_dim
    heads_kv = layer.k_proj.out_features // head_dim
    if heads_q % num_proxy_heads or num_proxy_heads % heads_kv:
        choices = [p for p in range(1, heads_q + 1) if heads_q % p == 0 and p % heads_kv == 0]
        raise ValueError(
            f"num_proxy_heads {num_proxy_heads} must divide the {heads_q} query heads of {name} "
            f"and be a multiple of its {heads_kv} key-value heads (each proxy head selects for "
            f"query heads that share one kv head); choose one of {choices}"
        )
    check_msa_blocks(settings["q_block"], settings["kv_block"], settings["granularity"],
                     heads_q // num_proxy_heads)  # fmt: skip


def _keep_hidden_states(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: the layer's input, detached, for its proxy projection."""
    if module.config._attn_implementation == ATTENTION_NAME:
        hidden_states = args[0] if args else kwargs.get("hidden_states")
        setattr(module, _HIDDEN_STATES, None if hidden_states is None else hidden_states.detach())


def _attach(model, settings: dict) -> None:
    """Check everything first, then add proxy_proj and the pre-hook to every attention layer
    and record the settings in the config: a refused model is left as it was."""
    _check_settings(settings)
    layers = _attention_layers(model)
    for layer in layers:
        _check_layer(model, layer, settings)
    proxy_features = (settings["num_proxy_heads"] + 1) * settings["proxy_head_dim"]
    for layer in layers:
        weight = layer.q_proj.weight
        layer.proxy_proj = nn.Linear(
            weight.shape[1], proxy_features, bias=False, device=weight.device, dtype=weight.dtype
        )
        setattr(layer, _HIDDEN_STATES, None)
        setattr(layer, _KL_LOSS, None)
        layer.register_forward_pre_hook(_keep_hidden_states, with_kwargs=True)
    setattr(model.config, CONFIG_KEY, dict(settings))


def convert_to_msa(
    model,
    *,
    top_k: int = 16,
    num_proxy_heads: int = 4,
    proxy_head_dim: int = 128,
    q_block: int | None = None,
    kv_block: int = 128,
    granularity: str = "token",
    score_dtype: torch.dtype | None = None,
):
    """Give every attention layer of a loaded transformers model a proxy projection and run
    its attention on msa_func (in place; the module docstring has the details).

    Train with loss = task_loss + coefficient * collect_kl_loss(model) after each forward;
    set_msa_warmup(model, True) first for the dense warm-up. The model's
    attn_implementation becomes "msa"; set_attn_implementation("sdpa") switches back (for
    generation), and set_attn_implementation("msa") forth.

    Args:
        model: a transformers PreTrainedModel (Llama, Qwen2, Mistral, ...) whose attention
            layers have q_proj, k_proj and v_proj and call transformers' AttentionInterface.
        top_k: key blocks per (token, proxy head), its own block included.
        num_proxy_heads: proxy query heads per layer; it must divide the query heads and be
            a multiple of the key-value heads. One proxy key head serves them all.
        proxy_head_dim: the proxy heads' dim (even: rotary embeddings rotate pairs).
        q_block, kv_block: msa_func's block sizes, q_block <= kv_block (None: msa_func's
            default for the granularity and the model's query heads per proxy head).
        granularity: msa_func's: "token" (each token's own blocks, MiniMax's) or "block"
            (one choice per query block, cheaper).
        score_dtype: msa_func's: None, or torch.float8_e4m3fn for FP8 selection scores.

    Returns:
        The model, converted.

    Examples:
        >>> from flash_msa.integrations.transformers_msa import collect_kl_loss, convert_to_msa
        >>> model = convert_to_msa(AutoModelForCausalLM.from_pretrained(path), top_k=16)
        >>> loss = model(input_ids, labels=input_ids, use_cache=False).loss
        >>> (loss + 0.1 * collect_kl_loss(model)).backward()
        >>> model.save_pretrained(out_dir)  # load_msa_model(out_dir) loads it back
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"model must be a transformers PreTrainedModel, got {type(model).__name__}; for a "
            "model of your own use flash_msa.MSAAttention"
        )
    converted = any(hasattr(module, _KL_LOSS) for module in model.modules())
    if getattr(model.config, CONFIG_KEY, None) is not None and not converted:
        raise ValueError(
            f"the model's config holds MSA settings (config.{CONFIG_KEY}) but its layers have "
            "no proxy projections: a converted checkpoint loaded by a plain from_pretrained, "
            "which drops the trained proxies; load it with load_msa_model(path)"
        )
    heads_q = getattr(model.config, "num_attention_heads", None)
    heads_per_proxy = (  # None where the layers' checks will name what is wrong
        heads_q // num_proxy_heads
        if all(type(n) is int and n > 0 for n in (heads_q, num_proxy_heads))
        and heads_q % num_proxy_heads == 0 else None
    )  # fmt: skip
    settings = dict(
        top_k=top_k, num_proxy_heads=num_proxy_heads, proxy_head_dim=proxy_head_dim,
        q_block=default_q_block(q_block, granularity, heads_per_proxy), kv_block=kv_block,
        granularity=granularity, score_dtype=_score_dtype_name(score_dtype),
        rope_base=_rope_base(model.config), warmup=False,
    )  # fmt: skip
    _attach(model, settings)
    model.set_attn_implementation(_register(ATTENTION_NAME, attention_forward))
    return model


def _converted_layers(model) -> list[nn.Module]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    layers = [module for module in model.modules() if hasattr(module, _KL_LOSS)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no MSA layer: convert it with convert_to_msa(model) "
            "or load a converted checkpoint with load_msa_model(path)"
        )
    return layers


def collect_kl_loss(model) -> torch.Tensor:
    """The MSA KL loss of the model's last forward: the mean over its layers of each layer's
    msa_func kl_loss. The layers' losses are cleared, so call it once per forward, before
    the backward (under activation checkpointing the backward's recomputation stores them
    again, so a second call then returns those instead of raising).

    Args:
        model: a model converted by convert_to_msa or loaded by load_msa_model.

    Returns:
        An fp32 scalar, differentiable in the proxy projections only.

    Examples:
        >>> loss = model(input_ids, labels=input_ids, use_cache=False).loss
        >>> (loss + 0.1 * collect_kl_loss(model)).backward()
    """
    layers = _converted_layers(model)
    losses = [getattr(layer, _KL_LOSS) for layer in layers]
    missing = [
        getattr(layer, "layer_idx", index)
        for index, (layer, loss) in enumerate(zip(layers, losses, strict=True))
        if loss is None
    ]
    if missing:
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
        raise ValueError(
            f"no MSA forward ran in layers {missing} since the conversion or the last "
            f"collect_kl_loss (the model's attn_implementation is {implementation!r}); run a "
            f"forward with attn_implementation {ATTENTION_NAME!r} first"
        )
    for layer in layers:
        setattr(layer, _KL_LOSS, None)
    return torch.stack([loss.to(losses[0].device) for loss in losses]).mean()


def set_msa_warmup(model, warmup: bool) -> None:
    """Switch the dense warm-up of a converted model: True attends over every causal block
    while the proxy trains on the full causal context; False attends over the blocks the
    proxy selects. The flag is part of config.flash_msa_msa, so it is saved with the model.

    Args:
        model: a model converted by convert_to_msa or loaded by load_msa_model.
        warmup: the new state.

    Examples:
        >>> set_msa_warmup(model, True)  # the first steps: proxy trained on full attention
        >>> set_msa_warmup(model, False)  # then sparse training
    """
    _converted_layers(model)
    if not isinstance(warmup, bool):
        raise TypeError(f"warmup must be a bool, got {warmup!r}")
    setattr(model.config, CONFIG_KEY, {**_settings(model.config), "warmup": warmup})


@functools.cache
def _msa_class(model_class: type) -> type:
    """model_class whose instances get their proxy projections at construction, from the
    config's settings, so that from_pretrained fills them in from the checkpoint."""

    def __init__(self, config, *args, **kwargs):
        model_class.__init__(self, config, *args, **kwargs)
        _attach(self, _settings(config))

    # The same name: save_pretrained records it as the config's architecture.
    namespace = {
        "__init__": __init__,
        "__module__": model_class.__module__,
        "__qualname__": model_class.__qualname__,
        "__doc__": model_class.__doc__,
    }
    return type(model_class.__name__, (model_class,), namespace)


def load_msa_model(path, model_class=None, **kwargs):
    """Load a model that convert_to_msa converted and save_pretrained saved: its settings,
    its proxy projections and its warm-up state.

    Args:
        path: a directory (or Hub id) written by save_pretrained.
        model_class: a transformers model class or Auto class (AutoModelForCausalLM when
            None) whose from_pretrained loads the checkpoint.
        kwargs: from_pretrained options (dtype, device_map, revision, config, ...);
            attn_implementation defaults to "msa".

    Returns:
        The model, as convert_to_msa left it, with the saved weights.

    Examples:
        >>> model.save_pretrained(out_dir)  # a model converted by convert_to_msa
        >>> model = load_msa_model(out_dir, dtype=torch.bfloat16)
    """
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    model_class = AutoModelForCausalLM if model_class is None else model_class
    if not isinstance(model_class, type) or not hasattr(model_class, "from_pretrained"):
        raise TypeError(
            f"model_class must be a transformers model class or Auto class (with "
            f"from_pretrained), got {model_class!r}"
        )
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a folder or a Hub id (a str), got {path!r}")
    config = kwargs.pop("config", None)
    if config is None:
        hub_options = {name: kwargs[name] for name in _HUB_OPTIONS if name in kwargs}
        config = AutoConfig.from_pretrained(path, **hub_options)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"config must be a transformers PretrainedConfig, got {config!r}")
    _check_settings(_settings(config))
    if getattr(model_class, "_model_mapping", None) is not None:  # an Auto class
        from transformers.models.auto.auto_factory import _get_model_class

        model_class = _get_model_class(config, model_class._model_mapping)
    expected = getattr(model_class, "config_class", None)
    if expected is not None and not isinstance(config, expected):
        raise ValueError(
            f"the checkpoint's config is a {type(config).__name__}, but {model_class.__name__} "
            f"takes a {expected.__name__}: pass the model class of the checkpoint's "
            "architecture, or leave model_class out (AutoModelForCausalLM)"
        )
    kwargs.setdefault("attn_implementation", _register(ATTENTION_NAME, attention_forward))
    return _msa_class(model_class).from_pretrained(path, config=config, **kwargs)


def _hidden_states_of(module: nn.Module, batch: int, seq_len: int) -> torch.Tensor:
    """The input the pre-hook kept for this call, taken off the layer."""
    hidden_states = getattr(module, _HIDDEN_STATES, None)
    if hidden_states is None or not hasattr(module, "proxy_proj"):
        raise ValueError(
            f"{type(module).__name__} runs MSA attention without a proxy projection and its "
            "input: convert the model with convert_to_msa(model), or load a converted "
            "checkpoint with load_msa_model(path)"
        )
    setattr(module, _HIDDEN_STATES, None)
    if hidden_states.dim() != 3 or hidden_states.shape[:2] != (batch, seq_len):
        raise ValueError(
            f"{type(module).__name__} got hidden states {list(hidden_states.shape)} for "
            f"queries of {batch} rows of {seq_len} tokens; MSA runs self-attention on the "
            "layer's input [B, S, hidden]"
        )
    return hidden_states


def _proxy_heads(module, hidden_states, position_ids, settings) -> tuple:
    """q_proxy [B, S, H_p, D_p] and k_proxy [B, S, 1, D_p], rotated at position_ids."""
    batch, seq_len, _ = hidden_states.shape
    heads, dim = settings["num_proxy_heads"] + 1, settings["proxy_head_dim"]
    projected = module.proxy_proj(hidden_states).view(batch, seq_len, heads, dim)
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=hidden_states.device)
    if position_ids.is_floating_point() or position_ids.is_complex():
        raise TypeError(f"position_ids must be integers, got {position_ids.dtype}; use .long()")
    positions = position_ids.expand(batch, seq_len).reshape(-1)
    first, last = (int(value) for value in torch.aminmax(positions))
    if first < 0:
        raise ValueError(f"position_ids must be >= 0, got {first}")
    cos, sin = rotary_tables(last + 1, dim, base=settings["rope_base"], device=positions.device)
    # Rows one after another: one [1, B * S] sequence with the tables at its positions.
    rotated = apply_rotary(
        projected.view(1, batch * seq_len, heads, dim), cos[positions], sin[positions]
    ).view(batch, seq_len, heads, dim)
    return rotated.split([heads - 1, 1], dim=2)


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function of converted models: transformers calls it in every layer.

    Args:
        module: the attention layer, with proxy_proj and the hidden states its pre-hook kept.
        query: [B, H_q, S, D]; key, value: [B, H_kv, S, D].
        attention_mask: the DocumentMask of transformers.document_mask, or None.
        dropout: must be 0 (msa_func applies no dropout).
        scaling: the softmax scale (1 / sqrt(D) when None).
        sliding_window: None, or at least the sequence length (then it masks nothing).
        is_causal: must be True or None (then module.is_causal).
        kwargs: position_ids (the proxy's rotary positions, and packed documents where they
            restart), cu_seq_lens_q / cu_seq_lens_k / max_length_q, deterministic (msa_func's:
            model(..., deterministic=False) for a faster backward, its sums in a varying order).

    Returns:
        (out [B, S, H_q, D], None); the layer's kl_loss is kept for collect_kl_loss.
    """
    _check_options(module, query, key, value, is_causal, sliding_window, kwargs)
    sliding_window = window_of(attention_mask, sliding_window)
    batch, _, seq_len, _ = query.shape
    if dropout:
        raise ValueError(
            f"the model asks attention dropout {dropout}, which msa_func does not apply; set "
            "config.attention_dropout = 0.0"
        )
    if sliding_window is not None and sliding_window < seq_len:
        raise ValueError(
            f"the model asks a sliding window of {sliding_window} tokens over {seq_len}, which "
            "msa_func does not apply; run sequences of at most that length, or drop the "
            "window (config.sliding_window=None / use_sliding_window=False)"
        )
    hidden_states = _hidden_states_of(module, batch, seq_len)
    settings = _settings(module.config)
    _check_settings(settings)  # the config may have been edited since the conversion
    width = (settings["num_proxy_heads"] + 1) * settings["proxy_head_dim"]
    if module.proxy_proj.out_features != width:
        raise ValueError(
            f"config.{CONFIG_KEY} asks {settings['num_proxy_heads']} proxy heads of "
            f"{settings['proxy_head_dim']}, but the layer's proxy_proj was made for another "
            f"count or size ({module.proxy_proj.out_features} outputs): convert the model "
            "again rather than editing these settings"
        )
    document_ids = _documents(attention_mask, kwargs, batch, seq_len)
    packed = _packed_cu_seqlens(kwargs, batch, seq_len, document_ids)
    q_proxy, k_proxy = _proxy_heads(module, hidden_states, kwargs.get("position_ids"), settings)
    tensors = (q_proxy, k_proxy, *(tensor.transpose(1, 2) for tensor in (query, key, value)))
    options = dict(
        top_k=settings["top_k"], q_block=settings["q_block"], kv_block=settings["kv_block"],
        softmax_scale=scaling, warmup=settings["warmup"], granularity=settings["granularity"],
        score_dtype=SCORE_DTYPES[settings["score_dtype"]], deterministic=deterministic_of(kwargs),
    )  # fmt: skip
    if packed is not None:  # one row (checked), its documents as cu_seqlens name them
        out, kl_loss = msa_func(*(t[0] for t in tensors), cu_seqlens=packed[0], **options)
        out = out[None]
    elif document_ids is None:
        out, kl_loss = msa_func(*tensors, **options)
    else:
        out, kl_loss = msa_func_of_rows(*tensors, document_ids=document_ids, **options)
    setattr(module, _KL_LOSS, kl_loss)
    return out, None
