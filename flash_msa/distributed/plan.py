"""The static context-parallel plan: which rank holds which query blocks, and what it reads.

Computed identically on every rank from the global BlockLayout, with no communication.
A rank holds whole kv blocks of the sequence (queries, keys and values of the same tokens:
self-attention) and with them the query blocks they contain.
"""

from __future__ import annotations

import functools
import hashlib
from typing import NamedTuple

import torch

from flash_msa.layout import BlockLayout
from flash_msa.patterns._build import diagonals, is_int

BALANCES = ("auto", "contiguous", "headtail")
# The names of CpPlan.sizes(), in its order.
PLAN_SIZES = ("world_size", "seq_len", "q_block", "kv_block", "layout batch", "layout heads",
              "active blocks")  # fmt: skip

# H200 figures behind the cost model of balance="auto" (see kv_block_weight).
NVLINK_BYTES_PER_S = 400e9  # NVLink 4 per direction: 450 GB/s nominal, all-to-all gets less
COPY_BYTES_PER_S = 4.27e12  # device-to-device copy (ANCHORS.md)
ATTENTION_FLOPS_PER_S = 600e12  # sparse attention kernels near the ceiling (ANCHORS.md)


def kv_block_weight(q_block: int) -> float:
    """Time to move one kv block's K/V for one head, in units of the time to compute one
    (q_block x kv_block) block pair for one head, forward + backward, on an H200.

    Moving: K and V in bf16 in the forward and dK, dV in fp32 back in the backward are
    (2 * 2 + 2 * 4) * kv_block * D = 12 * kv_block * D bytes, over NVLink (~400 GB/s) plus
    two device copies at 4.27 TB/s (packing the exchange buffer, unpacking it). Computing:
    3.5 * 4 * q_block * kv_block * D = 14 * q_block * kv_block * D FLOPs at ~600 TFLOP/s.
    kv_block and D cancel:

        weight = (12 / 14) * 600e12 * (1 / 400e9 + 2 / 4.27e12) / q_block ~= 1526 / q_block

    about 11.9 at q_block 128 and 23.8 at 64: one remote block costs about what a dozen
    block pairs of compute do. Compute overlapping the exchange is not credited, so the
    model errs towards locality.
    """
    seconds_per_byte = 1 / NVLINK_BYTES_PER_S + 2 / COPY_BYTES_PER_S
    return 12 / 14 * ATTENTION_FLOPS_PER_S * seconds_per_byte / q_block


class NeededBlocks(NamedTuple):
    """The kv blocks one rank's rows read: blocks int64 [n] ascending, owners int64 [n]."""

    blocks: torch.Tensor
    owners: torch.Tensor


class RankExchange(NamedTuple):
    """One rank's part of the forward's block exchange, and its rows split by where their
    kv blocks live. Blocks are whole kv blocks; "slots" index a buffer of such blocks.

    own_blocks: int64 [n_own], the global kv blocks the rank holds, ascending: local kv
        block i of its shards is global block own_blocks[i].
    send_slots: int64 [n_send], the rank's own slots it sends, grouped by destination in
        rank order (ascending within a group); send_counts[t] of them go to rank t.
    recv_blocks: int64 [n_recv], the global kv blocks it receives, grouped by source in
        rank order (ascending within a group); recv_counts[t] of them come from rank t.
    local: the rank's rows over its own blocks (columns name own slots).
    remote: the rank's rows over the received blocks (columns name received slots), or
        None when it receives nothing.
    """

    own_blocks: torch.Tensor
    send_slots: torch.Tensor
    send_counts: list[int]
    recv_blocks: torch.Tensor
    recv_counts: list[int]
    local: BlockLayout
    remote: BlockLayout | None


def _column_subset(layout: BlockLayout, keep: torch.Tensor, slot_of: torch.Tensor, slots: int):
    """The entries of `layout` whose column c has keep[c], with c renamed slot_of[c], as a
    BlockLayout over a buffer of `slots` whole kv blocks (columns re-sorted within rows)."""
    cols = layout.col_indices.long()
    kept = keep[cols]  # [nnz]
    rows = layout.entry_rows()[kept]  # layout * num_q_blocks + row, ascending
    new_cols = slot_of[cols[kept]]
    order = torch.argsort(rows * max(slots, 1) + new_cols)
    counts = torch.bincount(rows, minlength=layout.num_layouts * layout.num_q_blocks)
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=cols.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    n = layout.num_q_blocks
    row_offsets = offsets.as_strided((layout.num_layouts, n + 1), (n, 1)).contiguous()
    return BlockLayout(
        row_offsets.int(),
        new_cols[order].int(),
        seq_len_q=layout.seq_len_q,
        seq_len_kv=slots * layout.kv_block,
        q_block=layout.q_block,
        kv_block=layout.kv_block,
        layout_batch=layout.layout_batch,
        layout_heads=layout.layout_heads,
        validate=False,
    )


