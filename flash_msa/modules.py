"""nn.Module layers built on block_sparse_attn_func and msa_func."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from flash_msa import distributed, patterns
from flash_msa.distributed import comm
from flash_msa.distributed.plan import check_balance, check_plan
from flash_msa.layout import BlockLayout, check_block_size, checked_device
from flash_msa.msa import msa_func
from flash_msa.msa.fp8 import check_score_dtype
from flash_msa.msa.interface import check_granularity, check_msa_blocks, default_q_block
from flash_msa.ops import registry
from flash_msa.ops.interface import block_sparse_attn_func, check_bools, check_options
from flash_msa.rotary import apply_rotary, check_base, rotary_tables

PatternBuilder = Callable[..., BlockLayout]  # builder(seq_len, *, block_size, device)


def _check_positive_ints(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _split_heads(projected: torch.Tensor, heads: list[tuple[int, int]]) -> list[torch.Tensor]:
    """[B, S, sum of H * D] -> one [B, S, H, D] view per (H, D) of heads."""
    batch, seq_len, _ = projected.shape
    parts = projected.split([count * dim for count, dim in heads], dim=-1)
    return [
        part.view(batch, seq_len, count, dim)
        for part, (count, dim) in zip(parts, heads, strict=True)
    ]


def _check_cp_group(cp_group) -> None:
    comm.check_member(cp_group, "cp_group")
    if cp_group is not None and not isinstance(cp_group, torch.distributed.ProcessGroup):
        raise TypeError(
            f"cp_group must be a torch.distributed ProcessGroup (e.g. dist.group.WORLD after "
            f"init_process_group) or None, got {type(cp_group).__name__}"
        )


def _check_cp_plan(cp_group, cp_plan) -> None:
    """A layer built with cp_group takes shards and their plan; one without, neither."""
    if cp_group is None and cp_plan is not None:
        raise ValueError("cp_plan is for layers built with cp_group=...; drop it")
    if cp_group is not None and cp_plan is None:
        raise ValueError(
            "a layer with cp_group takes shards: pass cp_plan=layer.cp_plan_for(whole_seq_len, "
            "device) and x[:, plan.token_index(rank)]"
        )


class _ProjectedAttention(nn.Module):
    """The q, k, v projection (GQA: num_heads a multiple of num_kv_heads) and the output
    projection around an attention; head_dim = embed_dim / num_heads."""

    def __init__(self, embed_dim, num_heads, num_kv_heads, bias, device, dtype):
        super().__init__()
        _check_positive_ints(embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads)
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads} (GQA)"
            )
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool, got {bias!r}")
        device = checked_device(device)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(
                f"dtype must be None or a floating torch.dtype (the weights'), got {dtype!r}"
            )
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        kv_dim = num_kv_heads * self.head_dim
        factory = dict(device=device, dtype=dtype)
        self.qkv_proj = nn.Linear(embed_dim, embed_dim + 2 * kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)

    def check_input(self, x: torch.Tensor) -> None:
        """x [B, S, embed_dim] in the layer's dtype and device (TypeError / ValueError)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.embed_dim or x.shape[1] == 0:
            raise ValueError(
                f"x must be [batch, seq_len, embed_dim] with embed_dim = {self.embed_dim} and "
                f"seq_len at least 1, got shape {list(x.shape)}"
            )
        weight = self.qkv_proj.weight
        if x.device != weight.device or (
            x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type)
        ):
            raise TypeError(
                f"x is {x.dtype} on {x.device} but the layer's weights are {weight.dtype} on "
                f"{weight.device}: pass x in the layer's dtype and device, move the layer with "
                ".to(...), or run under torch.autocast"
            )

    def check_shard(self, x: torch.Tensor, cp_plan) -> None:
        """With context parallelism, every rank's input and plan checked together (one
        all_gather of a flag): a bad one on any rank raises on every rank, before a rank could
        wait alone in the attention's collectives."""

        def check() -> None:
            self.check_input(x)
            check_plan(cp_plan)
            comm.check_group_size(cp_plan, self.cp_group)
            rank = comm.group_rank(self.cp_group)
            tokens = cp_plan.token_index(rank).numel()
            if x.shape[1] != tokens:
                raise ValueError(
                    f"the shard x holds {x.shape[1]} tokens but the plan gives rank {rank} "
                    f"{tokens}: shard with x[:, plan.token_index(rank)]"
                )

        comm.check_on_every_rank(self.cp_group, check)

    def project_qkv(self, x: torch.Tensor, cp_plan=None) -> list[torch.Tensor]:
        """x [B, S, embed_dim] -> q [B, S, num_heads, D], k and v [B, S, num_kv_heads, D],
        after checking x (with a cp_plan, every rank's shard and plan together: check_shard)."""
        if cp_plan is None:
            self.check_input(x)
        else:
            self.check_shard(x, cp_plan)
        kv_heads = (self.num_kv_heads, self.head_dim)
        return _split_heads(self.qkv_proj(x), [(self.num_heads, self.head_dim), kv_heads, kv_heads])


