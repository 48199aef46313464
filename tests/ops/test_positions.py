"""Block positions (context parallelism): local query blocks over a compact K/V buffer, in any
slot order, give the rows of the whole-sequence call: out, lse, dq, and dk, dv scattered back.

Each case builds a global layout at a ragged S (one at a whole S, where the kernels load K/V
through tensor descriptors), picks the query blocks of a rank (two chunks, as head-tail
sharding does, or a random subset), gathers their q rows, and builds a buffer of exactly the
kv blocks they read, shuffled, whose padding rows and unused memory hold NaN."""

import dataclasses

import pytest
import torch

from flash_msa import (
    BlockLayout,
    BlockPositions,
    _env,
    block_sparse_attn_func,
    block_sparse_attn_varlen_func,
    patterns,
)
from flash_msa.ops import registry
from flash_msa.sequences import document_ids_of
from flash_msa.testing import random_qkv, relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter


@dataclasses.dataclass
class Local:
    """One rank's share of a global problem."""

    layout: BlockLayout  # the chosen rows, columns naming buffer slots
    positions: BlockPositions
    rows: torch.Tensor  # int64 [S_local]: the global position of each local query row
    # int64 [slots * kv_block]: the global position of each buffer row (-1: padding)
    slot_rows: torch.Tensor


def local_problem(layout: BlockLayout, q_blocks: list[int], seed: int) -> Local:
    """The rows q_blocks (global query blocks, in local order; a ragged global last block
    only last) of layout over a buffer of exactly the kv blocks they read, in a random slot
    order."""
    seq_len, q_block, kv_block = layout.seq_len_q, layout.q_block, layout.kv_block
    blocks = torch.tensor(q_blocks)
    dense = layout.to_dense().cpu()[:, blocks]  # [L, n, num_kv_blocks]
    needed = dense.any(0).any(0).nonzero().flatten()
    generator = torch.Generator().manual_seed(seed)
    kv_blocks = needed[torch.randperm(needed.numel(), generator=generator)]  # [slots]
    local_dense = dense[:, :, kv_blocks]  # [L, n, slots]
    counts = local_dense.sum(-1).flatten()  # [L * n]
    flat = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    n = blocks.numel()
    row_offsets = torch.stack([flat[h * n : (h + 1) * n + 1] for h in range(layout.num_layouts)])
    local = BlockLayout(
        row_offsets.int().to(DEVICE), local_dense.nonzero()[:, 2].int().to(DEVICE),
        seq_len_q=sum(min(q_block, seq_len - b * q_block) for b in q_blocks),
        seq_len_kv=kv_blocks.numel() * kv_block, q_block=q_block, kv_block=kv_block,
        layout_batch=layout.layout_batch, layout_heads=layout.layout_heads,
    )  # fmt: skip
    rows = (blocks[:, None] * q_block + torch.arange(q_block)).flatten()[: local.seq_len_q]
    slot_rows = (kv_blocks[:, None] * kv_block + torch.arange(kv_block)).flatten()
    slot_rows = torch.where(slot_rows < seq_len, slot_rows, -1)
    positions = BlockPositions(blocks.to(DEVICE), kv_blocks.to(DEVICE), seq_len)
    return Local(local, positions, rows.to(DEVICE), slot_rows.to(DEVICE))