def _check_layout(layout) -> None:
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    layout.check_unchanged()
    if layout.seq_len_q != layout.seq_len_kv:
        raise ValueError(
            f"context parallelism shards self-attention: the layout has seq_len_q "
            f"{layout.seq_len_q} and seq_len_kv {layout.seq_len_kv}; build it for one "
            "sequence length"
        )
    if layout.kv_block % layout.q_block != 0:
        raise ValueError(
            f"a rank holds whole kv blocks and the query blocks inside them, so q_block must "
            f"divide kv_block; got q_block {layout.q_block} and kv_block {layout.kv_block}: "
            f"build the layout with q_block = kv_block = {layout.kv_block} (or a q_block "
            f"dividing {layout.kv_block})"
        )


def _check_world_size(world_size, layout: BlockLayout) -> None:
    if not is_int(world_size):
        raise TypeError(f"world_size must be an int, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if world_size > layout.num_kv_blocks:
        unit = "query" if layout.q_block == layout.kv_block else "kv"
        raise ValueError(
            f"world_size {world_size} is more than the {layout.num_kv_blocks} {unit} blocks of "
            f"{layout.kv_block} tokens in the sequence of {layout.seq_len_q} tokens, and each "
            f"rank holds at least one whole block: use world_size <= {layout.num_kv_blocks}, "
            "smaller blocks or a longer sequence"
        )


def _check_rank(rank, world_size: int) -> None:
    if not is_int(rank):
        raise TypeError(f"rank must be an int, got {rank!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}) for this plan, got {rank}")


def _even_counts(total: int, parts: int, device) -> torch.Tensor:
    """int64 [parts] summing to total, differing by at most one (the first ones larger)."""
    counts = torch.full((parts,), total // parts, dtype=torch.int64, device=device)
    counts[: total % parts] += 1
    return counts


def contiguous_owners(num_blocks: int, world_size: int, device=None) -> torch.Tensor:
    """int64 [num_blocks]: world_size contiguous runs of kv blocks, rank 0 first."""
    ranks = torch.arange(world_size, device=device)
    return torch.repeat_interleave(ranks, _even_counts(num_blocks, world_size, device))


def headtail_owners(num_blocks: int, world_size: int, device=None) -> torch.Tensor:
    """int64 [num_blocks]: 2 * world_size chunks along the sequence, chunk r and chunk
    2 * world_size - 1 - r on rank r, so every rank holds one early and one late chunk.
    Each rank holds as many blocks as under contiguous_owners; an odd count puts the extra
    block in the early (cheaper under causal) chunk."""
    counts = _even_counts(num_blocks, world_size, device)
    late = counts // 2
    ranks = torch.arange(world_size, device=device)
    chunk_ranks = torch.cat([ranks, ranks.flip(0)])  # [2w]
    chunk_sizes = torch.cat([counts - late, late.flip(0)])  # [2w]
    return torch.repeat_interleave(chunk_ranks, chunk_sizes)


class CpPlan:
    """A static context-parallel plan: the rank owning each kv block of one layout.

    Build one with cp_plan(); CpPlan(layout, world_size, block_owners) takes any assignment
    of whole kv blocks to ranks. Every method is a function of the global layout and the
    owners only, so all ranks compute the same plan without communicating.

    Attributes:
        layout: the global BlockLayout.
        world_size: number of ranks.
        balance: how the owners were chosen ("contiguous", "headtail" or "custom").
        block_owners: int64 [num_kv_blocks], the rank holding each kv block's tokens.
        query_block_owners: int64 [num_q_blocks], the rank computing each query block.
        busiest_cost: {balance: modelled cost of the busiest rank} for the candidates
            balance="auto" compared (one entry otherwise), in block pairs (see model_cost).
    """

    def __init__(
        self,
        layout: BlockLayout,
        world_size: int,
        block_owners: torch.Tensor,
        *,
        balance: str = "custom",
    ):
        _check_layout(layout)
        _check_world_size(world_size, layout)
        if not isinstance(balance, str):
            raise TypeError(f"balance must be a str naming how the owners were chosen, got "
                            f"{balance!r}")  # fmt: skip
        num_kv_blocks = layout.num_kv_blocks
        if not isinstance(block_owners, torch.Tensor) or block_owners.dtype != torch.int64:
            raise TypeError(
                f"block_owners must be an int64 tensor [num_kv_blocks], got {block_owners!r}"
            )
        if tuple(block_owners.shape) != (num_kv_blocks,):
            raise ValueError(
                f"block_owners must have shape [{num_kv_blocks}] (one rank per kv block), got "
                f"{list(block_owners.shape)}"
            )
        block_owners = block_owners.to(layout.device)
        if bool(((block_owners < 0) | (block_owners >= world_size)).any()):
            raise ValueError(f"block_owners must hold ranks in [0, {world_size})")
        blocks_per_rank = torch.bincount(block_owners, minlength=world_size)
        if bool((blocks_per_rank == 0).any()):
            idle = int((blocks_per_rank == 0).nonzero()[0, 0])
            raise ValueError(f"rank {idle} owns no kv block; give every rank at least one")
        self.layout = layout
        self.world_size = world_size
        self.balance = balance
        self.block_owners = block_owners
        ratio = layout.kv_block // layout.q_block
        device = layout.device
        query_blocks = torch.arange(layout.num_q_blocks, device=device)
        self.query_block_owners = block_owners[query_blocks // ratio]
        # Each rank's query blocks in ascending order: a stable sort by owner.
        self._query_order = torch.argsort(self.query_block_owners, stable=True)
        query_counts = torch.bincount(self.query_block_owners, minlength=world_size)
        self._query_starts = [0, *torch.cumsum(query_counts, 0).tolist()]

        # One pass over the nnz entries: the rank computing each, its pairs, its reads.
        entry_rank = self.query_block_owners[layout.entry_rows() % layout.num_q_blocks]
        cols = layout.col_indices.long()
        self._pairs = torch.bincount(entry_rank, minlength=world_size).tolist()
        needed = torch.zeros(world_size * num_kv_blocks, dtype=torch.bool, device=device)
        needed[entry_rank * num_kv_blocks + cols] = True
        self._needed = needed.view(world_size, num_kv_blocks)  # [w, nk]
        ranks = torch.arange(world_size, device=device)
        remote = self._needed & (block_owners[None, :] != ranks[:, None])  # [w, nk]
        first_token = torch.arange(num_kv_blocks, device=device) * layout.kv_block
        block_tokens = (layout.seq_len_kv - first_token).clamp(max=layout.kv_block)  # [nk]
        self._remote_blocks = remote.sum(1).tolist()
        self._remote_tokens = (remote * block_tokens).sum(1).tolist()
        tokens = torch.zeros(world_size, dtype=torch.int64, device=device)
        self._tokens = tokens.index_add_(0, block_owners, block_tokens).tolist()
        self.busiest_cost = {balance: max(self.model_cost())}
        self._exchanges: dict[tuple[int, bool], RankExchange] = {}
        self._digest: int | None = None
        self._gather_index: torch.Tensor | None = None

    def __repr__(self) -> str:
        return (
            f"CpPlan(world_size={self.world_size}, balance={self.balance!r}, "
            f"seq_len={self.layout.seq_len_q}, q_block={self.layout.q_block}, "
            f"kv_block={self.layout.kv_block}, tokens={self._tokens})"
        )

    # ---- per rank ------------------------------------------------------------------
    def query_blocks(self, rank: int) -> torch.Tensor:
        """int64 [n]: the global query blocks the rank computes, ascending (its local block
        i is global block query_blocks(rank)[i])."""
        _check_rank(rank, self.world_size)
        return self._query_order[self._query_starts[rank] : self._query_starts[rank + 1]]

    def token_index(self, rank: int) -> torch.Tensor:
        """int64 [S_local]: the global token positions the rank holds, ascending. Shard any
        [B, S, ...] tensor (q, k, v, labels) with x[:, plan.token_index(rank)]."""
        blocks = self.query_blocks(rank)
        q_block = self.layout.q_block
        offsets = torch.arange(q_block, device=blocks.device)
        tokens = (blocks[:, None] * q_block + offsets[None, :]).flatten()
        # Only the last query block of the sequence is ragged, and it ends the rank's list.
        return tokens[: self._tokens[rank]]

    def needed_kv_blocks(self, rank: int) -> NeededBlocks:
        """The kv blocks the rank's rows read (its own and remote ones), ascending, with the
        rank owning each: (blocks int64 [n], owners int64 [n])."""
        _check_rank(rank, self.world_size)
        blocks = self._needed[rank].nonzero().flatten()
        return NeededBlocks(blocks, self.block_owners[blocks])

    def local_layout(self, rank: int) -> BlockLayout:
        """The rank's rows of the layout, as a BlockLayout over its S_local query tokens
        (in token_index order) whose columns still name global kv blocks: seq_len_q is
        S_local, seq_len_kv the global S, num_q_blocks the rank's query blocks. Every layout
        head and batch entry is kept (layout_batch and layout_heads as in the global one)."""
        blocks = self.query_blocks(rank)  # [n]
        layout = self.layout
        offsets = layout.row_offsets.long()
        starts = offsets[:, :-1][:, blocks].flatten()  # [L * n]
        counts = offsets[:, 1:][:, blocks].flatten() - starts  # [L * n]
        local_offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=blocks.device)
        torch.cumsum(counts, 0, out=local_offsets[1:])
        total = int(local_offsets[-1])
        segment = torch.repeat_interleave(
            torch.arange(counts.numel(), device=blocks.device), counts, output_size=total
        )
        entry = starts[segment] + torch.arange(total, device=blocks.device)
        entry -= local_offsets[:-1][segment]
        n = blocks.numel()
        # Row l is local_offsets[l * n : (l + 1) * n + 1]: consecutive rows share a boundary.
        row_offsets = local_offsets.as_strided((layout.num_layouts, n + 1), (n, 1))
        return BlockLayout(
            row_offsets.contiguous().int(),
            layout.col_indices[entry],
            seq_len_q=self._tokens[rank],
            seq_len_kv=layout.seq_len_kv,
            q_block=layout.q_block,
            kv_block=layout.kv_block,
            layout_batch=layout.layout_batch,
            layout_heads=layout.layout_heads,
            validate=False,
        )

    def exchange(self, rank: int, *, every_block: bool = False) -> RankExchange:
        """The rank's sends, receives and split rows for the forward's exchange (cached:
        the plan is static): the blocks each rank's rows read, or with every_block all of
        every rank's blocks (what an all-gather moves; for dense layouts)."""
        _check_rank(rank, self.world_size)
        key = (rank, every_block)
        if key not in self._exchanges:
            self._exchanges[key] = self._exchange(rank, every_block)
        return self._exchanges[key]

    def _exchange(self, rank: int, every_block: bool) -> RankExchange:
        owners = self.block_owners
        num_kv_blocks = owners.numel()
        device = owners.device
        owned = owners == rank  # [nk]
        own_blocks = owned.nonzero().flatten()
        own_slot = torch.cumsum(owned, 0) - 1  # [nk]: slot of an owned block
        wanted = torch.ones_like(self._needed) if every_block else self._needed  # [w, nk]
        send = wanted & owned[None, :]  # [w, nk]: what each rank takes from this one
        send[rank] = False
        send_blocks = send.nonzero()[:, 1]  # grouped by destination, ascending within
        receive = wanted[rank] & ~owned  # [nk]
        # Received slots: by source rank, ascending within a source (the all-to-all's order).
        by_source = owners * num_kv_blocks + torch.arange(num_kv_blocks, device=device)
        recv_blocks = receive.nonzero().flatten()
        recv_blocks = recv_blocks[torch.argsort(by_source[recv_blocks])]
        recv_slot = torch.zeros(num_kv_blocks, dtype=torch.int64, device=device)
        recv_slot[recv_blocks] = torch.arange(recv_blocks.numel(), device=device)
        rows = self.local_layout(rank)
        return RankExchange(
            own_blocks=own_blocks,
            send_slots=own_slot[send_blocks],
            send_counts=send.sum(1).tolist(),
            recv_blocks=recv_blocks,
            recv_counts=torch.bincount(owners[recv_blocks], minlength=self.world_size).tolist(),
            local=_column_subset(rows, owned, own_slot, own_blocks.numel()),
            remote=_column_subset(rows, receive, recv_slot, recv_blocks.numel())
            if recv_blocks.numel()
            else None,
        )

    def gather_index(self) -> torch.Tensor:
        """int64 [S]: where each global token sits in the rank-order concatenation of every
        rank's shard, so that whole = torch.cat(shards, 1)[:, plan.gather_index()]."""
        if self._gather_index is None:
            order = torch.cat([self.token_index(rank) for rank in range(self.world_size)])
            self._gather_index = torch.argsort(order)
        return self._gather_index

    @functools.cached_property
    def causal_gap(self) -> tuple[int, int, int] | None:
        """(layout head, query block b, d(b)) of the first row of the layout that lacks some of
        its causal kv blocks 0 .. d(b) (d(b): the block of row b's last query), or None when every
        row holds them all, as patterns.causal's rows do; computed once per plan. A row's
        columns are ascending and unique, so it holds them when its (d(b) + 1)-th column is
        d(b)."""
        layout = self.layout
        rows = torch.arange(layout.num_q_blocks, device=layout.device)
        diagonal = diagonals(rows, dict(seq_len_q=layout.seq_len_q, q_block=layout.q_block,
                                        kv_block=layout.kv_block))  # fmt: skip  # [nq]
        starts = layout.row_offsets[:, :-1].long()  # [L, nq]
        holds = layout.row_offsets[:, 1:] - starts > diagonal  # d(b) + 1 columns or more
        if layout.nnz:
            entry = (starts + diagonal).clamp(max=layout.nnz - 1)
            holds &= layout.col_indices[entry] == diagonal
        gaps = (~holds).nonzero()
        if not len(gaps):
            return None
        head, row = gaps[0].tolist()
        return head, row, int(diagonal[row])

    def sizes(self) -> list[int]:
        """The plan's sizes, named by PLAN_SIZES: ranks compare them, then the digest, before
        they exchange anything."""
        layout = self.layout
        return [self.world_size, layout.seq_len_q, layout.q_block, layout.kv_block,
                layout.layout_batch, layout.layout_heads, layout.nnz]  # fmt: skip

    def digest(self) -> int:
        """A 63-bit fingerprint of the plan (its sizes, the layout's blocks, the owners)."""
        if self._digest is None:
            layout = self.layout
            sha = hashlib.sha256()
            sha.update(repr(self.sizes()).encode())
            for tensor in (layout.row_offsets, layout.col_indices, self.block_owners):
                sha.update(tensor.detach().cpu().contiguous().numpy().tobytes())
            self._digest = int.from_bytes(sha.digest()[:8], "little") >> 1
        return self._digest

    # ---- costs -----------------------------------------------------------------------
    def model_cost(self) -> list[float]:
        """Modelled time of each rank, in block pairs of compute: its active block pairs
        (summed over layout heads and batch) plus kv_block_weight(q_block) per remote kv
        block it receives, for each layout head and batch entry (so the ratio does not depend
        on how many heads a layout broadcasts to; with GQA a kv head serves several query
        heads and the model overstates communication)."""
        weight = kv_block_weight(self.layout.q_block) * self.layout.num_layouts
        return [
            pairs + weight * remote
            for pairs, remote in zip(self._pairs, self._remote_blocks, strict=True)
        ]

    def stats(self, heads_kv: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict:
        """Per-rank lists (index = rank) for K/V of heads_kv heads of head_dim in dtype:

        - cost: active block pairs the rank computes, summed over layout heads and batch.
        - recv_bytes: K/V received in the forward: 2 (K and V) x heads_kv x head_dim x
          element size x the tokens of its remote needed blocks (a ragged last block counts
          its true length). Per batch entry: a batch of B moves B times as much.
        - send_bytes: dK/dV of the same blocks sent back to their owners in the backward,
          in fp32.
        - remote_blocks: remote kv blocks received.
        - tokens: tokens the rank holds.
        """
        for name, value in (("heads_kv", heads_kv), ("head_dim", head_dim)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(
                f"dtype must be a floating torch.dtype (torch.bfloat16, ...), got {dtype!r}"
            )
        per_token = 2 * heads_kv * head_dim
        element = torch.empty((), dtype=dtype).element_size()
        return dict(
            cost=list(self._pairs),
            recv_bytes=[tokens * per_token * element for tokens in self._remote_tokens],
            send_bytes=[tokens * per_token * 4 for tokens in self._remote_tokens],
            remote_blocks=list(self._remote_blocks),
            tokens=list(self._tokens),
        )


def check_plan(plan) -> None:
    """TypeError unless plan is a CpPlan; ValueError if its layout changed since it was built."""
    if not isinstance(plan, CpPlan):
        raise TypeError(f"plan must be a CpPlan (from cp_plan), got {type(plan).__name__}")
    plan.layout.check_unchanged()


def check_balance(balance, name: str = "balance") -> None:
    """A cp_plan balance: one of BALANCES (TypeError / ValueError naming the value)."""
    if not isinstance(balance, str):
        raise TypeError(f"{name} must be a str, one of {BALANCES}, got {balance!r}")
    if balance not in BALANCES:
        raise ValueError(f"{name} must be one of {BALANCES}, got {balance!r}")


def cp_plan(layout: BlockLayout, world_size: int, *, balance: str = "auto") -> CpPlan:
    """Shard one self-attention layout's query blocks (and the K/V of the same tokens)
    across world_size ranks; a static plan, the same on every rank, no communication.

    Args:
        layout: the global BlockLayout (seq_len_q == seq_len_kv; q_block divides kv_block).
            Sequence lengths need not divide anything: ranks hold whole kv blocks and the
            last, ragged one goes with its rank.
        world_size: ranks, at most the number of kv blocks.
        balance:
            - "contiguous": world_size contiguous runs of blocks. Smallest halo: best for
              window layouts.
            - "headtail": 2 x world_size chunks, chunk r and 2 * world_size - 1 - r on rank
              r. Balances causal, top-k and MSA scoring, whose rows grow with position.
            - "auto": the one whose busiest rank costs least under CpPlan.model_cost
              (compute + kv_block_weight per remote block); ties go to "contiguous".

    Returns:
        A CpPlan.

    Examples:
        At 1M tokens, window 4096 + 128 sinks, blocks of 128, 8 ranks, H_kv 8, D 128, bf16
        (each remote block is 0.5 MiB of K/V):

        >>> from flash_msa import patterns
        >>> S = 1 << 20
        >>> layout = patterns.sliding_window(S, 4096) | patterns.global_tokens(S, 128)
        >>> cp_plan(layout, 8, balance="contiguous").stats(8, 128)["recv_bytes"][1] / 2**20
        16.5
        >>> cp_plan(layout, 8, balance="headtail").stats(8, 128)["recv_bytes"][1] / 2**20
        32.5

        contiguous: a rank reads the 32-block halo of its left neighbour and the sink block
        (33 blocks; rank 0 reads nothing). headtail: two halos and the sink (65 blocks);
        rank 0 owns the sink and rank 7's two chunks are adjacent, so each reads one halo.
        Compute is even under both (busiest rank 1.002 x the mean), so "auto" takes
        contiguous. Under dense causal at 1M contiguous's busiest rank computes 1.87 x the
        mean and headtail's 1.00 x: "auto" takes headtail; so it does for top-k 16 (own,
        previous and 14 random earlier blocks), where contiguous's last rank would receive
        3.0 GiB and headtail's busiest 2.1 GiB.

        Balancing by active blocks alone (a min-heap handing each query block, heaviest
        first, to the least loaded rank) evens the compute (max/mean 1.000) but scatters
        the rows: on the window layout above every rank then receives 3.5 GiB, about what a
        ring moves, and 256.5 MiB with chunks of 64 blocks, against 16.5 MiB contiguous
        (tests/distributed/test_plan.py measures it). No balance here does it.
    """
    _check_layout(layout)
    _check_world_size(world_size, layout)
    check_balance(balance)
    builders = dict(contiguous=contiguous_owners, headtail=headtail_owners)
    names = list(builders) if balance == "auto" else [balance]
    plans = [
        CpPlan(
            layout,
            world_size,
            builders[name](layout.num_kv_blocks, world_size, layout.device),
            balance=name,
        )
        for name in names
    ]
    best = min(plans, key=lambda plan: plan.busiest_cost[plan.balance])  # first on ties
    best.busiest_cost = {plan.balance: plan.busiest_cost[plan.balance] for plan in plans}
    return best
