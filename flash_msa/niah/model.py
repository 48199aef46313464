"""The Llama-architecture language model of the needle benchmark, one attention per variant.

Pre-norm decoder layers (RMSNorm, rotary GQA attention, SwiGLU MLP), untied embeddings.
The variants differ only in the attention; their shared parameters have the same names and,
from init_parameters, the same initial values:

- dense: torch SDPA, causal.
- window: block_sparse_attn_func over patterns.sliding_window | patterns.global_tokens
  (whole blocks: a query sees back `window` tokens rounded out to blocks, and the sinks).
- oracle_topk: each query block of each head keeps its diagonal key block and the
  top_k - 1 earlier blocks with the largest true attention logit (block_scores on q and k
  themselves), then attends over them.
- msa: flash_msa.MSAAttention: a proxy attention selects top_k blocks and learns from the
  KL loss; warmup=True attends densely while the proxy trains on the full context.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from flash_msa import patterns
from flash_msa.layout import BlockLayout
from flash_msa.modules import MSAAttention, _ProjectedAttention
from flash_msa.msa import block_scores, msa_checkpoint_context
from flash_msa.msa.interface import check_granularity
from flash_msa.niah.options import named
from flash_msa.niah.tasks import seed_of
from flash_msa.ops.interface import block_sparse_attn_func
from flash_msa.rotary import apply_rotary, rotary_tables

VARIANTS = ("dense", "window", "oracle_topk", "msa")


@dataclass(frozen=True)
class ModelConfig:
    """The model's sizes and each variant's attention settings.

    Attributes:
        vocab_size: tokens of the vocabulary (NeedleConfig.vocab_size).
        layers, dim, heads, kv_heads: decoder layers, model width, query and key/value heads
            (head_dim = dim / heads).
        rope_base: rotary base; a large one keeps the slowest rotary channels nearly constant
            over 32K positions, so a key matches its query at any distance.
        window, sinks, block_size: the window variant's sliding window and sink tokens, and
            its layout's block size, in tokens.
        top_k, q_block, kv_block: the oracle_topk and msa selections: key blocks per query
            block (the diagonal one included) and the block sizes. Under granularity "token"
            msa selects per token whatever q_block is, and tiles its work with msa_func's
            default query tile (16 tokens where a proxy head serves fewer than 16 query
            heads): a larger tile only widens the union of choices it computes.
        granularity: msa's selection, "token" (each query token's blocks) or "block" (one
            choice per q_block queries); see flash_msa.msa.msa_func.
        proxy_heads, proxy_head_dim: msa's proxy heads (default kv_heads: one per GQA
            group) and their head dim (default head_dim).
        checkpointing: recompute each layer's activations in the backward (less memory).
    """

    vocab_size: int
    layers: int = 4
    dim: int = 512
    heads: int = 8
    kv_heads: int = 2
    rope_base: float = 500000.0
    window: int = 4096
    sinks: int = 128
    block_size: int = 128
    top_k: int = 16
    q_block: int = 64
    kv_block: int = 128
    granularity: str = "token"
    proxy_heads: int | None = None
    proxy_head_dim: int | None = None
    checkpointing: bool = False

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("rope_base", "checkpointing", "granularity") or value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{named(field.name)} must be a positive int, got {value!r}")
        rope_base = self.rope_base
        if type(rope_base) not in (int, float) or not 1 < rope_base < float("inf"):
            raise ValueError(f"rope_base must be a finite number > 1, got {rope_base!r}")
        if not isinstance(self.checkpointing, bool):
            raise TypeError(f"checkpointing must be a bool, got {self.checkpointing!r}")
        check_granularity(self.granularity)
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"{named('dim')} {self.dim} must be a multiple of {named('heads')} {self.heads}, "
                f"and heads a multiple of {named('kv_heads')} {self.kv_heads} (GQA)"
            )
        if (self.dim // self.heads) % 2:
            raise ValueError(
                f"head_dim {self.dim // self.heads} = {named('dim')} / {named('heads')} must be "
                "even (rotary pairs)"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def mlp_dim(self) -> int:
        """SwiGLU's hidden width: 8 / 3 of dim (as many parameters as a 4x MLP), rounded up
        to a multiple of 128."""
        return 128 * math.ceil(8 * self.dim / 3 / 128)


class RotaryAttention(_ProjectedAttention):
    """Causal GQA self-attention with rotary q and k; subclasses say how q attends to k.

    forward(x, warmup=...) -> (out [B, S, dim], None): the interface of MSAAttention, whose
    warmup these variants have no use for.
    """

    def __init__(self, config: ModelConfig):
        super().__init__(config.dim, config.heads, config.kv_heads, False, None, None)
        self.config = config

    def forward(self, x: torch.Tensor, *, warmup: bool = False) -> tuple[torch.Tensor, None]:
        q, k, v = self.project_qkv(x)
        batch, seq_len, _ = x.shape
        cos, sin = rotary_tables(
            seq_len, self.head_dim, base=self.config.rope_base, device=x.device
        )
        out = self.attend(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        return self.out_proj(out.reshape(batch, seq_len, -1)), None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, S, H, D], k and v [B, S, H_kv, D], rotated -> out [B, S, H, D]."""
        raise NotImplementedError


