"""Per-token selections (query_masks): each query token reads its own kv blocks of the layout.

Each case draws a random selection per token (its own block plus random earlier ones, some
tokens none), builds the layout as the union of the selected blocks per query block (plus
blocks no token selects: all-zero words) and one int64 word of row bits per active pair,
and checks out, lse, dq, dk and dv against flash_msa.reference's dense float64 attention on
the explicit element mask: the torch backend in float64, the Triton kernels (the interpreter
on the CPU) in float32."""

import dataclasses
import math

import pytest
import torch

from flash_msa import BlockLayout, block_sparse_attn_func, block_sparse_attn_varlen_func, patterns
from flash_msa.ops import registry
from flash_msa.reference import attention_reference, layout_mask
from flash_msa.sequences import document_ids_of
from flash_msa.testing import random_qkv, relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
TOLERANCE = {"torch": 1e-12, "triton": 1e-5}  # float64 (sums in another order), float32
DTYPE = {"torch": torch.float64, "triton": torch.float32}


def random_selection(num_layouts: int, seq_len: int, kv_block: int, top_k: int, seed: int,
                     empty: float = 0.15) -> torch.Tensor:  # fmt: skip
    """bool [L, S, num_kv_blocks]: the kv blocks each query token selects, per layout head:
    its own block and top_k - 1 random earlier ones (causal MSA), none for a fraction
    `empty` of the tokens."""
    generator = torch.Generator().manual_seed(seed)
    num_kv_blocks = math.ceil(seq_len / kv_block)
    own = torch.arange(seq_len) // kv_block  # [S]
    scores = torch.rand(num_layouts, seq_len, num_kv_blocks, generator=generator)
    scores = scores.masked_fill(torch.arange(num_kv_blocks) > own[:, None], -1.0)  # future
    scores[:, torch.arange(seq_len), own] = 2.0  # the own block always wins
    top = scores.topk(min(top_k, num_kv_blocks), dim=-1)
    selection = torch.zeros_like(scores, dtype=torch.bool)
    selection.scatter_(-1, top.indices, top.values >= 0)  # [L, S, num_kv_blocks]
    silent = torch.rand(num_layouts, seq_len, generator=generator) < empty
    return selection & ~silent[..., None]


def layout_and_masks(selection: torch.Tensor, q_block: int, kv_block: int, layout_batch: int,
                     seed: int, unused: int = 2) -> tuple[BlockLayout, torch.Tensor]:  # fmt: skip
    """(layout, query_masks) of a selection [L, S, num_kv_blocks]: the layout's row of each
    query block is the union of its tokens' blocks plus `unused` random blocks (whose words
    are 0), query_masks[e] has bit r set when token r of entry e's query block selected its
    kv block."""
    num_layouts, seq_len, num_kv_blocks = selection.shape
    num_q_blocks = math.ceil(seq_len / q_block)
    padded = torch.zeros(num_layouts, num_q_blocks * q_block, num_kv_blocks, dtype=torch.bool)
    padded[:, :seq_len] = selection
    per_block = padded.view(num_layouts, num_q_blocks, q_block, num_kv_blocks)
    generator = torch.Generator().manual_seed(seed)
    extra = torch.rand(num_layouts, num_q_blocks, num_kv_blocks, generator=generator)
    extra = extra < unused / num_kv_blocks
    keys = (per_block.any(2) | extra).flatten().nonzero().flatten()  # (l * nq + row) * nk + col
    bits = torch.ones((), dtype=torch.int64) << torch.arange(q_block)  # bit 63 reads as -2^63
    words = (per_block.long() * bits[:, None]).sum(2)  # [L, nq, nk]: distinct bits, no carry
    rows = keys // num_kv_blocks
    counts = torch.bincount(rows, minlength=num_layouts * num_q_blocks)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    row_offsets = offsets.as_strided((num_layouts, num_q_blocks + 1), (num_q_blocks, 1))
    layout = BlockLayout(
        row_offsets.int().to(DEVICE), (keys % num_kv_blocks).int().to(DEVICE), seq_len_q=seq_len,
        q_block=q_block, kv_block=kv_block, layout_batch=layout_batch,
        layout_heads=num_layouts // layout_batch,
    )  # fmt: skip
    return layout, words.flatten()[keys].to(DEVICE)