def gather_buffer(tensor: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
    """[B, slots * kv_block, H, D] rows of a global [B, S, H, D] tensor: padding rows NaN, in a
    view of wider NaN storage (memory between the rows that nothing may read)."""
    batch, _, heads, head_dim = tensor.shape
    storage = torch.full((batch, slot_rows.numel(), heads, head_dim + 16), float("nan"),
                         dtype=tensor.dtype, device=tensor.device)  # fmt: skip
    buffer = storage[..., :head_dim]
    real = slot_rows >= 0
    buffer[:, real] = tensor[:, slot_rows[real]].detach()
    return buffer


def scatter_buffer(grad: torch.Tensor, slot_rows: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A buffer's dk or dv summed back onto the global rows [B, S, H, D]."""
    real = slot_rows >= 0
    out = grad.new_zeros(grad.shape[0], seq_len, *grad.shape[2:])
    return out.index_add(1, slot_rows[real], grad[:, real])


def head_tail(layout: BlockLayout, ranks: int, rank: int) -> list[int]:
    """The query blocks of `rank` under head-tail sharding: chunks rank and 2 * ranks - 1 - rank
    of 2 * ranks."""
    bounds = torch.linspace(0, layout.num_q_blocks, 2 * ranks + 1).round().long().tolist()
    chunks = (rank, 2 * ranks - 1 - rank)
    return [block for chunk in chunks for block in range(bounds[chunk], bounds[chunk + 1])]


def random_subset(layout: BlockLayout, count: int, seed: int) -> list[int]:
    """count query blocks in a random order; the ragged global last block, if drawn, last."""
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(layout.num_q_blocks, generator=generator)[:count].tolist()
    if layout.seq_len_q % layout.q_block:
        last = layout.num_q_blocks - 1
        blocks.sort(key=lambda block: block == last)  # stable: the others keep their order
    return blocks


def compare(backend, layout, q_blocks, *, heads_q=2, heads_kv=2, batch=1, reference="torch",
            seed=0, **options):  # fmt: skip
    """Errors of the local call on `backend` (float64 for torch, float32 for triton) against
    the rows of the global call on `reference` (float64 for torch): out, lse, dq, dk, dv."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    seq_len = layout.seq_len_q
    local = local_problem(layout, q_blocks, seed)
    q, k, v = random_qkv(batch, seq_len, heads_q, 16, heads_kv=heads_kv, dtype=dtype,
                         device=DEVICE, seed=seed, requires_grad=True)  # fmt: skip
    grad_out = torch.zeros_like(q)
    generator = torch.Generator().manual_seed(seed + 1)
    grad_out[:, local.rows] = torch.randn(grad_out[:, local.rows].shape, generator=generator,
                                          dtype=dtype).to(DEVICE)  # fmt: skip
    reference_dtype = torch.float64 if reference == "torch" else dtype
    exact = [t.detach().to(reference_dtype).requires_grad_() for t in (q, k, v)]
    torch.manual_seed(seed)  # the dropout seed both calls draw
    # deterministic=False: the torch backend's backward on CUDA does not repeat its bits.
    out, lse = block_sparse_attn_func(*exact, layout, return_lse=True, backend=reference,
                                      deterministic=False, **options)  # fmt: skip
    out.backward(grad_out.to(reference_dtype))

    q_local = q.detach()[:, local.rows].requires_grad_()
    k_local, v_local = (gather_buffer(t, local.slot_rows).requires_grad_() for t in (k, v))
    torch.manual_seed(seed)
    local_out, local_lse = block_sparse_attn_func(
        q_local, k_local, v_local, local.layout, return_lse=True, backend=backend,
        positions=local.positions, deterministic=False, **options,
    )  # fmt: skip
    local_out.backward(grad_out[:, local.rows])
    padding = local.slot_rows < 0
    for grad in (k_local.grad, v_local.grad):  # padding rows of a slot: nothing flows there
        assert torch.equal(grad[:, padding], torch.zeros_like(grad[:, padding]))
    return {
        "out": relative_error(local_out, out[:, local.rows]),
        "lse": relative_error(local_lse, lse[:, :, local.rows]),
        "dq": relative_error(q_local.grad, exact[0].grad[:, local.rows]),
        "dk": relative_error(scatter_buffer(k_local.grad, local.slot_rows, seq_len), exact[1].grad),
        "dv": relative_error(scatter_buffer(v_local.grad, local.slot_rows, seq_len), exact[2].grad),
    }


TOLERANCE = {"torch": 1e-12, "triton": 1e-5}  # float64 (sums in another order), float32


def cases():
    """name -> (global layout, the rank's query blocks, compare's options): one per feature."""
    small = dict(q_block=16, kv_block=32)
    mixed = patterns.random_blocks(300, 2, seed=1, **small)
    mixed = mixed | patterns.sliding_window(300, 40, **small)
    bigbird = patterns.bigbird(333, 40, 32, 1, q_block=32, kv_block=64)
    cu_seqlens = torch.tensor([0, 70, 190, 261, 400], dtype=torch.int32)  # across chunk edges
    documents = patterns.causal(400, block_size=32, cu_seqlens=cu_seqlens)
    per_kv_head = patterns.stack(  # S = 320: whole kv blocks, loads through descriptors
        [patterns.random_blocks(320, 3, seed=h, q_block=16, kv_block=64) for h in range(2)]
    )
    per_query_head = patterns.stack(
        [patterns.sliding_window(290, 24 + 16 * h, q_block=64, kv_block=32) for h in range(4)]
    )
    document_ids = document_ids_of(cu_seqlens)[None].to(DEVICE)
    return {
        "causal": (mixed, head_tail(mixed, 2, 0), dict(causal=True)),
        "window": (bigbird, random_subset(bigbird, 6, 3), dict(window_size=(40, 24))),
        "documents": (documents, head_tail(documents, 3, 1),
                      dict(causal=True, document_ids=document_ids, heads_kv=1)),
        "gqa_per_kv_head": (per_kv_head, random_subset(per_kv_head, 7, 4),
                            dict(causal=True, heads_q=4, heads_kv=2, batch=2)),
        "per_query_head": (per_query_head, head_tail(per_query_head, 2, 1),
                           dict(window_size=(40, 0), heads_q=4, heads_kv=2)),
    }  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(cases()))
def test_local_rows_equal_the_global_call(backend, name, poisoned_allocations):
    layout, q_blocks, options = cases()[name]
    errors = compare(backend, layout.to(DEVICE), q_blocks, **options)
    assert all(error < TOLERANCE[backend] for error in errors.values()), errors


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dropout_bits_follow_global_positions(backend, poisoned_allocations):
    """Philox counters are global positions: the local call drops what the global one does."""
    layout = patterns.sliding_window(300, 48, q_block=32, kv_block=64, device=DEVICE)
    options = dict(causal=True, dropout_p=0.3)
    errors = compare(backend, layout, head_tail(layout, 2, 1), reference=backend, **options)
    assert all(error < TOLERANCE[backend] for error in errors.values()), errors


def test_pointer_and_tma_loads_agree():
    """With block positions, tiles of q and of the buffer load through descriptors or pointers
    alike; a buffer that may hold padding rows (the sequence ends inside a kv block) refuses
    tma=True, since descriptors read whole rows."""
    from flash_msa.ops.triton import attention_backward, attention_forward

    layout = patterns.causal(256, q_block=16, kv_block=64, device=DEVICE)
    local = local_problem(layout, head_tail(layout, 2, 0), seed=5)
    q, k, v = random_qkv(1, 256, 2, 16, device=DEVICE, seed=5)
    q, k, v = q[:, local.rows], gather_buffer(k, local.slot_rows), gather_buffer(v, local.slot_rows)
    positions = BlockPositions(
        local.positions.q_blocks.int(), local.positions.kv_blocks.int(), seq_len=256
    )
    options = dict(causal=True, window_size=(-1, -1), softmax_scale=0.25, positions=positions)
    results = []
    for tma in (True, False):
        out, lse = attention_forward(q, k, v, local.layout, **options, tma=tma)
        grads = attention_backward(torch.ones_like(out), q, k, v, out, lse, local.layout,
                                   **options, tma=tma)  # fmt: skip
        results.append((out, lse, *grads))
    for with_tma, with_pointers in zip(*results, strict=True):
        assert relative_error(with_tma, with_pointers) < 1e-6
    ragged = positions._replace(seq_len=250)
    with pytest.raises(ValueError, match="no padding rows in k, v"):
        attention_forward(q, k, v, local.layout, **{**options, "positions": ragged}, tma=True)


def test_varlen_documents_over_the_global_packing():
    """The varlen call with positions: q holds local rows of the packed tokens, cu_seqlens
    packs the whole sequence."""
    cu_seqlens = torch.tensor([0, 45, 150, 222, 300], dtype=torch.int32, device=DEVICE)
    layout = patterns.causal(300, block_size=32, cu_seqlens=cu_seqlens, device=DEVICE)
    local = local_problem(layout, random_subset(layout, 5, seed=2), seed=2)
    q, k, v = random_qkv(1, 300, 2, 16, dtype=torch.float64, device=DEVICE, seed=2)
    out, lse = block_sparse_attn_varlen_func(
        q[0], k[0], v[0], cu_seqlens, 105, layout, causal=True, return_lse=True, backend="torch"
    )
    local_out, local_lse = block_sparse_attn_varlen_func(
        q[0, local.rows], gather_buffer(k, local.slot_rows)[0],
        gather_buffer(v, local.slot_rows)[0], cu_seqlens, 105, local.layout, causal=True,
        return_lse=True, backend="torch", positions=local.positions,
    )  # fmt: skip
    assert relative_error(local_out, out[local.rows]) < 1e-12
    assert relative_error(local_lse, lse[:, local.rows]) < 1e-12


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton")])
def test_vmap_passes_positions_through(backend):
    """vmap folds its dimension into the batch; the positions are the same for every element."""
    layout = patterns.causal(100, q_block=16, kv_block=32, device=DEVICE)
    local = local_problem(layout, [0, 1, 6], seed=1)
    inputs = [random_qkv(1, 100, 2, 16, device=DEVICE, seed=seed) for seed in (1, 2)]
    q = torch.stack([qkv[0][:, local.rows] for qkv in inputs])
    k, v = (torch.stack([gather_buffer(qkv[i], local.slot_rows) for qkv in inputs]) for i in (1, 2))

    def attention(q, k, v):
        return block_sparse_attn_func(q, k, v, local.layout, causal=True, backend=backend,
                                      positions=local.positions)  # fmt: skip

    out = torch.func.vmap(attention)(q, k, v)
    for index in range(2):
        assert relative_error(out[index], attention(q[index], k[index], v[index])) < 1e-6


def test_vmap_over_positions_is_refused():
    from flash_msa.ops.custom_op import sparse_attention

    layout = patterns.causal(100, q_block=16, kv_block=32, device=DEVICE)
    local = local_problem(layout, [0, 6], seed=1)
    q, k, v = random_qkv(1, 100, 2, 16, device=DEVICE, seed=1)
    q, k, v = q[:, local.rows], gather_buffer(k, local.slot_rows), gather_buffer(v, local.slot_rows)

    def attention(q_blocks):
        positions = BlockPositions(q_blocks, local.positions.kv_blocks, 100)
        return sparse_attention(
            q, k, v, local.layout, backend="torch", causal=True, window_size=(-1, -1),
            softmax_scale=0.25, document_ids=None, dropout_p=0.0, dropout_seed=0,
            positions=positions,
        )[0]  # fmt: skip

    with pytest.raises(ValueError, match="vmap over a layout's tensors or block positions"):
        torch.func.vmap(attention)(local.positions.q_blocks.expand(2, -1))


def test_compiled_call_with_positions_matches_eager():
    """torch.compile(fullgraph=True) traces a call with positions (values are checked eagerly)."""
    torch._dynamo.reset()
    layout = patterns.random_blocks(200, 3, seed=2, q_block=16, kv_block=32, device=DEVICE)
    local = local_problem(layout, head_tail(layout, 2, 1), seed=3)
    q, k, v = random_qkv(1, 200, 4, 16, heads_kv=2, device=DEVICE, seed=3)
    q, k, v = q[:, local.rows], gather_buffer(k, local.slot_rows), gather_buffer(v, local.slot_rows)

    def attention(q, k, v):
        return block_sparse_attn_func(q, k, v, local.layout, causal=True, backend="torch",
                                      positions=local.positions)  # fmt: skip

    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    assert relative_error(compiled(q, k, v), attention(q, k, v)) < 1e-6


def test_backends_that_take_positions(monkeypatch):
    """The torch and triton backends take block positions; gluon refuses them (here the
    device's capability is stubbed: no GPU is needed)."""
    call = registry.AttentionCall(
        device=torch.device("cpu"), dtype=torch.float32, head_dim=64, q_block=64, kv_block=64,
        dropout=False, documents=False, deterministic=False, element_masks=True,
        seq_len_q=256, seq_len_kv=512, batch=1, heads_q=4, heads_kv=2, layout_heads=1,
        positions=True,
    )  # fmt: skip
    assert registry.get("torch").refusal(call) is None
    if _env.interpreting():
        assert registry.get("triton").refusal(call) is None
    monkeypatch.setattr(_env, "capability", lambda device: (9, 0))
    hopper = dataclasses.replace(
        call, device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=128, q_block=128,
        kv_block=128, element_masks=False,
    )  # fmt: skip
    assert registry.get("gluon").refusal(dataclasses.replace(hopper, positions=False)) is None
    reason = registry.get("gluon").refusal(hopper).reason
    assert reason.startswith("gluon has no block positions (positions=)")


# ---- bad input -------------------------------------------------------------------------
def bad_input_case():
    """Global S = 100 (q blocks of 16: 0..6, the last of 4 tokens; kv blocks of 32: 0..3, the
    last of 4), causal: local query blocks 0 and 6 (20 rows) over 4 slots (128 rows)."""
    layout = patterns.causal(100, q_block=16, kv_block=32, device=DEVICE)
    local = local_problem(layout, [0, 6], seed=0)
    q, k, v = random_qkv(1, 100, 2, 16, device=DEVICE, seed=0)
    return local, (q[:, local.rows], gather_buffer(k, local.slot_rows),
                   gather_buffer(v, local.slot_rows))  # fmt: skip


def tensor(*values, **kwargs):
    return torch.tensor(values, device=DEVICE, **kwargs)


BAD_POSITIONS = [
    (lambda p: tuple(p), TypeError, r"positions must be a flash_msa.BlockPositions\("),
    (lambda p: p._replace(q_blocks=[0, 6]), TypeError, "positions.q_blocks must be a torch.Tensor"),
    (lambda p: p._replace(kv_blocks=p.kv_blocks.float()), TypeError,
     "positions.kv_blocks must hold integer block indices, got torch.float32"),
    (lambda p: p._replace(q_blocks=p.q_blocks[None]), ValueError,
     r"positions.q_blocks must be 1-D, got shape \[1, 2\]"),
    (lambda p: p._replace(q_blocks=p.q_blocks.to("meta")), ValueError,
     "positions.q_blocks is on meta but q on"),
    (lambda p: p._replace(seq_len=True), ValueError, "positions.seq_len must be a positive int"),
    (lambda p: p._replace(seq_len=100.0), ValueError, "positions.seq_len must be a positive int"),
    (lambda p: p._replace(seq_len=0), ValueError, "positions.seq_len must be a positive int"),
    (lambda p: p._replace(seq_len=2**31), ValueError,
     r"positions.seq_len must be below 2\*\*31 \(the kernels compute token positions in int32\), "
     "got 2147483648"),
    (lambda p: p._replace(q_blocks=tensor(0, 6, 5)), ValueError,
     "positions.q_blocks must name the global block of each of the layout's 2 query blocks"),
    (lambda p: p._replace(kv_blocks=tensor(3, 0, 1)), ValueError,
     r"k, v must be a buffer of whole kv blocks, one per entry of positions.kv_blocks: 3 \* 32 "
     "= 96 rows, got 128"),
    (lambda p: p._replace(q_blocks=tensor(0, 7)), ValueError,
     r"positions.q_blocks must lie in \[0, 7\) \(the 16-token blocks of seq_len=100\), got "
     "values from 0 to 7"),
    (lambda p: p._replace(kv_blocks=torch.cat([tensor(-1), p.kv_blocks[1:]])), ValueError,
     r"positions.kv_blocks must lie in \[0, 4\)"),
    (lambda p: p._replace(seq_len=90), ValueError, r"positions.q_blocks must lie in \[0, 6\)"),
    (lambda p: p._replace(kv_blocks=torch.cat([p.kv_blocks[:1], p.kv_blocks[:-1]])), ValueError,
     "positions.kv_blocks must name each global kv block at most once"),
    (lambda p: p._replace(q_blocks=tensor(6, 0)), ValueError,
     "local query block 0 \\(global block 6\\) holds 16 rows of q, reaching global position "
     "111 past seq_len=100"),
]  # fmt: skip


@pytest.mark.parametrize("change, error, message", BAD_POSITIONS)
def test_bad_positions_are_refused(change, error, message):
    local, (q, k, v) = bad_input_case()
    with pytest.raises(error, match=message):
        block_sparse_attn_func(q, k, v, local.layout, backend="torch",
                               positions=change(local.positions))  # fmt: skip


def test_documents_span_the_global_sequence():
    local, (q, k, v) = bad_input_case()
    call = dict(backend="torch", positions=local.positions)
    local_ids = torch.zeros(1, q.shape[1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"document_ids must be \[batch, seq_len\] = \[1, 100\]"):
        block_sparse_attn_func(q, k, v, local.layout, document_ids=local_ids, **call)
    global_ids = torch.zeros(1, 100, dtype=torch.int32, device=DEVICE)
    block_sparse_attn_func(q, k, v, local.layout, document_ids=global_ids, **call)
    local_packing = tensor(0, q.shape[1], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens must end at the number of packed tokens 100"):
        block_sparse_attn_varlen_func(q[0], k[0], v[0], local_packing, 100, local.layout, **call)
