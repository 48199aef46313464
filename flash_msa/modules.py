"""nn.Module layers built on block_sparse_attn_func."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from flash_msa import patterns
from flash_msa.layout import BlockLayout
from flash_msa.ops.interface import block_sparse_attn_func

PatternBuilder = Callable[..., BlockLayout]  # builder(seq_len, *, block_size, device)


class FlashSparseAttention(nn.Module):
    """Self-attention over a block-sparse pattern: qkv projection, sparse attention,
    output projection. x [B, S, embed_dim] -> [B, S, embed_dim].

    pattern: a BlockLayout (fixed sequence length) or a builder called as
    pattern(seq_len, block_size=..., device=...) and cached per length and device,
    e.g. functools.partial(flash_msa.patterns.sliding_window, window=4096).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        block_size: int = 128,
        pattern: BlockLayout | PatternBuilder = patterns.causal,
        causal: bool = True,
        window_size: tuple[int, int] = (-1, -1),
        bias: bool = False,
        backend: str = "auto",
        device=None,
        dtype=None,
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads} (GQA)"
            )
        if not (isinstance(pattern, BlockLayout) or callable(pattern)):
            raise TypeError(
                f"pattern must be a BlockLayout or a builder, got {type(pattern).__name__}"
            )
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.block_size, self.pattern = block_size, pattern
        self.causal, self.window_size, self.backend = causal, window_size, backend
        factory = dict(device=device, dtype=dtype)
        kv_dim = num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(embed_dim, embed_dim + 2 * kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self._layouts: dict[tuple[int, torch.device], BlockLayout] = {}

    def layout_for(self, seq_len: int, device: torch.device) -> BlockLayout:
        if isinstance(self.pattern, BlockLayout):
            return self.pattern
        key = (seq_len, device)
        if key not in self._layouts:
            self._layouts[key] = self.pattern(seq_len, block_size=self.block_size, device=device)
        return self._layouts[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"x must be [batch, seq_len, embed_dim], got shape {list(x.shape)}")
        batch, seq_len, _ = x.shape
        kv_dim = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * self.head_dim, kv_dim, kv_dim], dim=-1)
        out = block_sparse_attn_func(
            q.view(batch, seq_len, self.num_heads, self.head_dim),
            k.view(batch, seq_len, self.num_kv_heads, self.head_dim),
            v.view(batch, seq_len, self.num_kv_heads, self.head_dim),
            self.layout_for(seq_len, x.device),
            causal=self.causal,
            window_size=self.window_size,
            backend=self.backend,
        )
        return self.out_proj(out.reshape(batch, seq_len, -1))