def element_mask(selection: torch.Tensor, layout: BlockLayout, batch: int, heads_q: int,
                 **masks) -> torch.Tensor:  # fmt: skip
    """bool [B, H_q, S, S]: token i reads key j when it selected j's block and the element
    masks (causal, documents) keep the pair."""
    seq_len = selection.shape[1]
    keys = selection.repeat_interleave(layout.kv_block, -1)[..., :seq_len]  # [L, S, S]
    keys = keys.view(layout.layout_batch, layout.layout_heads, seq_len, seq_len)
    keys = keys.repeat_interleave(heads_q // layout.layout_heads, 1)
    return layout_mask(layout.to("cpu"), batch, heads_q, **masks) & keys


@dataclasses.dataclass
class Case:
    seq_len: int = 150
    q_block: int = 32
    kv_block: int = 16
    batch: int = 1
    heads_q: int = 2
    heads_kv: int = 2
    layout_heads: int = 1
    layout_batch: int = 1
    top_k: int = 3
    documents: bool = False
    seed: int = 0


CASES = {
    "causal-ragged": Case(),
    "gqa-per-kv-head": Case(seq_len=120, heads_q=4, heads_kv=2, layout_heads=2, seed=1),
    "gqa-shared-documents": Case(seq_len=130, q_block=16, kv_block=32, heads_q=4, heads_kv=1,
                                 documents=True, seed=2),
    "64-row-words-per-batch": Case(seq_len=170, q_block=64, kv_block=32, batch=2,
                                   layout_batch=2, layout_heads=2, top_k=2, seed=3),
    "8-token-rows-gqa": Case(seq_len=100, q_block=8, kv_block=16, heads_q=4, heads_kv=2,
                             layout_heads=1, seed=4),
}  # fmt: skip


def problem(case: Case, dtype: torch.dtype):
    """Inputs, the layout and query masks, options, and the dense element mask of a case."""
    num_layouts = case.layout_batch * case.layout_heads
    selection = random_selection(num_layouts, case.seq_len, case.kv_block, case.top_k, case.seed)
    layout, query_masks = layout_and_masks(selection, case.q_block, case.kv_block,
                                           case.layout_batch, case.seed)  # fmt: skip
    q, k, v = random_qkv(case.batch, case.seq_len, case.heads_q, 16, heads_kv=case.heads_kv,
                         dtype=dtype, device=DEVICE, seed=case.seed)  # fmt: skip
    options = dict(causal=True)
    document_ids = None
    if case.documents:
        cu_seqlens = torch.tensor([0, 45, 100, case.seq_len], dtype=torch.int32)
        document_ids = document_ids_of(cu_seqlens)[None].expand(case.batch, -1).contiguous()
        options["document_ids"] = document_ids.to(DEVICE)
    mask = element_mask(selection, layout, case.batch, case.heads_q, causal=True,
                        document_ids=document_ids)  # fmt: skip
    return (q, k, v), layout, query_masks, options, mask


def expected(q, k, v, mask, grad_out, precision=torch.float64):
    """out, lse, dq, dk, dv of dense attention on the mask, computed on the CPU in
    `precision` (float64: the exact values). Rows that see nothing get zero out, lse -inf
    and contribute no gradient: the reference runs them over every key with a zero output
    gradient, then reports their out and lse as empty."""
    empty = ~mask.any(-1)  # [B, H_q, S]
    q, k, v = (t.detach().cpu().to(precision).requires_grad_() for t in (q, k, v))
    out, lse = attention_reference(q, k, v, mask | empty[..., None])
    grad_out = grad_out.cpu().to(precision).masked_fill(empty.transpose(1, 2)[..., None], 0.0)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    out = out.detach().masked_fill(empty.transpose(1, 2)[..., None], 0.0)
    return (out, lse.detach().masked_fill(empty, float("-inf")), *grads), empty


def run(backend: str, tensors, layout, query_masks, options, grad_out):
    q, k, v = (t.detach().requires_grad_() for t in tensors)
    # deterministic=False: the torch backend's backward on CUDA does not repeat its bits.
    out, lse = block_sparse_attn_func(q, k, v, layout, return_lse=True, backend=backend,
                                      query_masks=query_masks, deterministic=False,
                                      **options)  # fmt: skip
    out.backward(grad_out)
    return out, lse, q.grad, k.grad, v.grad


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_dense_reference_on_the_element_mask(backend, name, poisoned_allocations):
    tensors, layout, query_masks, options, mask = problem(CASES[name], DTYPE[backend])
    assert bool((query_masks == 0).any()), "a case needs pairs no token reads"
    grad_out = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(9))
    grad_out = grad_out.to(device=DEVICE, dtype=DTYPE[backend])
    reference, empty = expected(*tensors, mask, grad_out)
    assert bool(empty.any()) and not bool(empty.all()), "a case needs empty and non-empty rows"
    actual = run(backend, tensors, layout, query_masks, options, grad_out)
    for label, got, exact in zip(("out", "lse", "dq", "dk", "dv"), actual, reference,
                                 strict=True):  # fmt: skip
        error = relative_error(got, exact)
        assert error < TOLERANCE[backend], f"{label}: relative error {error:.3g}"
    out, lse, dq = (t.detach().cpu() for t in actual[:3])
    rows = empty.transpose(1, 2)  # [B, S, H_q]
    assert bool((out[rows] == 0).all()) and bool((dq[rows] == 0).all())
    assert bool((lse[empty] == float("-inf")).all())


