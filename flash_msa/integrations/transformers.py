"""Hugging Face transformers: block-sparse attention for any model that dispatches through
transformers' AttentionInterface (Llama, Qwen2/3, Mistral, ...).

register() adds an attention function and its mask function to transformers' registries;
a model then runs on block_sparse_attn_func once its attn_implementation names them. The
layout of each layer comes from the model config's `flash_msa` entry and is built once per
(pattern, sequence length, device).

A layer's attention is causal, never crosses a packed document, keeps the sliding window the
model asks for (i - j < sliding_window, passed to the layer or held in its mask), and covers
only the layout's active blocks (whole blocks: a query sees every earlier key of an active
block). Whatever else a model asks for (padding, explicit masks, bidirectional attention,
cached decoding, soft-capping, sinks) raises ValueError naming it and the fix.

Packed documents share the layout of their row: causal and sliding-window layouts attend
within each document as it would alone, while a pattern anchored at the row's start (the
global tokens of global_tokens, longformer, bigbird) serves the row's first document only.

This module imports transformers only inside register().
"""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass

import torch

from flash_msa import patterns
from flash_msa.layout import BlockLayout, check_seq_len, checked_device
from flash_msa.ops.interface import (
    block_sparse_attn_func,
    block_sparse_attn_varlen_func,
    check_bools,
)
from flash_msa.sequences import document_begins, document_first_tokens, document_ids_of_starts

# The name models pass as attn_implementation. transformers (5.x) takes every name holding
# "flash" for a FlashAttention kernel and tries to load it from the Hub, so it cannot hold it.
ATTENTION_NAME = "block_sparse"
# The model config's attribute with the pattern: a spec, or a list of specs, one per layer.
CONFIG_KEY = "flash_msa"
DEFAULT_SPEC = {"pattern": "causal"}
# Builder arguments the integration sets itself.
_RESERVED = ("seq_len", "device", "cu_seqlens")
# Attention options of transformers models that block-sparse attention cannot honour, with
# what to do instead.
_UNSUPPORTED_OPTIONS = {
    "softcap": "logit soft-capping",
    "s_aux": "learned attention sinks",
    "sinks": "learned attention sinks",
    "position_bias": "an additive position bias",
    "block_table": "a paged KV cache (continuous batching)",
}
_LAYOUT_CACHE_SIZE = 64


@dataclass(frozen=True)
class DocumentMask:
    """What the mask function hands each layer in place of a dense mask: the documents the
    model's mask keeps apart.

    document_ids: int32 [B, S], non-decreasing along S, or None for one document per row.
    window: the sliding window the mask holds (a query sees the keys i - window < j <= i of
        its document), or None. Some models (Qwen2-MoE, PhiMoE) keep their window in the
        mask alone and pass none to the attention call.
    """

    document_ids: torch.Tensor | None
    window: int | None = None


def register(name: str = ATTENTION_NAME) -> str:
    """Add block-sparse attention to transformers' AttentionInterface and its mask function
    to AttentionMaskInterface under `name`.

    A model whose attn_implementation is `name` then runs each attention layer on
    flash_msa.block_sparse_attn_func over the layout its config asks for:
    `config.flash_msa` is a spec, a list of specs indexed by layer_idx (one per layer), or
    absent (dense causal). A spec is a pattern name of flash_msa.patterns ("causal",
    "sliding_window", "longformer", "bigbird", "dilated", "global_tokens", "random_blocks")
    or a dict {"pattern": name, **keyword arguments of that builder} (seq_len and device are
    filled in; causal defaults to True). The mask function keeps causal masking, packed
    documents (position_ids that restart, as DataCollatorWithFlattening gives, or its
    cu_seq_lens_q / max_length_q kwargs) and the model's sliding window; a padding mask or
    any option the layout cannot honour raises ValueError naming the fix.

    Args:
        name: the attn_implementation to register. transformers 5.x treats a name holding
            "flash" as a FlashAttention kernel to load from the Hub, so such a name is
            refused.

    Returns:
        The registered name, to pass as attn_implementation.

    Examples:
        >>> from flash_msa.integrations import transformers as flash_msa_hf
        >>> name = flash_msa_hf.register()  # "block_sparse"
        >>> config = AutoConfig.from_pretrained(path)
        >>> config.flash_msa = {"pattern": "longformer", "window": 4096, "num_global": 128}
        >>> model = AutoModelForCausalLM.from_pretrained(path, config=config,
        ...                                              attn_implementation=name)
        >>> model.set_attn_implementation("sdpa")  # and back: set_attn_implementation(name)
    """
    return _register(name, attention_forward)