@torch.compiler.disable
def _built_layout(pattern, seq_len: int, block_size: int, device) -> BlockLayout:
    """pattern's layout, built eagerly: builders read values off the device, which
    torch.compile cannot trace (a graph break there; a cached layout needs none)."""
    return pattern(seq_len, block_size=block_size, device=device)


class FlashSparseAttention(_ProjectedAttention):
    """Self-attention over a block-sparse pattern: qkv projection, sparse attention,
    output projection. x [B, S, embed_dim] -> [B, S, embed_dim].

    pattern: a BlockLayout (fixed sequence length) or a builder called as
    pattern(seq_len, block_size=..., device=...) and cached per length and device,
    e.g. functools.partial(flash_msa.patterns.sliding_window, window=4096). A builder runs
    eagerly on the first call at a length: under torch.compile(fullgraph=True), call the
    layer once before compiling, or pass a BlockLayout. deterministic: as in
    block_sparse_attn_func (False: a faster backward where the backend has one, its sums in
    a varying order; the context-parallel path's backward is the reproducible one).

    With cp_group (a torch.distributed process group: context parallelism), forward(x,
    cp_plan=plan) takes this rank's shard x [B, S_local, embed_dim] of the plan;
    cp_plan_for(seq_len, device) builds the plan from the pattern for the group's size
    (cached), and x[:, plan.token_index(rank)] shards a whole batch.
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
        deterministic: bool = True,
        cp_group=None,
        cp_balance: str = "auto",
        device=None,
        dtype=None,
    ):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        super().__init__(embed_dim, num_heads, num_kv_heads, bias, device, dtype)
        check_options(causal, window_size, None, 0.0, deterministic)
        if backend != "auto":
            registry.get(backend)
        check_balance(cp_balance, "cp_balance")
        _check_cp_group(cp_group)
        self._layouts: dict[tuple[int, torch.device], BlockLayout] = {}
        self._plans: dict[tuple[int, torch.device], distributed.CpPlan] = {}
        self.block_size, self.pattern = block_size, pattern
        self.causal, self.window_size, self.backend = causal, window_size, backend
        self.deterministic = deterministic
        self.cp_group, self.cp_balance = cp_group, cp_balance

    def __setattr__(self, name: str, value) -> None:
        """pattern and block_size are checked; assigning one of what the cached layouts and
        plans are built from (pattern, block_size, cp_group, cp_balance) empties the caches."""
        if name == "pattern" and not (isinstance(value, BlockLayout) or callable(value)):
            kind = type(value).__name__
            raise TypeError(f"pattern must be a BlockLayout or a builder, got {kind}")
        if name == "block_size":
            check_block_size("block_size", value)
        super().__setattr__(name, value)
        if name in ("pattern", "block_size", "cp_group", "cp_balance"):
            self._layouts.clear()
            self._plans.clear()

    def layout_for(self, seq_len: int, device: torch.device) -> BlockLayout:
        if isinstance(self.pattern, BlockLayout):
            return self.pattern
        key = (seq_len, device)
        if key not in self._layouts:
            self._layouts[key] = _built_layout(self.pattern, seq_len, self.block_size, device)
        return self._layouts[key]

    def cp_plan_for(self, seq_len: int, device: torch.device) -> distributed.CpPlan:
        """The context-parallel plan of the layer's layout at the whole sequence length
        seq_len, for cp_group's size (cached per length and device)."""
        if self.cp_group is None:
            raise ValueError("cp_plan_for needs a layer built with cp_group=...")
        key = (seq_len, torch.device(device))
        if key not in self._plans:
            world_size = torch.distributed.get_world_size(self.cp_group)
            layout = self.layout_for(seq_len, key[1])
            self._plans[key] = distributed.cp_plan(layout, world_size, balance=self.cp_balance)
        return self._plans[key]

    def forward(
        self, x: torch.Tensor, *, cp_plan: distributed.CpPlan | None = None
    ) -> torch.Tensor:
        _check_cp_plan(self.cp_group, cp_plan)
        q, k, v = self.project_qkv(x, cp_plan)
        batch, seq_len, _ = x.shape
        options = dict(causal=self.causal, window_size=self.window_size, backend=self.backend)
        if cp_plan is None:
            layout = self.layout_for(seq_len, x.device)
            out = block_sparse_attn_func(q, k, v, layout, **options,
                                         deterministic=self.deterministic)  # fmt: skip
        else:
            out = distributed.block_sparse_attn_cp(q, k, v, cp_plan, group=self.cp_group, **options)
        return self.out_proj(out.reshape(batch, seq_len, self.embed_dim))