def quarter_words(nnz: int, seed: int) -> torch.Tensor:
    """int64 [nnz] words of 64 rows whose 16-row quarters are, in a random order per word,
    all set, random, all unset and all set: query tiles of 16 rows that read different
    quarters differ in whether they are full."""
    generator = torch.Generator().manual_seed(seed)
    kinds = torch.stack([torch.randperm(4, generator=generator) for _ in range(nnz)])
    kinds = torch.tensor([1, 2, 0, 1])[kinds]  # [nnz, 4]: 0 none, 1 every row, 2 random rows
    random = torch.rand(nnz, 4, 16, generator=generator) < 0.5
    bits = torch.where(kinds[..., None] == 2, random, kinds[..., None] == 1).flatten(1)
    return (bits.long() << torch.arange(64)).sum(1).to(DEVICE)  # [nnz]


def test_tiles_of_part_of_a_query_block(poisoned_allocations):
    """Query tiles of 16 rows in blocks of 64 (as at large head dims): each tile reads its
    own 16 bits of the word, at its offset in the block, to keep rows and to tell whether it
    is full."""
    from flash_msa.ops.triton import attention_backward, attention_forward

    layout = patterns.random_blocks(100, 2, seed=12, q_block=64, kv_block=32, device=DEVICE)
    words = quarter_words(layout.nnz, seed=12)
    dense = torch.zeros(layout.num_q_blocks * layout.num_kv_blocks, dtype=torch.int64)
    dense[layout.keys().cpu()] = words.cpu()
    bits = (dense.view(1, -1, 1, layout.num_kv_blocks) >> torch.arange(64)[:, None]) & 1
    selection = bits.flatten(1, 2).bool()[:, :100]  # [1, S, num_kv_blocks]
    tensors = random_qkv(1, 100, 2, 16, heads_kv=1, device=DEVICE, seed=12)
    masks = registry.QueryMasks(words, words[layout.transpose_entries()])
    options = dict(causal=False, window_size=(-1, -1), softmax_scale=16**-0.5, query_masks=masks)
    out, lse = attention_forward(*tensors, layout, query_rows=16, **options)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    grads = attention_backward(grad_out, *tensors, out, lse, layout, dq_query_rows=16,
                               dkdv_query_rows=16, **options)  # fmt: skip
    reference, _ = expected(*tensors, element_mask(selection, layout, 1, 2), grad_out)
    for label, got, exact in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                                 reference, strict=True):  # fmt: skip
        error = relative_error(got, exact)
        assert error < TOLERANCE["triton"], f"{label}: relative error {error:.3g}"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_all_ones_words_equal_no_masks(backend, poisoned_allocations):
    """Every bit set (padding rows of the ragged last block too) is the call without masks:
    the same blocks, the same element masks, bitwise (the gradients to float64's last bits
    where the backward adds with atomics: the torch backend on CUDA)."""
    layout = patterns.random_blocks(100, 2, seed=4, q_block=32, kv_block=16, device=DEVICE)
    layout = layout | patterns.sliding_window(100, 20, q_block=32, kv_block=16, device=DEVICE)
    tensors = random_qkv(1, 100, 4, 16, heads_kv=2, dtype=DTYPE[backend], device=DEVICE, seed=4)
    grad_out = torch.randn_like(tensors[0])
    ones = torch.full((layout.nnz,), -1, dtype=torch.int64, device=DEVICE)
    options = dict(causal=True)
    with_masks = run(backend, tensors, layout, ones, options, grad_out)
    without = run(backend, tensors, layout, None, options, grad_out)
    repeatable = DEVICE in registry.get(backend).deterministic
    for label, got, exact in zip(("out", "lse", "dq", "dk", "dv"), with_masks, without,
                                 strict=True):  # fmt: skip
        if repeatable or label in ("out", "lse"):
            assert torch.equal(got, exact), label
        else:
            assert relative_error(got, exact) < 1e-13, label