class DenseAttention(RotaryAttention):
    """torch SDPA, causal; k and v repeated per query head, so that every SDPA backend
    (cuDNN's included) takes the call."""

    def attend(self, q, k, v):
        group = self.num_heads // self.num_kv_heads
        k, v = (tensor.repeat_interleave(group, dim=2) for tensor in (k, v))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # [B, H, S, D]
        return out.transpose(1, 2)


class WindowAttention(RotaryAttention):
    """A causal sliding window of config.window tokens plus config.sinks sink tokens."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self._layouts: dict[tuple[int, torch.device], BlockLayout] = {}

    def layout_for(self, seq_len: int, device: torch.device) -> BlockLayout:
        """The window | sinks layout at a length, built once per length and device."""
        key = (seq_len, device)
        if key not in self._layouts:
            sizes = dict(block_size=self.config.block_size, device=device)
            self._layouts[key] = patterns.sliding_window(
                seq_len, self.config.window, **sizes
            ) | patterns.global_tokens(seq_len, self.config.sinks, **sizes)
        return self._layouts[key]

    def attend(self, q, k, v):
        return block_sparse_attn_func(q, k, v, self.layout_for(q.shape[1], q.device), causal=True)


class OracleTopkAttention(RotaryAttention):
    """Per query head, the top_k key blocks by the largest true logit q . k (the diagonal
    block always kept): what a perfect proxy would select."""

    def attend(self, q, k, v):
        config = self.config
        with torch.no_grad():
            scores = block_scores(
                q, k, q_block=config.q_block, kv_block=config.kv_block
            )  # [B, H, nq, nk]
            layout = patterns.topk(
                scores, config.top_k, seq_len_q=q.shape[1], q_block=config.q_block,
                kv_block=config.kv_block, fixed_counts=True,
            )  # fmt: skip
        return block_sparse_attn_func(q, k, v, layout, causal=True)


def attention_for(variant: str, config: ModelConfig) -> nn.Module:
    """The attention layer of a variant (one of VARIANTS)."""
    if variant == "msa":
        return MSAAttention(
            config.dim, config.heads, num_kv_heads=config.kv_heads,
            num_proxy_heads=config.proxy_heads or config.kv_heads,
            proxy_head_dim=config.proxy_head_dim or config.head_dim, top_k=config.top_k,
            q_block=config.q_block if config.granularity == "block" else None,
            kv_block=config.kv_block, rope_base=config.rope_base,
            granularity=config.granularity,
        )  # fmt: skip
    layers = dict(dense=DenseAttention, window=WindowAttention, oracle_topk=OracleTopkAttention)
    if variant not in layers:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return layers[variant](config)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, variant: str, config: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=1e-5)
        self.attention = attention_for(variant, config)
        self.mlp_norm = nn.RMSNorm(config.dim, eps=1e-5)
        self.mlp = SwiGLU(config.dim, config.mlp_dim)

    def forward(self, x: torch.Tensor, warmup: bool):
        """x [B, S, dim] -> (x [B, S, dim], kl_loss or None)."""
        attended, kl_loss = self.attention(self.attention_norm(x), warmup=warmup)
        x = x + attended
        return x + self.mlp(self.mlp_norm(x)), kl_loss


class NeedleLM(nn.Module):
    """The language model of one variant: tokens -> logits at the requested positions.

    Args:
        variant: one of VARIANTS.
        config: sizes and attention settings.
    """

    def __init__(self, variant: str, config: ModelConfig):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.variant, self.config = variant, config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(variant, config) for _ in range(config.layers))
        self.norm = nn.RMSNorm(config.dim, eps=1e-5)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, *, warmup: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits at the given positions and the mean KL loss of the msa layers.

        Args:
            tokens: int64 [B, S].
            positions: int64 [N], flat indices b * S + i of the positions to predict from.
            warmup: msa attends densely (its warm-up); the other variants ignore it.

        Returns:
            logits fp32 [N, vocab_size] and kl_loss (fp32 scalar; None but for msa).
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq_len], got shape {list(tokens.shape)}")
        x = self.embed(tokens)
        kl_losses = []
        for layer in self.layers:
            if self.config.checkpointing and torch.is_grad_enabled():
                x, kl_loss = checkpoint(layer, x, warmup, use_reentrant=False,
                                        context_fn=msa_checkpoint_context)  # fmt: skip
            else:
                x, kl_loss = layer(x, warmup)
            if kl_loss is not None:
                kl_losses.append(kl_loss)
        hidden = self.norm(x.flatten(0, 1)[positions])  # [N, dim]: the answers only
        kl_loss = torch.stack(kl_losses).mean() if kl_losses else None
        return self.lm_head(hidden).float(), kl_loss


def init_parameters(model: nn.Module, seed: int) -> None:
    """Normal(0, 0.02) weights (output projections scaled by 1 / sqrt(2 * layers)), unit
    norms; each parameter drawn from a generator seeded by (seed, its name), so parameters
    of one name start equal in every variant."""
    depth_scale = 1 / math.sqrt(2 * len(model.layers))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:  # RMSNorm weights
                parameter.fill_(1.0)
                continue
            generator = torch.Generator().manual_seed(seed_of(seed, name))
            output = name.endswith(("out_proj.weight", "down_proj.weight"))
            std = 0.02 * (depth_scale if output else 1.0)
            values = torch.randn(parameter.shape, generator=generator) * std
            parameter.copy_(values.to(parameter.device, parameter.dtype))