def _register(name: str, attention_function) -> str:
    """Add attention_function and document_mask to transformers' registries under `name`."""
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as error:
        raise ImportError(
            "flash_msa.integrations.transformers needs transformers: "
            "pip install 'flash-msa[transformers]'"
        ) from error
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    try:
        from transformers.utils.generic import is_flash_attention_requested
    except ImportError:  # releases without the check load no kernel by name
        is_flash_attention_requested = None
    if is_flash_attention_requested is not None and is_flash_attention_requested(
        requested_attention_implementation=name
    ):
        raise ValueError(
            f"name {name!r} reads as a FlashAttention kernel to transformers, which would try "
            f"to load it from the Hub; register under a name without 'flash' (the default "
            f"{ATTENTION_NAME!r})"
        )
    taken = AttentionInterface._global_mapping.get(name)
    if name == "eager" or "|" in name or taken not in (None, attention_function):
        raise ValueError(
            f"name {name!r} is taken (transformers' own attention or another integration's): "
            f"registering over it would change every model that asks for it; pick a new name "
            f"(the default {ATTENTION_NAME!r})"
        )
    AttentionInterface.register(name, attention_function)
    AttentionMaskInterface.register(name, document_mask)
    return name


def _spec_of(config, layer_idx) -> dict:
    """The spec of one layer from config.flash_msa, as a dict with a "pattern" key."""
    spec = getattr(config, CONFIG_KEY, None) if config is not None else None
    if isinstance(spec, (list, tuple)):
        layers = getattr(config, "num_hidden_layers", None)
        if layers is not None and len(spec) != layers:
            raise ValueError(
                f"config.{CONFIG_KEY} lists {len(spec)} layer specs but the model has "
                f"num_hidden_layers={layers}; give one spec per layer, or one spec for all"
            )
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(spec):
            raise ValueError(
                f"config.{CONFIG_KEY} is a list of per-layer specs, but the attention layer has "
                f"layer_idx={layer_idx!r}; give one spec for all layers instead"
            )
        spec = spec[layer_idx]
    if spec is None:
        return dict(DEFAULT_SPEC)
    if isinstance(spec, str):
        return {"pattern": spec}
    if not isinstance(spec, dict):
        raise ValueError(
            f"config.{CONFIG_KEY} must be a pattern name, a dict {{'pattern': name, ...}} or a "
            f"list of those (one per layer), got {type(spec).__name__}"
        )
    return {"pattern": DEFAULT_SPEC["pattern"], **spec}


def _spec_key(spec: dict) -> str:
    try:
        return json.dumps(spec, sort_keys=True)
    except TypeError as error:
        raise ValueError(
            f"config.{CONFIG_KEY} must hold JSON values (it is saved with the config), got {spec!r}"
        ) from error


def _builders() -> dict:
    """Pattern builders called as builder(seq_len, ...), by name."""
    found = {}
    for builder_name in patterns.__all__:
        builder = getattr(patterns, builder_name)
        parameters = list(inspect.signature(builder).parameters)
        if parameters[:1] == ["seq_len"]:
            found[builder_name] = builder
    return found