def test_varlen_takes_query_masks(poisoned_allocations):
    """The packed call applies the masks over the layout's packed rows, within documents."""
    case = Case(seq_len=110, q_block=16, kv_block=16, heads_q=2, heads_kv=1, seed=5)
    selection = random_selection(1, case.seq_len, case.kv_block, case.top_k, case.seed)
    layout, query_masks = layout_and_masks(selection, case.q_block, case.kv_block, 1, case.seed)
    cu_seqlens = torch.tensor([0, 37, 80, case.seq_len], dtype=torch.int32)
    q, k, v = random_qkv(1, case.seq_len, 2, 16, heads_kv=1, dtype=torch.float64, device=DEVICE,
                         seed=case.seed)  # fmt: skip
    out, lse = block_sparse_attn_varlen_func(
        q[0], k[0], v[0], cu_seqlens.to(DEVICE), 43, layout, causal=True, return_lse=True,
        backend="torch", query_masks=query_masks,
    )  # fmt: skip
    document_ids = document_ids_of(cu_seqlens)[None]
    mask = element_mask(selection, layout, 1, 2, causal=True, document_ids=document_ids)
    (exact_out, exact_lse, *_), _ = expected(q, k, v, mask, torch.zeros_like(q))
    assert relative_error(out, exact_out[0]) < TOLERANCE["torch"]
    assert relative_error(lse, exact_lse[0]) < TOLERANCE["torch"]