class MSAAttention(_ProjectedAttention):
    """MiniMax Sparse Attention layer: x [B, S, embed_dim] -> (out [B, S, embed_dim], kl_loss).

    Projections give q [B, S, num_heads, D] (D = embed_dim / num_heads), k, v
    [B, S, num_kv_heads, D], q_proxy [B, S, num_proxy_heads, proxy_head_dim] and k_proxy
    [B, S, num_proxy_kv_heads, proxy_head_dim]; rotary embeddings (base rope_base) rotate all
    four by position. Each proxy head picks top_k key blocks (of kv_block positions) for every
    query token (granularity "token", MiniMax's; "block": one choice per query block of
    q_block positions, cheaper and coarser) of its num_heads / num_proxy_heads query heads, and
    the main attention, always causal, runs over those blocks only. q_block None: msa_func's
    default (for "token", only the main attention's query tile: 8 where num_heads /
    num_proxy_heads packs 16 heads or more to a tile, else 16; 64 for "block"). score_dtype
    torch.float8_e4m3fn scores the blocks in FP8 (msa_func's). deterministic: msa_func's (False:
    a faster main-attention backward where the backend has one, its sums in a varying order;
    the context-parallel path's backward is the reproducible one).

    Train with loss = task_loss + coefficient * kl_loss: selection is discrete, so the proxy
    projection learns from kl_loss alone (it reads x detached), and kl_loss sends no gradient
    into q, k, v or the layers below.
    forward(x, warmup=True) attends densely (every causal block) while the proxy trains on the
    full causal context.

    With cp_group (context parallelism), forward(x, cp_plan=plan) takes this rank's shard
    x [B, S_local, embed_dim] (rotary embeddings at the shard's global positions) and runs
    msa_func_cp; cp_plan_for(seq_len, device) builds the plan (head-tail chunks of the
    causal layout of the layer's blocks), and kl_loss is the whole sequence's.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int,
        num_proxy_heads: int,
        proxy_head_dim: int = 128,
        num_proxy_kv_heads: int = 1,
        top_k: int = 16,
        q_block: int | None = None,
        kv_block: int = 128,
        granularity: str = "token",
        score_dtype: torch.dtype | None = None,
        deterministic: bool = True,
        rope_base: float = 10000.0,
        bias: bool = False,
        cp_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__(embed_dim, num_heads, num_kv_heads, bias, device, dtype)
        check_granularity(granularity)  # first: it sets q_block's default
        check_bools(deterministic=deterministic)
        check_score_dtype(score_dtype, torch.device("cpu"))  # the GPU: per call
        _check_positive_ints(
            num_proxy_heads=num_proxy_heads,
            proxy_head_dim=proxy_head_dim,
            num_proxy_kv_heads=num_proxy_kv_heads,
            top_k=top_k,
        )
        if num_heads % num_proxy_heads != 0:
            raise ValueError(
                f"num_heads {num_heads} must be a multiple of num_proxy_heads {num_proxy_heads}: "
                "each proxy head selects blocks for a group of query heads"
            )
        for name, heads in (
            ("num_kv_heads", num_kv_heads),
            ("num_proxy_kv_heads", num_proxy_kv_heads),
        ):
            if num_proxy_heads % heads != 0:
                raise ValueError(
                    f"num_proxy_heads {num_proxy_heads} must be a multiple of {name} {heads}"
                )
        for name, dim in (("head_dim", self.head_dim), ("proxy_head_dim", proxy_head_dim)):
            if dim % 2 != 0:
                raise ValueError(f"{name} {dim} must be even: rotary embeddings rotate pairs")
        q_block = default_q_block(q_block, granularity, num_heads // num_proxy_heads)
        check_msa_blocks(q_block, kv_block, granularity, num_heads // num_proxy_heads)
        check_base("rope_base", rope_base)
        self.num_proxy_heads, self.num_proxy_kv_heads = num_proxy_heads, num_proxy_kv_heads
        self.proxy_head_dim, self.rope_base = proxy_head_dim, rope_base
        self.top_k, self.q_block, self.kv_block = top_k, q_block, kv_block
        self.granularity, self.score_dtype = granularity, score_dtype
        self.deterministic = deterministic
        proxy_dim = (num_proxy_heads + num_proxy_kv_heads) * proxy_head_dim
        self.proxy_proj = nn.Linear(embed_dim, proxy_dim, bias=bias, device=device, dtype=dtype)
        _check_cp_group(cp_group)
        self.cp_group = cp_group
        self._plans: dict[tuple[int, torch.device], distributed.CpPlan] = {}

    def cp_plan_for(self, seq_len: int, device: torch.device) -> distributed.CpPlan:
        """The context-parallel plan of a whole sequence of seq_len tokens for cp_group's
        size: head-tail chunks of the causal layout of (q_block, kv_block), cached."""
        if self.cp_group is None:
            raise ValueError("cp_plan_for needs a layer built with cp_group=...")
        key = (seq_len, torch.device(device))
        if key not in self._plans:
            layout = patterns.causal(
                seq_len, q_block=self.q_block, kv_block=self.kv_block, device=key[1]
            )
            world_size = torch.distributed.get_world_size(self.cp_group)
            self._plans[key] = distributed.cp_plan(layout, world_size, balance="headtail")
        return self._plans[key]

    def forward(
        self, x: torch.Tensor, *, warmup: bool = False, cp_plan: distributed.CpPlan | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_cp_plan(self.cp_group, cp_plan)
        q, k, v = self.project_qkv(x, cp_plan)
        batch, seq_len, _ = x.shape
        proxy_dim = self.proxy_head_dim
        q_proxy, k_proxy = _split_heads(
            self.proxy_proj(x.detach()),  # kl_loss trains proxy_proj alone, no layer below
            [(self.num_proxy_heads, proxy_dim), (self.num_proxy_kv_heads, proxy_dim)],
        )
        positions = None if cp_plan is None else cp_plan.token_index(
            torch.distributed.get_rank(self.cp_group)
        )  # fmt: skip
        length = seq_len if cp_plan is None else cp_plan.layout.seq_len_q
        tables = {
            dim: [
                table if positions is None else table[positions]
                for table in rotary_tables(length, dim, base=self.rope_base, device=x.device)
            ]
            for dim in {self.head_dim, self.proxy_head_dim}
        }  # D -> (cos, sin), each [S (local), D / 2]
        q, k, q_proxy, k_proxy = (
            apply_rotary(tensor, *tables[tensor.shape[-1]]) for tensor in (q, k, q_proxy, k_proxy)
        )
        if cp_plan is None:
            out, kl_loss = self.attend(q_proxy, k_proxy, q, k, v, warmup)
        else:
            out, kl_loss = distributed.msa_func_cp(
                q_proxy, k_proxy, q, k, v, cp_plan, group=self.cp_group, top_k=self.top_k,
                q_block=self.q_block, kv_block=self.kv_block, warmup=warmup,
                granularity=self.granularity, score_dtype=self.score_dtype,
            )  # fmt: skip
        return self.out_proj(out.reshape(batch, seq_len, self.embed_dim)), kl_loss

    def attend(
        self,
        q_proxy: torch.Tensor,
        k_proxy: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        warmup: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MSA of the rotated heads -> out [B, S, num_heads, D] and the scalar kl_loss."""
        return msa_func(
            q_proxy,
            k_proxy,
            q,
            k,
            v,
            top_k=self.top_k,
            q_block=self.q_block,
            kv_block=self.kv_block,
            warmup=warmup,
            granularity=self.granularity,
            score_dtype=self.score_dtype,
            deterministic=self.deterministic,
        )