@functools.lru_cache(maxsize=_LAYOUT_CACHE_SIZE)
def _builder_call(spec_key: str):
    """(builder, keyword arguments) of a spec, checked against the builder's signature."""
    spec = json.loads(spec_key)
    name = spec.pop("pattern")
    builders = _builders()
    if not isinstance(name, str) or name not in builders:
        raise ValueError(
            f"config.{CONFIG_KEY} pattern {name!r} is not a layout builder; choose one of "
            f"{sorted(builders)}"
        )
    builder = builders[name]
    parameters = inspect.signature(builder).parameters
    accepted = [p for p in parameters if p not in _RESERVED]
    for argument in spec:
        if argument in _RESERVED:
            raise ValueError(
                f"config.{CONFIG_KEY} sets {argument!r}, which the model fills in; drop it"
            )
        if argument not in parameters:
            raise ValueError(
                f"config.{CONFIG_KEY} pattern {name!r} takes no argument {argument!r}; it "
                f"takes {accepted} (a window with global tokens is 'longformer')"
            )
    missing = [
        p for p, parameter in parameters.items()
        if parameter.default is inspect.Parameter.empty and p not in _RESERVED and p not in spec
    ]  # fmt: skip
    if missing:
        raise ValueError(f"config.{CONFIG_KEY} pattern {name!r} needs {missing}")
    if "causal" in parameters:
        if spec.get("causal", True) is not True:
            raise ValueError(
                f"config.{CONFIG_KEY} pattern {name!r} sets causal={spec['causal']!r}, but "
                "the model's attention is causal; drop it"
            )
        spec["causal"] = True  # no blocks above the diagonal, which causal masking empties
    return builder, spec


@functools.lru_cache(maxsize=_LAYOUT_CACHE_SIZE)
def _layout(spec_key: str, seq_len: int, device: torch.device) -> BlockLayout:
    builder, arguments = _builder_call(spec_key)
    return builder(seq_len, device=device, **arguments)


def layout_for(config, layer_idx: int | None, seq_len: int, device=None) -> BlockLayout:
    """The layout a layer of a model with this config attends over (built once per
    pattern, sequence length and device, then cached).

    Args:
        config: a transformers config; its `flash_msa` attribute holds the spec.
        layer_idx: the layer (used when the spec is a per-layer list).
        seq_len: tokens of the sequence (packed documents together).
        device: where the layout lives (the CPU when None).

    Returns:
        A BlockLayout over seq_len tokens.
    """
    device = torch.device("cpu") if device is None else checked_device(device)
    check_seq_len("seq_len", seq_len)
    return _layout(_spec_key(_spec_of(config, layer_idx)), seq_len, device)


@functools.lru_cache(maxsize=_LAYOUT_CACHE_SIZE)
def _covers_window(spec_key: str, seq_len: int, device: torch.device, window: int) -> bool:
    """Whether the layout holds every block the window i - window < j <= i reaches."""
    layout = _layout(spec_key, seq_len, device)
    needed = patterns.sliding_window(
        seq_len, window - 1, q_block=layout.q_block, kv_block=layout.kv_block, device=device
    )
    return (layout | needed).nnz == layout.nnz


def deterministic_of(kwargs: dict) -> bool:
    """The `deterministic` a model's forward passes down to its attention layers (as
    transformers' FlashAttention integration reads it), True when absent or None: a bitwise
    reproducible backward; False lets the backward add in a varying order where that is
    faster."""
    deterministic = kwargs.get("deterministic")
    deterministic = True if deterministic is None else deterministic
    check_bools(deterministic=deterministic)
    return deterministic


def _check_options(module, query, key, value, is_causal, sliding_window, kwargs) -> None:
    for option, meaning in _UNSUPPORTED_OPTIONS.items():
        if kwargs.get(option) is not None:
            raise ValueError(
                f"the model passes {option} ({meaning}), which block-sparse attention does not "
                "apply; run this model with attn_implementation='sdpa' or 'eager'"
            )
    if kwargs.get("output_attentions"):
        raise ValueError(
            "output_attentions=True: block-sparse attention never forms the attention weights; "
            "use attn_implementation='eager' to inspect them"
        )
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        raise ValueError(
            f"{type(module).__name__} is bidirectional (is_causal=False), but the layouts are "
            "causal; run it with attn_implementation='sdpa'"
        )
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"the queries have {query.shape[2]} tokens but the keys {key.shape[2]}: a KV cache "
            "holds earlier tokens (generation), which block-sparse attention does not take; "
            "train or score whole sequences with use_cache=False, and generate with "
            "model.set_attn_implementation('sdpa')"
        )
    if not query.shape[-1] == key.shape[-1] == value.shape[-1]:
        raise ValueError(
            f"queries, keys and values must share one head dim, got {query.shape[-1]}, "
            f"{key.shape[-1]}, {value.shape[-1]}; run this model with attn_implementation='sdpa'"
        )
    if sliding_window is not None and (
        not isinstance(sliding_window, int) or isinstance(sliding_window, bool)
        or sliding_window < 1
    ):  # fmt: skip
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")