def test_transpose_entries_map_the_csc_order_to_the_csr_one():
    layout = patterns.random_blocks(200, 3, seed=6, q_block=16, kv_block=32, device=DEVICE)
    layout = patterns.stack([layout, patterns.causal(200, q_block=16, kv_block=32, device=DEVICE)])
    entries = layout.transpose_entries()
    transposed = layout.transpose()
    rows = layout.entry_rows()[entries]  # (layout head, query block) of each CSC entry
    t_rows = transposed.entry_rows()  # (layout head, kv block) of each CSC entry
    assert torch.equal(rows // layout.num_q_blocks, t_rows // transposed.num_q_blocks)
    assert torch.equal(rows % layout.num_q_blocks, transposed.col_indices.long())
    assert torch.equal(layout.col_indices[entries].long(), t_rows % transposed.num_q_blocks)
    assert torch.equal(entries.sort().values, torch.arange(layout.nnz, device=DEVICE))


def test_registry_describes_query_masks():
    call = registry.AttentionCall(
        device=torch.device(DEVICE), dtype=torch.float32, head_dim=16, q_block=32, kv_block=32,
        dropout=False, documents=False, deterministic=False, element_masks=True, seq_len_q=64,
        seq_len_kv=64, batch=1, heads_q=2, heads_kv=2, layout_heads=1, query_masks=True,
    )  # fmt: skip
    assert registry.get("gluon").query_masks is True  # tiles of packed heads take them
    without = dataclasses.replace(registry.get("torch"), name="no-masks", query_masks=False)
    assert without.refusal(call).reason == "no-masks has no per-token query masks (query_masks=)"
    assert without.refusal(dataclasses.replace(call, query_masks=False)) is None
    assert registry.get("torch").refusal(call) is None
    assert registry.get("triton").refusal(call) is None


def test_bad_query_masks():
    layout = patterns.causal(96, q_block=32, kv_block=32, device=DEVICE)
    q, k, v = random_qkv(1, 96, 2, 16, device=DEVICE)
    good = torch.full((layout.nnz,), -1, dtype=torch.int64, device=DEVICE)

    def call(query_masks, layout=layout):
        return block_sparse_attn_func(q, k, v, layout, causal=True, backend="torch",
                                      query_masks=query_masks)  # fmt: skip

    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        call([-1] * layout.nnz)
    with pytest.raises(TypeError, match=r"must be int64.*got torch.int32"):
        call(good.int())
    with pytest.raises(ValueError, match=r"shape \[layout.nnz\] = \[6\].*got \[5\]"):
        call(good[:5])
    with pytest.raises(ValueError, match=r"shape \[layout.nnz\].*got \[1, 6\]"):
        call(good[None])
    with pytest.raises(ValueError, match="must be contiguous"):
        call(torch.full((2 * layout.nnz,), -1, dtype=torch.int64, device=DEVICE)[::2])
    with pytest.raises(ValueError, match="is on meta but q on"):
        call(good.to("meta"))
    wide = patterns.causal(256, q_block=128, kv_block=32, device=DEVICE)
    q, k, v = random_qkv(1, 256, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"q_block <= 64 \(one 64-bit word.*got q_block=128"):
        call(torch.zeros(wide.nnz, dtype=torch.int64, device=DEVICE), wide)


def per_batch_problem(seed: int):
    """A per-batch-element, per-kv-head selection over S = 90 and its inputs (B = 2)."""
    selection = random_selection(4, 90, 16, 3, seed)
    layout, query_masks = layout_and_masks(selection, 32, 16, 2, seed)
    q, k, v = random_qkv(2, 90, 4, 16, heads_kv=2, dtype=torch.float64, device=DEVICE, seed=seed)
    return layout, query_masks, (q, k, v)


def test_vmap_passes_query_masks_through():
    """vmap folds its dimension into the batch: a per-batch layout and its words repeat."""
    layout, query_masks, _ = per_batch_problem(seed=7)
    inputs = [random_qkv(2, 90, 4, 16, heads_kv=2, dtype=torch.float64, device=DEVICE, seed=s)
              for s in (7, 8, 9)]  # fmt: skip
    q, k, v = (torch.stack([qkv[i] for qkv in inputs]) for i in range(3))

    def attention(q, k, v):
        return block_sparse_attn_func(q, k, v, layout, causal=True, backend="torch",
                                      query_masks=query_masks)  # fmt: skip

    out = torch.func.vmap(attention)(q, k, v)
    for index in range(3):
        assert relative_error(out[index], attention(q[index], k[index], v[index])) < 1e-12


def test_vmap_over_query_masks_is_refused():
    layout, query_masks, (q, k, v) = per_batch_problem(seed=10)

    def attention(query_masks):
        return block_sparse_attn_func(q, k, v, layout, causal=True, backend="torch",
                                      query_masks=query_masks)  # fmt: skip

    with pytest.raises(ValueError, match=r"vmap over a layout's tensors .*\(or query masks\)"):
        torch.func.vmap(attention)(query_masks.expand(2, -1))


def test_compiled_call_with_query_masks_matches_eager():
    """torch.compile(fullgraph=True) traces a call with query masks, forward and backward."""
    torch._dynamo.reset()
    layout, query_masks, tensors = per_batch_problem(seed=11)
    q, k, v = (t.requires_grad_() for t in tensors)

    def attention(q, k, v):
        return block_sparse_attn_func(q, k, v, layout, causal=True, backend="torch",
                                      query_masks=query_masks, deterministic=False)  # fmt: skip

    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")(q, k, v)
    eager = attention(q, k, v)
    assert relative_error(compiled, eager) < 1e-12
    grads = torch.autograd.grad(compiled.sum(), (q, k, v))
    for grad, exact in zip(grads, torch.autograd.grad(eager.sum(), (q, k, v)), strict=True):
        assert relative_error(grad, exact) < 1e-12


# Compiles the forward and dK/dV kernels with query masks for sm_90 (argv[1]: a work folder;
# dQ shares the forward's kv_step) and prints one JSON report per kernel: the interpreter
# never reaches Triton's GPU code generation.
SM90_SCRIPT = """
import json, sys
from flash_msa.ops.triton import backward, configs, forward
from flash_msa.testing import compile_for_sm90

D, BLOCK = 64, 64
TYPES = {name: "*bf16" for name in ("q", "k", "v", "out", "grad_out", "grad_q", "grad_k",
                                    "grad_v")}
TYPES.update(lse="*fp32", delta="*fp32", row_offsets="*i32", col_indices="*i32",
             row_indices="*i32", documents="*i32", tile_order="*i32", qk_scale="fp32",
             softmax_scale="fp32", dropout_p="fp32", q_block_positions="*i32",
             kv_block_positions="*i32", query_masks="*i64")
for name, kernel in (("forward", forward._forward_kernel), ("dkdv", backward._dkdv_kernel)):
    tile = configs.row_tile(BLOCK, configs.max_query_rows(D, name), 2)
    launch = configs.Launch(D, tile.rows * tile.pack, 2, False, 232448)
    config = {"forward": configs.forward_configs,
              "dkdv": configs.dkdv_configs}[name](launch, BLOCK)[0]
    constexprs = dict(HEAD_DIM=D, HEAD_DIM_PAD=D, Q_BLOCK=BLOCK, KV_BLOCK=BLOCK, HAS_LEFT=False,
                      HAS_RIGHT=True, HAS_DOCUMENTS=True, HAS_DROPOUT=False,
                      HAS_POSITIONS=False, HAS_QUERY_MASKS=True, DOT_PRECISION="tf32",
                      TMA=False, ROWS=tile.rows, PACK=tile.pack, BLOCK_N=BLOCK)
    if name == "dkdv":
        constexprs["TOKENS"] = 1
    report = compile_for_sm90(kernel, constexprs, TYPES, config.num_warps, config.num_stages,
                              sys.argv[1])
    print(json.dumps(dict(report, kernel=name)))
"""


def test_kernels_with_query_masks_compile_for_hopper(sm90):
    """bf16, D = 64, causal with documents and query masks, the first config: the kernels
    compile for sm_90 (the interpreter does not type-check as the compiler does), on tensor
    cores, unspilled."""
    reports = sm90(SM90_SCRIPT)
    assert [report["kernel"] for report in reports] == ["forward", "dkdv"]
    for report in reports:
        assert report["wgmma"], f"{report['kernel']} does not use Hopper tensor cores (wgmma)"
        assert report["spills"] == 0, f"{report['kernel']} spills {report['spills']} bytes"


# ---- the gluon backend on an H100 / H200 ---------------------------------------------------

GLUON_CASES = {
    # MSA's main attention per token: 8 positions x 16 heads a tile, ragged end
    "8x16-per-kv-head": Case(seq_len=1000, q_block=8, kv_block=128, heads_q=32, heads_kv=2,
                             layout_heads=2, top_k=3, seed=20),
    "16x8-documents-batch": Case(seq_len=777, q_block=16, kv_block=128, batch=2, heads_q=16,
                                 heads_kv=2, top_k=2, documents=True, seed=21),
    "64x2-per-batch": Case(seq_len=1100, q_block=64, kv_block=128, batch=2, heads_q=8,
                           heads_kv=4, layout_heads=4, layout_batch=2, top_k=4, seed=22),
    "2x64-one-kv-head": Case(seq_len=600, q_block=2, kv_block=128, heads_q=64, heads_kv=1,
                             top_k=2, seed=23),
}  # fmt: skip


def on_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper(), reason="needs an sm_90 GPU (H100, H200)")
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_masks", [True, False])
@pytest.mark.parametrize("name", list(GLUON_CASES))
def test_gluon_packed_tiles_within_twice_torch_error(name, with_masks, dtype, head_dim,
                                                     poisoned_allocations):  # fmt: skip
    """Tiles of packed query heads (q_block 2 to 64): the Gluon forward and backward (dK and
    dV in Gluon, dQ from the Triton dQ kernel), with the per-token words and without them
    (every token of a query block reads the union of their blocks), against float64 by
    FlashAttention's rule: each of out, lse, dq, dk, dv within 2x PyTorch's error in the
    inputs' dtype."""
    case = GLUON_CASES[name]
    _, layout, query_masks, options, mask = problem(case, torch.float32)
    if not with_masks:  # the union layout, read whole by every token
        query_masks = None
        documents = options["document_ids"].cpu() if case.documents else None
        mask = layout_mask(layout.to("cpu"), case.batch, case.heads_q, causal=True,
                           document_ids=documents)  # fmt: skip
    q, k, v = random_qkv(case.batch, case.seq_len, case.heads_q, head_dim,
                         heads_kv=case.heads_kv, dtype=dtype, device="cuda", seed=case.seed)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(q)
    actual = run("gluon", (q, k, v), layout, query_masks, options, grad_out)
    exact, empty = expected(q, k, v, mask, grad_out)
    same_dtype, _ = expected(q, k, v, mask, grad_out, precision=dtype)
    assert not bool(empty.all())
    for label, got, truth, rounded in zip(("out", "lse", "dq", "dk", "dv"), actual, exact,
                                          same_dtype, strict=True):  # fmt: skip
        error = relative_error(got, truth)
        torch_error = relative_error(rounded, truth)
        assert error <= 2 * torch_error + 1e-6, f"{label}: {error:.3g} vs torch {torch_error:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper(), reason="needs an sm_90 GPU (H100, H200)")
