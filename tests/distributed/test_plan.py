"""cp_plan: sharding, balance and traffic of the static context-parallel plan (no processes)."""

import heapq
import time

import pytest
import torch

from flash_msa import patterns
from flash_msa.distributed import CpPlan, cp_plan
from flash_msa.distributed.plan import kv_block_weight
from flash_msa.layout import BlockLayout

MiB = 1 << 20
WORLD_SIZES = [1, 2, 3, 4, 7]


def window_sinks(seq_len, window, sinks, **blocks):
    return patterns.sliding_window(seq_len, window, **blocks) | patterns.global_tokens(
        seq_len, sinks, **blocks
    )


def batched_topk(seq_len, block, batch=2, heads=2, k=3):
    blocks = -(-seq_len // block)
    scores = torch.randn(batch, heads, blocks, blocks, generator=torch.Generator().manual_seed(0))
    return patterns.topk(scores, k, seq_len_q=seq_len, block_size=block)


# Ragged lengths throughout: 1000 = 31 * 32 + 8, 1000 = 62 * 16 + 8, 777 = 24 * 32 + 9.
LAYOUTS = {
    "window+sinks": lambda: window_sinks(1000, 100, 40, block_size=32),
    "causal": lambda: patterns.causal(1000, block_size=32),
    "bigbird": lambda: patterns.bigbird(1000, 64, 32, 2, seed=3, block_size=32),
    "random": lambda: patterns.random_blocks(777, 3, seed=1, causal=False, block_size=32),
    "per-head": lambda: patterns.stack(
        [
            window_sinks(1000, 64, 16, block_size=32),
            patterns.causal(1000, block_size=32),
            patterns.random_blocks(1000, 2, seed=5, block_size=32),
        ]
    ),
    "batch 2 x heads 2": lambda: batched_topk(1000, 32),
    "q16 kv32 window": lambda: window_sinks(1000, 96, 16, q_block=16, kv_block=32),
    "q16 kv32 batched causal": lambda: patterns.causal(1000, q_block=16, kv_block=32).expand(2, 3),
}


def global_keys(plan, rank):
    """The (layout, global row, column) keys of a rank's local layout, as layout.keys()."""
    local = plan.local_layout(rank)
    rows = plan.query_blocks(rank)
    entry = local.entry_rows()
    layer, row = entry // local.num_q_blocks, rows[entry % local.num_q_blocks]
    layout = plan.layout
    return (layer * layout.num_q_blocks + row) * layout.num_kv_blocks + local.col_indices.long()


def check_plan(plan):
    layout = plan.layout
    seq_len, q_block, kv_block = layout.seq_len_q, layout.q_block, layout.kv_block
    dense = layout.to_dense()  # [L, nq, nk]
    stats = plan.stats(heads_kv=3, head_dim=8, dtype=torch.float16)
    tokens, keys = [], []
    for rank in range(plan.world_size):
        index = plan.token_index(rank)
        assert index.dtype == torch.int64 and index.numel() == stats["tokens"][rank] > 0
        assert bool((index[1:] > index[:-1]).all())
        tokens.append(index)
        rows = plan.query_blocks(rank)
        assert torch.equal(index[::q_block] // q_block, rows)  # whole query blocks, aligned
        local = plan.local_layout(rank)
        sizes = {name: getattr(local, name) for name in BlockLayout.SIZES}
        BlockLayout(local.row_offsets, local.col_indices, **sizes)  # validates the CSR
        global_sizes = {name: getattr(layout, name) for name in BlockLayout.SIZES}
        assert sizes == {**global_sizes, "seq_len_q": index.numel()}
        assert local.num_q_blocks == rows.numel()
        assert torch.equal(local.to_dense(), dense[:, rows])
        keys.append(global_keys(plan, rank))
        # Needed blocks: exactly the columns the rank's rows read, with their owners.
        blocks, owners = plan.needed_kv_blocks(rank)
        read = dense[:, rows].any(0).any(0).nonzero().flatten()
        assert torch.equal(blocks, read)
        assert torch.equal(blocks, torch.unique(local.col_indices.long()))
        for block, owner in zip(blocks.tolist(), owners.tolist(), strict=True):
            assert block * kv_block in plan.token_index(owner)
        # recv_bytes from first principles: the true length of every remote block.
        remote = blocks[owners != rank]
        remote_tokens = (seq_len - remote * kv_block).clamp(max=kv_block).sum()
        assert stats["recv_bytes"][rank] == int(remote_tokens) * 2 * 3 * 8 * 2
        assert stats["send_bytes"][rank] == 2 * stats["recv_bytes"][rank]  # fp32 vs fp16
        assert stats["remote_blocks"][rank] == remote.numel()
        check_exchange(plan, rank, local, blocks, owners)
    assert torch.equal(torch.cat(tokens).sort().values, torch.arange(seq_len))
    assert torch.equal(torch.cat(keys).sort().values, layout.keys())
    assert sum(stats["cost"]) == layout.nnz
    if plan.world_size == 1:
        assert stats["recv_bytes"] == [0] and stats["send_bytes"] == [0]


def check_exchange(plan, rank, local, blocks, owners):
    """The rank's exchange: what it receives from each source is what that source sends it,
    and its own and received parts of its rows are, mapped back to global blocks, its rows."""
    exchange = plan.exchange(rank)
    assert torch.equal(exchange.own_blocks, (plan.block_owners == rank).nonzero().flatten())
    first = 0
    for source, count in enumerate(exchange.recv_counts):
        sent = plan.exchange(source)
        start = sum(sent.send_counts[:rank])
        slots = sent.send_slots[start : start + sent.send_counts[rank]]
        assert torch.equal(exchange.recv_blocks[first : first + count], sent.own_blocks[slots])
        first += count
    assert torch.equal(exchange.recv_blocks.sort().values, blocks[owners != rank])
    dense = local.to_dense()  # [L, n, nk]
    parts = torch.zeros_like(dense)
    assert (exchange.remote is None) == (exchange.recv_blocks.numel() == 0)
    for part, names in ((exchange.local, exchange.own_blocks),
                        (exchange.remote, exchange.recv_blocks)):  # fmt: skip
        if part is None:
            continue
        sizes = {name: getattr(part, name) for name in BlockLayout.SIZES}
        assert sizes["seq_len_kv"] == names.numel() * plan.layout.kv_block
        BlockLayout(part.row_offsets, part.col_indices, **sizes)  # sorted, unique, in range
        parts[:, :, names] += part.to_dense()
    assert torch.equal(parts, dense)


@pytest.mark.parametrize("balance", ["contiguous", "headtail", "auto"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_plan_invariants(name, world_size, balance):
    plan = cp_plan(LAYOUTS[name](), world_size, balance=balance)
    assert plan.balance in ("contiguous", "headtail")
    assert plan.balance == balance or balance == "auto"
    check_plan(plan)


def test_balances_assign_whole_chunks():
    # 10 blocks on 3 ranks: 4, 3, 3 blocks; head-tail chunks (2, 2, 2 | 1, 1, 2) in sequence
    # order rank 0, 1, 2, 2, 1, 0.
    layout = patterns.causal(300, block_size=32)  # 10 blocks, the last of 12 tokens
    contiguous = cp_plan(layout, 3, balance="contiguous").block_owners.tolist()
    headtail = cp_plan(layout, 3, balance="headtail").block_owners.tolist()
    assert contiguous == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert headtail == [0, 0, 1, 1, 2, 2, 2, 1, 0, 0]
    assert cp_plan(layout, 3, balance="headtail").stats(1, 1)["tokens"] == [108, 96, 96]
    # More ranks than blocks per chunk: head-tail chunks may be empty, ranks never are.
    assert cp_plan(layout, 7, balance="headtail").block_owners.tolist() == [
        0, 1, 2, 3, 4, 5, 6, 2, 1, 0,
    ]  # fmt: skip
    assert cp_plan(layout, 10, balance="headtail").stats(1, 1)["tokens"] == [32] * 9 + [12]


def imbalance(plan):
    cost = plan.stats(8, 128)["cost"]
    return max(cost) / (sum(cost) / len(cost))


def busiest_recv(plan):
    return max(plan.stats(8, 128)["recv_bytes"])


@pytest.mark.parametrize("world_size", [2, 4, 7])
def test_headtail_balances_causal_and_auto_takes_it(world_size):
    layout = patterns.causal(8192, block_size=64)
    contiguous = cp_plan(layout, world_size, balance="contiguous")
    headtail = cp_plan(layout, world_size, balance="headtail")
    assert imbalance(headtail) < 1.05 < 1.3 < imbalance(contiguous)
    auto = cp_plan(layout, world_size)
    assert auto.balance == "headtail"
    assert auto.busiest_cost["headtail"] < auto.busiest_cost["contiguous"]


@pytest.mark.parametrize("world_size", [2, 4, 7])
def test_contiguous_minimises_window_traffic_and_auto_takes_it(world_size):
    layout = window_sinks(8192, 512, 64, block_size=64)
    contiguous = cp_plan(layout, world_size, balance="contiguous")
    headtail = cp_plan(layout, world_size, balance="headtail")
    if world_size == 2:  # rank 1's two chunks touch: one halo, as under contiguous
        assert busiest_recv(contiguous) == busiest_recv(headtail)
    else:
        assert busiest_recv(contiguous) < busiest_recv(headtail)
    total = [sum(plan.stats(8, 128)["recv_bytes"]) for plan in (contiguous, headtail)]
    assert total[0] < total[1]
    assert cp_plan(layout, world_size).balance == "contiguous"
    assert cp_plan(layout, 1).balance == "contiguous"  # a tie goes to contiguous


def test_auto_takes_headtail_for_topk():
    seq_len = 1 << 15
    layout = patterns.random_blocks(seq_len, 14) | patterns.sliding_window(seq_len, 128)
    assert cp_plan(layout, 8).balance == "headtail"


def test_kv_block_weight_from_h200_figures():
    # (12 / 14) * 600e12 * (1 / 400e9 + 2 / 4.27e12) / q_block
    assert kv_block_weight(128) == pytest.approx(11.92, abs=0.01)
    assert kv_block_weight(64) == pytest.approx(2 * kv_block_weight(128))


def minheap_plan(layout, world_size, chunk_blocks):
    """Balance by active blocks alone: chunks, heaviest first, to the least loaded rank."""
    work = layout.row_counts().view(layout.num_layouts, -1).sum(0).tolist()
    chunks = [
        sum(work[start : start + chunk_blocks]) for start in range(0, len(work), chunk_blocks)
    ]
    loads = [(0, rank) for rank in range(world_size)]
    owners = [0] * len(chunks)
    for chunk in sorted(range(len(chunks)), key=lambda chunk: -chunks[chunk]):
        load, rank = heapq.heappop(loads)
        owners[chunk] = rank
        heapq.heappush(loads, (load + chunks[chunk], rank))
    block_owners = torch.tensor(owners).repeat_interleave(chunk_blocks)[: layout.num_kv_blocks]
    return CpPlan(layout, world_size, block_owners, balance="minheap")


def test_balancing_by_active_blocks_alone_destroys_locality():
    # 128K tokens, window 4096 + 128 sinks, 8 ranks: compute evens out either way, but the
    # min-heap scatters rows, and each rank then reads blocks from everywhere.
    seq_len = 1 << 17
    layout = window_sinks(seq_len, 4096, 128)
    contiguous = cp_plan(layout, 8)
    per_block, per_chunk = minheap_plan(layout, 8, 1), minheap_plan(layout, 8, 16)
    check_plan(minheap_plan(patterns.causal(1000, block_size=32), 3, 1))
    assert contiguous.balance == "contiguous"
    assert busiest_recv(contiguous) == 33 * MiB // 2
    assert imbalance(per_block) <= imbalance(contiguous) < 1.02
    assert busiest_recv(per_block) == 896 * MiB // 2  # every block but its own
    assert busiest_recv(per_chunk) == 257 * MiB // 2  # 7.8 x contiguous
    assert max(per_block.model_cost()) > 1.5 * max(contiguous.model_cost())


def test_one_million_tokens_window_sinks_on_8_ranks():
    seq_len = 1 << 20
    layout = window_sinks(seq_len, 4096, 128)  # 8192 blocks of 128, 34 per row
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        plan = cp_plan(layout, 8)  # builds and compares both candidates
        seconds.append(time.perf_counter() - start)
    assert min(seconds) < 0.5
    assert plan.balance == "contiguous"
    stats = plan.stats(8, 128, torch.bfloat16)
    block = 2 * 128 * 8 * 128 * 2  # K and V of one block: 0.5 MiB
    assert block == MiB // 2
    # Rank r > 0: the 32-block window halo of rank r - 1 and the sink block of rank 0.
    assert stats["recv_bytes"] == [0] + [33 * block] * 7  # 16.5 MiB
    assert stats["send_bytes"] == [2 * b for b in stats["recv_bytes"]]
    assert sum(stats["cost"]) == layout.nnz
    headtail = cp_plan(layout, 8, balance="headtail").stats(8, 128)["recv_bytes"]
    # Two halos and the sink (65 blocks); rank 0 holds the sink and rank 7's chunks touch.
    assert headtail == [32 * block] + [65 * block] * 6 + [33 * block]  # 32.5 MiB busiest
    local = plan.local_layout(5)
    assert local.seq_len_q == seq_len // 8 and local.nnz == 1024 * 34
    blocks, owners = plan.needed_kv_blocks(5)
    assert blocks.numel() == 1024 + 33 and owners.unique().tolist() == [0, 4, 5]


def test_layouts_it_cannot_shard():
    with pytest.raises(TypeError, match="layout must be a BlockLayout"):
        cp_plan(torch.ones(4, 4), 2)
    cross = patterns.from_dense_mask(
        torch.ones(4, 2, dtype=torch.bool), seq_len_q=128, seq_len_kv=64, block_size=32
    )
    with pytest.raises(ValueError, match="self-attention.*seq_len_q 128 and seq_len_kv 64"):
        cp_plan(cross, 2)
    wide_q = patterns.causal(256, q_block=64, kv_block=32)
    with pytest.raises(ValueError, match="q_block must divide kv_block.*q_block 64 and kv_b"):
        cp_plan(wide_q, 2)
    layout = patterns.causal(256, block_size=32)
    layout.col_indices[0] = 0  # in place, even to the same value
    with pytest.raises(ValueError, match="modified in place"):
        cp_plan(layout, 2)


@pytest.mark.parametrize(
    "world_size, error, message",
    [
        (True, TypeError, "world_size must be an int, got True"),
        (2.0, TypeError, "world_size must be an int, got 2.0"),
        (0, ValueError, "world_size must be at least 1, got 0"),
        (-3, ValueError, "world_size must be at least 1, got -3"),
        (9, ValueError, "world_size 9 is more than the 8 query blocks.*world_size <= 8"),
    ],
)
def test_bad_world_size(world_size, error, message):
    with pytest.raises(error, match=message):
        cp_plan(patterns.causal(250, block_size=32), world_size)


def test_world_size_counts_kv_blocks_when_q_block_is_smaller():
    layout = patterns.causal(256, q_block=16, kv_block=64)  # 16 query blocks in 4 kv blocks
    assert cp_plan(layout, 4).stats(1, 1)["tokens"] == [64] * 4
    with pytest.raises(ValueError, match="more than the 4 kv blocks"):
        cp_plan(layout, 5)


@pytest.mark.parametrize(
    "balance, error", [("zigzag", ValueError), ("Auto", ValueError), (None, TypeError)]
)
def test_bad_balance(balance, error):
    with pytest.raises(error, match=r"balance must be .*\('auto', 'contiguous', 'headtail'\)"):
        cp_plan(patterns.causal(256, block_size=32), 2, balance=balance)


def test_bad_rank_and_stats_arguments():
    plan = cp_plan(patterns.causal(256, block_size=32), 2)
    for method in (plan.token_index, plan.query_blocks, plan.needed_kv_blocks, plan.local_layout):
        with pytest.raises(ValueError, match=r"rank must be in \[0, 2\) for this plan, got 2"):
            method(2)
        with pytest.raises(TypeError, match="rank must be an int, got False"):
            method(False)
    with pytest.raises(ValueError, match="heads_kv must be a positive int, got 0"):
        plan.stats(0, 128)
    with pytest.raises(ValueError, match="head_dim must be a positive int, got 1.5"):
        plan.stats(8, 1.5)
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        plan.stats(8, 128, torch.int32)


def test_custom_owners_are_checked():
    layout = patterns.causal(256, block_size=32)  # 8 kv blocks
    with pytest.raises(TypeError, match="block_owners must be an int64 tensor"):
        CpPlan(layout, 2, torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"shape \[8\]"):
        CpPlan(layout, 2, torch.zeros(7, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"ranks in \[0, 2\)"):
        CpPlan(layout, 2, torch.full((8,), 2))
    with pytest.raises(ValueError, match="rank 1 owns no kv block"):
        CpPlan(layout, 2, torch.zeros(8, dtype=torch.int64))
    with pytest.raises(TypeError, match="balance must be a str naming how the owners were"):
        CpPlan(layout, 2, torch.arange(8) % 2, balance=3)
    interleaved = CpPlan(layout, 2, torch.arange(8) % 2)
    check_plan(interleaved)
    assert interleaved.token_index(1)[:3].tolist() == [32, 33, 34]