def _documents_of_positions(position_ids, batch: int, seq_len: int):
    """int32 [B, S] documents where position_ids restart (a step other than +1), or None."""
    if position_ids is None or seq_len < 2:
        return None
    position_ids = position_ids.expand(batch, seq_len)
    starts = torch.diff(position_ids, dim=-1) != 1
    if not bool(starts.any()):
        return None
    return document_ids_of_starts(starts)


def _packed_cu_seqlens(kwargs, batch: int, seq_len: int, document_ids):
    """(cu_seqlens int32, max_seqlen) from cu_seq_lens_q / max_length_q, or None."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        return None
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        value = kwargs.get(name)
        if value is not None and not (
            isinstance(value, torch.Tensor) and not value.is_floating_point()
            and not value.is_complex() and value.dtype != torch.bool
        ):  # fmt: skip
            kind = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise TypeError(
                f"{name} must be an int tensor (as DataCollatorWithFlattening makes it), got "
                f"{kind}; pass torch.tensor(...) of ints"
            )
    other = kwargs.get("cu_seq_lens_k")
    if other is not None and not torch.equal(other.to(cu_seqlens.device), cu_seqlens):
        raise ValueError(
            "cu_seq_lens_k differs from cu_seq_lens_q: block-sparse attention runs "
            "self-attention over the same packed documents"
        )
    if batch != 1:
        raise ValueError(
            f"cu_seq_lens_q describes documents flattened into one row, but the batch has "
            f"{batch} rows; pack them into batch 1 (DataCollatorWithFlattening)"
        )
    cu_seqlens = cu_seqlens.to(torch.int32)
    max_seqlen = kwargs.get("max_length_q")
    if max_seqlen is None and cu_seqlens.numel() > 1:
        max_seqlen = cu_seqlens.diff().max()
    max_seqlen = int(max_seqlen) if max_seqlen is not None else 0
    if document_ids is not None and cu_seqlens.numel() > 1 and int(cu_seqlens[-1]) == seq_len:
        boundaries = torch.zeros(seq_len, dtype=torch.bool, device=cu_seqlens.device)
        boundaries[cu_seqlens[:-1][cu_seqlens[:-1] < seq_len].long()] = True
        if not torch.equal(boundaries, document_begins(document_ids[0]).to(boundaries.device)):
            raise ValueError(
                "cu_seq_lens_q and the position_ids disagree on where the packed documents "
                "start; pass both from one collator (DataCollatorWithFlattening)"
            )
    return cu_seqlens, max_seqlen


def window_of(attention_mask, sliding_window: int | None) -> int | None:
    """The sliding window a layer applies: the one the model passes the attention call, else
    the one its mask holds; ValueError when the two differ."""
    mask_window = attention_mask.window if isinstance(attention_mask, DocumentMask) else None
    if sliding_window is None:
        return mask_window
    if mask_window is not None and mask_window != sliding_window:
        raise ValueError(
            f"the model passes a sliding window of {sliding_window} tokens but its mask holds "
            f"one of {mask_window}; run it with attn_implementation='sdpa'"
        )
    return sliding_window


def _documents(attention_mask, kwargs, batch: int, seq_len: int):
    """int32 [B, S] documents from the DocumentMask, else from position_ids that restart
    (transformers leaves packed documents out of the mask when use_cache is on); None for one
    document per row. An explicit mask raises ValueError."""
    if isinstance(attention_mask, DocumentMask) and attention_mask.document_ids is not None:
        return attention_mask.document_ids
    if attention_mask is None or isinstance(attention_mask, DocumentMask):
        return _documents_of_positions(kwargs.get("position_ids"), batch, seq_len)
    kind, shape = type(attention_mask).__name__, list(getattr(attention_mask, "shape", ()))
    raise ValueError(
        f"block-sparse attention got an explicit attention mask ({kind} of shape {shape}); "
        "it applies causal, document and window masks over the layout only: pack sequences "
        "(position_ids restarting at 0) instead of masking them, or run with "
        "attn_implementation='sdpa'"
    )


def attention_forward(
    module: torch.nn.Module,
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
    """The attention function register() adds: transformers calls it in every layer.

    Args:
        module: the attention layer (its config holds the pattern, layer_idx picks a
            per-layer spec).
        query: [B, H_q, S, D]; key, value: [B, H_kv, S, D] (GQA: H_q a multiple of H_kv).
        attention_mask: the DocumentMask of document_mask, or None (documents then come from
            position_ids or cu_seq_lens_q).
        dropout: probability of dropping an attention weight (the model passes its
            attention_dropout in training, 0 in eval).
        scaling: the softmax scale (1 / sqrt(D) when None).
        sliding_window: keys a query sees, itself included (i - j < sliding_window), or None.
        is_causal: must be True or None (then module.is_causal).
        kwargs: position_ids, cu_seq_lens_q / cu_seq_lens_k / max_length_q, deterministic
            (model(..., deterministic=False): a faster backward, its sums in a varying
            order); the options block-sparse attention cannot honour raise ValueError.

    Returns:
        (out [B, S, H_q, D], None): no attention weights are formed.
    """
    _check_options(module, query, key, value, is_causal, sliding_window, kwargs)
    sliding_window = window_of(attention_mask, sliding_window)
    batch, _, seq_len, _ = query.shape
    document_ids = _documents(attention_mask, kwargs, batch, seq_len)
    config = getattr(module, "config", None)
    spec_key = _spec_key(_spec_of(config, getattr(module, "layer_idx", None)))
    layout = _layout(spec_key, seq_len, query.device)
    window_size = (-1, -1)
    if sliding_window is not None:
        if not _covers_window(spec_key, seq_len, query.device, sliding_window):
            raise ValueError(
                f"the model asks a sliding window of {sliding_window} tokens, but the layout of "
                f"config.{CONFIG_KEY}={json.loads(spec_key)} lacks blocks inside it; use a "
                f"pattern that covers it (e.g. {{'pattern': 'sliding_window', 'window': "
                f"{sliding_window - 1}}} or wider), or drop the model's sliding window "
                "(config.sliding_window=None / use_sliding_window=False)"
            )
        window_size = (sliding_window - 1, 0)
    options = dict(
        causal=True, window_size=window_size, softmax_scale=scaling, dropout_p=float(dropout),
        deterministic=deterministic_of(kwargs),
    )  # fmt: skip
    q, k, v = (tensor.transpose(1, 2) for tensor in (query, key, value))  # [B, S, H, D]
    packed = _packed_cu_seqlens(kwargs, batch, seq_len, document_ids)
    if packed is not None:
        cu_seqlens, max_seqlen = packed
        out = block_sparse_attn_varlen_func(
            q[0], k[0], v[0], cu_seqlens, max_seqlen, layout, **options
        )[None]
    else:
        out = block_sparse_attn_func(q, k, v, layout, document_ids=document_ids, **options)
    return out, None


def document_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    device=None,
    **kwargs,
) -> DocumentMask:
    """The mask function register() adds: transformers calls it once per forward with the
    mask it wants, and every layer gets the result.

    It reads the documents off the mask (a token that does not see the one before it starts
    a document: packed sequences, chunked attention) and refuses what the layers cannot
    apply: padding, custom mask overlays, masks that are not causal, cached decoding.

    Args:
        batch_size, q_length, kv_length, q_offset, kv_offset: the sizes transformers computes.
        mask_function: transformers' mask_function(batch_idx, head_idx, q_idx, kv_idx) -> bool.
        attention_mask: the 2-D padding mask [B, kv_length] (True = token), or None.
        use_vmap: True when the model overlays a custom mask function.
        device: where the inputs live.

    Returns:
        A DocumentMask.
    """
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "attention_mask marks padding tokens, which block-sparse attention cannot skip: "
            "pack the sequences into one row without padding (DataCollatorWithFlattening, or "
            "position_ids restarting at 0) and pass no attention_mask, or run with "
            "attn_implementation='sdpa'"
        )
    if use_vmap:
        raise ValueError(
            "the model overlays a custom mask function (or_mask_function / and_mask_function), "
            "which block-sparse attention cannot apply; run it with attn_implementation='sdpa'"
        )
    no_cache = int(q_offset) == 0 and int(kv_offset) == 0
    if no_cache and attention_mask is not None and attention_mask.shape[-1] != q_length:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[-1]} tokens but the input holds "
            f"{q_length}: pass a mask of the input's length (or none)"
        )
    if not no_cache or kv_length != q_length:
        raise ValueError(
            f"the mask spans {kv_length} keys from {int(kv_offset)} for {q_length} queries from "
            f"{int(q_offset)}: a KV cache holds earlier tokens (generation), which block-sparse "
            "attention does not take; use use_cache=False for training and scoring, and "
            "model.set_attn_implementation('sdpa') to generate"
        )
    if mask_function is None or q_length < 2:
        return DocumentMask(None)
    device = torch.device("cpu") if device is None else torch.device(device)
    batch_idx = torch.arange(batch_size, device=device)[:, None]
    head_idx = torch.zeros((1, 1), dtype=torch.long, device=device)
    positions = torch.arange(q_length, device=device)[None, :]

    def keeps(q_idx, kv_idx):  # bool [B, n] of the pairs (q_idx, kv_idx)
        kept = torch.as_tensor(mask_function(batch_idx, head_idx, q_idx, kv_idx), device=device)
        return kept.expand(batch_size, q_idx.shape[-1])

    if not bool(keeps(positions, positions).all()):
        raise ValueError(
            "the model's mask hides some tokens from themselves, which block-sparse attention "
            "cannot apply; run it with attn_implementation='sdpa'"
        )
    if bool(keeps(positions[:, :-1], positions[:, 1:]).any()):
        raise ValueError(
            "the model's mask lets tokens see later ones (bidirectional or block-wise "
            "attention), but block-sparse attention here is causal; run it with "
            "attn_implementation='sdpa'"
        )
    starts = ~keeps(positions[:, 1:], positions[:, :-1])  # [B, S - 1]
    document_ids = document_ids_of_starts(starts) if bool(starts.any()) else None
    tokens = positions.expand(batch_size, q_length)  # [B, S]
    return DocumentMask(document_ids, _window_in_mask(keeps, tokens, document_ids))


def _window_in_mask(keeps, tokens: torch.Tensor, document_ids) -> int | None:
    """The sliding window a causal mask holds: W where query i sees the keys i - W < j <= i of
    its document, None where every query sees its whole document up to itself. A mask found
    to be neither (probed at each query's window edge and at keys of earlier documents)
    raises ValueError. tokens: the positions [B, S]."""
    first = torch.zeros_like(tokens)  # [B, S]: the first token of each query's document
    if document_ids is not None:
        first = document_first_tokens(document_ids)
    blind = ~keeps(tokens, first)  # queries that do not see their document's first key
    window = int((tokens - first)[blind].min()) if bool(blind.any()) else None
    lowest = first if window is None else torch.maximum(first, tokens - window + 1)
    hidden = [(first - 1, first > 0), (first - 2, first > 1), (torch.zeros_like(first), first > 0)]
    if window is not None:  # the key just past the window, where it lies in the document
        hidden.append((tokens - window, tokens - window >= first))
    seen_hidden = [keeps(tokens, key.clamp(min=0)) & applies for key, applies in hidden]
    if not bool(keeps(tokens, lowest).all()) or any(bool(seen.any()) for seen in seen_hidden):
        raise ValueError(
            "the model's mask is not causal attention within documents (with a sliding "
            "window or without), which block-sparse attention cannot apply; run it with "
            "attn_implementation='sdpa'"
        )
    return window