@pytest.mark.parametrize("grad_q", ["gluon", "atomic"])
@pytest.mark.parametrize("name", list(GLUON_CASES))
def test_gluon_dq_modes_on_packed_tiles_within_twice_torch_error(name, grad_q,
                                                                 poisoned_allocations):  # fmt: skip
    """dQ over tiles of packed heads with per-token query masks from the Gluon dQ kernel
    (grad_q="gluon") or added in the dK / dV kernel ("atomic", deterministic=False's): dq,
    dk, dv against float64 by FlashAttention's rule."""
    from flash_msa.ops.gluon import backward

    case = GLUON_CASES[name]
    _, layout, query_masks, options, mask = problem(case, torch.float32)
    q, k, v = random_qkv(case.batch, case.seq_len, case.heads_q, 128, heads_kv=case.heads_kv,
                         dtype=torch.bfloat16, device="cuda", seed=case.seed)  # fmt: skip
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(q)
    out, lse = block_sparse_attn_func(q, k, v, layout, return_lse=True, backend="gluon",
                                      query_masks=query_masks, **options)  # fmt: skip
    words = registry.QueryMasks(query_masks, query_masks[layout.transpose_entries()])  # CSR, CSC
    grads = backward.attention_backward(
        grad_out, q, k, v, out, lse, layout, causal=True, window_size=(-1, -1),
        softmax_scale=128**-0.5, document_ids=options.get("document_ids"), query_masks=words,
        grad_q=grad_q,
    )  # fmt: skip
    exact, _ = expected(q, k, v, mask, grad_out)
    same_dtype, _ = expected(q, k, v, mask, grad_out, precision=torch.bfloat16)
    for label, got, truth, rounded in zip(("dq", "dk", "dv"), grads, exact[2:], same_dtype[2:],
                                          strict=True):  # fmt: skip
        error = relative_error(got, truth)
        torch_error = relative_error(rounded, truth)
        assert error <= 2 * torch_error + 1e-6, f"{label}: {error:.3g} vs torch {torch_error:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not on_hopper(), reason="needs an sm_90 GPU (H100, H200)")
def test_gluon_packed_gradients_are_bitwise_equal():
    """The deterministic gluon backward of packed tiles repeats its bits (dK and dV in
    registers per program, dQ written once per element), also after a deterministic=False
    call (its own within FlashAttention's rule: test_gluon_dq_modes_on_packed_tiles_...)."""
    case = GLUON_CASES["8x16-per-kv-head"]
    _, layout, query_masks, options, _ = problem(case, torch.float32)
    q, k, v = random_qkv(case.batch, case.seq_len, case.heads_q, 128, heads_kv=case.heads_kv,
                         dtype=torch.bfloat16, device="cuda", seed=case.seed)  # fmt: skip
    grad_out = torch.randn_like(q)

    def grads(deterministic):
        tensors = [t.detach().requires_grad_() for t in (q, k, v)]
        out = block_sparse_attn_func(*tensors, layout, backend="gluon", query_masks=query_masks,
                                     deterministic=deterministic, **options)  # fmt: skip
        return torch.autograd.grad(out, tensors, grad_out)

    first = grads(True)
    grads(False)
    for a, b in zip(first, grads(True), strict=True):
        assert torch.equal(a, b)


def test_gluon_packs_only_heads_that_share_a_kv_head_and_a_layout_row():
    """A tile of q_block positions packs 128 / q_block query heads: they must share a kv
    head and a layout row, else the gluon backend refuses the call with the reason (and
    "auto" takes triton)."""
    from flash_msa.ops.gluon.forward import packing_refusal

    assert packing_refusal(8, 64, 4, 4) is None  # MSA per token: 16 heads a kv head
    assert packing_refusal(64, 64, 4, 4) is None and packing_refusal(128, 8, 8, 8) is None
    assert "H_q / H_kv = 8 is not a multiple of 16" in packing_refusal(8, 64, 8, 8)
    assert "H_q / layout_heads = 4 is not a multiple of 8" in packing_refusal(16, 64, 4, 16)
