"""proxy_kl_loss (its three Triton kernels, a custom op) against a float64 eager KL over the
same layout."""

import math

import pytest
import torch
from triton.runtime.errors import OutOfResources

from flash_msa import BlockLayout, block_sparse_attn_func, patterns
from flash_msa.msa import kl, proxy_kl_loss
from flash_msa.reference import layout_mask
from flash_msa.sequences import document_ids_of
from flash_msa.testing import relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
BATCH, SEQ_LEN, HEADS_Q, HEADS_KV, HEADS_PROXY, HEADS_PROXY_KEYS = 2, 200, 4, 2, 2, 1
DIM, PROXY_DIM, Q_BLOCK, KV_BLOCK = 16, 8, 32, 64


def _inputs(seed: int, seq_len: int = SEQ_LEN, heads_kv: int = HEADS_KV, heads_q: int = HEADS_Q):
    generator = torch.Generator().manual_seed(seed)
    shapes = {
        "q_proxy": (HEADS_PROXY, PROXY_DIM), "k_proxy": (HEADS_PROXY_KEYS, PROXY_DIM),
        "q": (heads_q, DIM), "k": (heads_kv, DIM), "v": (heads_kv, DIM),
    }  # fmt: skip
    return {
        name: torch.randn(BATCH, seq_len, *shape, generator=generator).to(DEVICE)
        for name, shape in shapes.items()
    }


def _layout(seed: int, cu_seqlens=None, seq_len: int = SEQ_LEN):
    """Per (batch, proxy head) top-2 of random block scores, the diagonal always kept."""
    grid = (BATCH, HEADS_PROXY, math.ceil(seq_len / Q_BLOCK), math.ceil(seq_len / KV_BLOCK))
    scores = torch.rand(grid, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    layout = patterns.topk(scores, 2, seq_len_q=seq_len, q_block=Q_BLOCK, kv_block=KV_BLOCK,
                           fixed_counts=True)  # fmt: skip
    if cu_seqlens is not None:
        layout = layout & patterns.causal(seq_len, q_block=Q_BLOCK, kv_block=KV_BLOCK,
                                          device=DEVICE, cu_seqlens=cu_seqlens)  # fmt: skip
    return layout


def _expected_kl(tensors, layout, documents, scale, proxy_scale):
    """float64: mean over (batch, proxy head, token) of KL(teacher || student) over the keys
    the main attention sees (the layout's blocks, causal, one document)."""
    q_proxy, k_proxy, q, k = (tensors[name].cpu().double() for name in ("q_proxy", "k_proxy",
                                                                          "q", "k"))  # fmt: skip
    q_proxy.requires_grad_()
    k_proxy.requires_grad_()
    seq_len, heads_kv, heads_q = k.shape[1], k.shape[2], q.shape[2]
    mask = layout_mask(layout.to("cpu"), BATCH, HEADS_PROXY, causal=True,
                       document_ids=None if documents is None else documents.cpu())  # fmt: skip
    group = heads_q // HEADS_PROXY
    logits = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(heads_q // heads_kv, 2))
    logits = (logits * scale).masked_fill(~mask.repeat_interleave(group, 1), -math.inf)
    teacher = logits.softmax(-1).view(BATCH, HEADS_PROXY, group, seq_len, seq_len).mean(2)
    keys = k_proxy.repeat_interleave(HEADS_PROXY // HEADS_PROXY_KEYS, 2)
    student = torch.einsum("bihd,bjhd->bhij", q_proxy, keys) * proxy_scale
    log_student = student.masked_fill(~mask, -math.inf).log_softmax(-1)
    terms = torch.where(teacher > 0, teacher * (teacher.log() - log_student), 0.0)
    loss = terms.sum(-1).mean()
    return loss, torch.autograd.grad(loss, (q_proxy, k_proxy))


@pytest.mark.parametrize(
    "documents, heads_q, shared, chunked",
    [(False, HEADS_Q, False, False), (True, HEADS_Q, False, False), (True, 24, False, False),
     (True, HEADS_Q, False, True), (False, HEADS_Q, True, True)],
)  # fmt: skip
def test_proxy_kl_loss_matches_float64(documents, heads_q, shared, chunked, monkeypatch):
    """heads_q 24: 12 query heads per proxy head (the teacher's loop over a group that is
    not a power of two). shared: one causal layout for every batch element and proxy head
    (the rows kernel's copies, and both proxy heads adding into the one key head); chunked:
    the gradient tiles of one query block at a time (a launch of each kernel per block)."""
    if chunked:
        monkeypatch.setattr(kl, "GRAD_TILE_BYTES", 1)
    tensors = _inputs(seed=int(documents), heads_q=heads_q)
    cu_seqlens = torch.tensor([0, 70, 150, SEQ_LEN], dtype=torch.int32, device=DEVICE)
    document_ids = None
    if documents:
        document_ids = document_ids_of(cu_seqlens)[None].expand(BATCH, -1).contiguous()
    layout = _layout(seed=3, cu_seqlens=cu_seqlens if documents else None)
    if shared:
        layout = patterns.causal(SEQ_LEN, q_block=Q_BLOCK, kv_block=KV_BLOCK, device=DEVICE)
    scale, proxy_scale = DIM**-0.5, 0.7
    _, lse = block_sparse_attn_func(
        tensors["q"], tensors["k"], tensors["v"], layout, causal=True, softmax_scale=scale,
        return_lse=True, document_ids=document_ids,
    )  # fmt: skip
    q_proxy = tensors["q_proxy"].requires_grad_()
    k_proxy = tensors["k_proxy"].requires_grad_()
    loss = proxy_kl_loss(
        q_proxy, k_proxy, tensors["q"], tensors["k"], lse, layout, softmax_scale=scale,
        proxy_softmax_scale=proxy_scale, document_ids=document_ids,
    )  # fmt: skip
    grads = torch.autograd.grad(loss, (q_proxy, k_proxy))
    expected, expected_grads = _expected_kl(tensors, layout, document_ids, scale, proxy_scale)
    assert relative_error(loss, expected) < 1e-5
    for name, grad, exact in zip(("q_proxy", "k_proxy"), grads, expected_grads, strict=True):
        assert relative_error(grad, exact) < 1e-4, name


@pytest.mark.parametrize("rank", [False, True])
def test_proxy_kl_loss_compiles_without_graph_breaks(rank):
    """The whole sequence's mean, and a rank's sum (its q_blocks checked but for the values:
    torch.compile reads none)."""
    torch._dynamo.reset()
    tensors = _inputs(seed=5)
    layout = _layout(seed=6)
    q, k = tensors["q"], tensors["k"]
    _, lse = block_sparse_attn_func(q, k, tensors["v"], layout, causal=True, return_lse=True)
    q_proxy, options = tensors["q_proxy"], {}
    if rank:  # blocks 0, 1 and the ragged last one, 6 (8 tokens)
        q_blocks = torch.tensor([0, 1, 6], device=DEVICE)
        tokens = _tokens(q_blocks, SEQ_LEN)
        _, layout = _rank_layouts(layout, q_blocks, len(tokens))
        q_proxy, q, lse = q_proxy[:, tokens], q[:, tokens], lse[:, :, tokens]
        options = dict(q_blocks=q_blocks, reduction="sum")
    q_proxy = q_proxy.detach().requires_grad_()

    def loss(q_proxy):
        return proxy_kl_loss(
            q_proxy, tensors["k_proxy"], q, k, lse, layout, softmax_scale=DIM**-0.5,
            proxy_softmax_scale=PROXY_DIM**-0.5, **options,
        )  # fmt: skip

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")(q_proxy)
    eager = loss(q_proxy)
    assert torch.equal(compiled, eager)
    assert torch.equal(torch.autograd.grad(compiled, q_proxy)[0],
                       torch.autograd.grad(eager, q_proxy)[0])  # fmt: skip


# ---- a rank's query blocks (context parallelism) -----------------------------------------
RANK_LEN = 333  # 11 query blocks of 32 (the last of 13 tokens), 6 kv blocks of 64
RANK_BLOCKS = {"head-tail": [0, 1, 2, 8, 9, 10], "random": [1, 4, 5, 6, 9]}


def _tokens(q_blocks, seq_len):
    """The global positions of the rows of q_blocks, back to back."""
    return torch.cat([torch.arange(b * Q_BLOCK, min((b + 1) * Q_BLOCK, seq_len))
                      for b in q_blocks.tolist()]).to(DEVICE)  # fmt: skip


def _rank_layouts(layout, q_blocks, local_len):
    """The whole sequence's layout with only the rows q_blocks kept (the others emptied),
    and the rank's local layout of those rows (seq_len_q local_len, seq_len_kv global)."""
    dense = layout.to_dense()  # [L, nq, nk]
    kept = torch.zeros_like(dense)
    kept[:, q_blocks] = dense[:, q_blocks]
    shape = (layout.layout_batch, layout.layout_heads, -1, layout.num_kv_blocks)
    blocks = dict(q_block=Q_BLOCK, kv_block=KV_BLOCK, seq_len_kv=layout.seq_len_kv)
    restricted = patterns.from_dense_mask(kept.view(shape), seq_len_q=layout.seq_len_q, **blocks)
    local = patterns.from_dense_mask(dense[:, q_blocks].view(shape), seq_len_q=local_len,
                                     **blocks)  # fmt: skip
    return restricted, local


@pytest.mark.parametrize("documents, kind", [(True, "head-tail"), (False, "random")])
def test_proxy_kl_loss_of_query_blocks_equal_the_global_rows(documents, kind):
    """A rank's KL sum and gradients (q_proxy, q and lse its rows; k_proxy and k whole)
    equal the whole sequence's call on its rows alone (the other rows' blocks emptied), and
    that sum the float64 one. GQA (H_q 4, H_p 2, H_kv 1, H_pk 1); documents cross the
    chunks' edges."""
    tensors = _inputs(seed=7, seq_len=RANK_LEN, heads_kv=1)
    cu_seqlens = torch.tensor([0, 50, 100, 270, RANK_LEN], dtype=torch.int32, device=DEVICE)
    document_ids = None
    if documents:
        document_ids = document_ids_of(cu_seqlens)[None].expand(BATCH, -1).contiguous()
    layout = _layout(seed=8, cu_seqlens=cu_seqlens if documents else None, seq_len=RANK_LEN)
    scale, proxy_scale = DIM**-0.5, 0.7
    q, k = tensors["q"], tensors["k"]
    _, lse = block_sparse_attn_func(q, k, tensors["v"], layout, causal=True, return_lse=True,
                                    softmax_scale=scale, document_ids=document_ids)  # fmt: skip
    q_blocks = torch.tensor(RANK_BLOCKS[kind], device=DEVICE)
    tokens = _tokens(q_blocks, RANK_LEN)
    restricted, local = _rank_layouts(layout, q_blocks, len(tokens))
    common = dict(softmax_scale=scale, proxy_softmax_scale=proxy_scale,
                  document_ids=document_ids, reduction="sum")  # fmt: skip
    q_proxy = tensors["q_proxy"].requires_grad_()
    k_proxy = tensors["k_proxy"].requires_grad_()
    whole = proxy_kl_loss(q_proxy, k_proxy, q, k, lse, restricted, **common)
    whole_grads = torch.autograd.grad(whole, (q_proxy, k_proxy))
    rank_q_proxy = q_proxy.detach()[:, tokens].requires_grad_()
    loss = proxy_kl_loss(rank_q_proxy, k_proxy, q[:, tokens], k, lse[:, :, tokens], local,
                         q_blocks=q_blocks, **common)  # fmt: skip
    grads = torch.autograd.grad(loss, (rank_q_proxy, k_proxy))
    assert relative_error(loss, whole) < 1e-5
    assert relative_error(grads[0], whole_grads[0][:, tokens]) < 1e-5
    assert relative_error(grads[1], whole_grads[1]) < 1e-5
    expected, _ = _expected_kl(tensors, restricted, document_ids, scale, proxy_scale)
    terms = BATCH * RANK_LEN * HEADS_PROXY  # the float64 mean is over every row
    assert relative_error(loss, expected * terms) < 1e-5


@pytest.mark.parametrize(
    "q_blocks, error, match",
    [
        ([0, 6], TypeError, "q_blocks must be a torch.Tensor, got list"),
        (torch.tensor([0.0, 6.0]), TypeError, "integer block indices, got torch.float32"),
        (torch.tensor([0, 6], device="meta"), ValueError, "q_blocks is on meta but the"),
        (torch.tensor([0, 1, 6]), ValueError, r"2 for 40 local rows .* got shape \[3\]"),
        (torch.tensor([0, 7]), ValueError, r"lie in \[0, 7\) .* from 0 to 7"),
        (torch.tensor([6, 0]), ValueError, "block 0 holds 32 rows but global query block 6"),
    ],
)
def test_proxy_kl_loss_rejects_bad_query_blocks(q_blocks, error, match):
    """200 tokens in blocks of 32: global blocks 0..6, block 6 holds 8; a rank of 40 rows
    (on the CPU: the checks come before the kernels)."""
    tensors = {name: tensor.cpu() for name, tensor in _inputs(seed=9).items()}
    layout = patterns.causal(SEQ_LEN, q_block=Q_BLOCK, kv_block=KV_BLOCK)
    _, local = _rank_layouts(layout, torch.tensor([0, 6]), 40)
    rows = {name: tensors[name][:, :40] for name in ("q_proxy", "q")}
    lse = torch.zeros(BATCH, HEADS_Q, 40)
    with pytest.raises(error, match=match):
        proxy_kl_loss(rows["q_proxy"], tensors["k_proxy"], rows["q"], tensors["k"], lse, local,
                      softmax_scale=1.0, proxy_softmax_scale=1.0, q_blocks=q_blocks)  # fmt: skip


def test_proxy_kl_loss_rejects_bad_options():
    tensors = _inputs(seed=10)
    layout = patterns.causal(SEQ_LEN, q_block=Q_BLOCK, kv_block=KV_BLOCK, device=DEVICE)
    lse = torch.zeros(BATCH, HEADS_Q, SEQ_LEN, device=DEVICE)
    arguments = (tensors["q_proxy"], tensors["k_proxy"], tensors["q"], tensors["k"], lse, layout)
    scales = dict(softmax_scale=1.0, proxy_softmax_scale=1.0)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'none'"):
        proxy_kl_loss(*arguments, **scales, reduction="none")
    rows = {name: tensors[name][:, :40] for name in ("q_proxy", "q")}
    with pytest.raises(ValueError, match="seq_len_q = 40 .* got 200 and 200: pass the layout"):
        proxy_kl_loss(rows["q_proxy"], tensors["k_proxy"], rows["q"], tensors["k"],
                      lse[:, :, :40], layout, **scales,
                      q_blocks=torch.tensor([0, 6], device=DEVICE))  # fmt: skip


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: {**a, "q_proxy": a["q_proxy"][:, :100]}, ValueError,
         r"q_proxy \[.*\] and q \[.*\] must agree in B and S"),
        (lambda a: {**a, "q": a["q"][:, :, :3]}, ValueError, r"H_q \(3\) a multiple of H_p"),
        (lambda a: {**a, "k": a["k"][:1]}, ValueError, "must agree in B and S"),
        (lambda a: {**a, "lse": a["lse"][..., :-1]}, ValueError, r"lse must be \[B, H_q, S_q\]"),
        (lambda a: {**a, "lse": a["lse"].half()}, TypeError, "lse must be the main attention"),
        (lambda a: {**a, "softmax_scale": None}, ValueError, "softmax_scale must be a positive"),
        (lambda a: {**a, "softmax_scale": -1.0}, ValueError, "softmax_scale must be a positive"),
        (lambda a: {**a, "proxy_softmax_scale": float("nan")}, ValueError,
         "proxy_softmax_scale must be a positive"),
        (lambda a: {**a, "layout": patterns.causal(2 * SEQ_LEN, q_block=Q_BLOCK, kv_block=KV_BLOCK,
                                                   device=DEVICE)},
         ValueError, "layout must have seq_len_q"),
        (lambda a: {**a, "layout": None}, TypeError, "layout must be a BlockLayout"),
        (lambda a: {**a, "layout": a["layout"].to("meta")}, ValueError,
         f"layout is on meta but q on {DEVICE}"),
        (lambda a: {**a, "layout": BlockLayout.from_keys(
            torch.arange(math.ceil(SEQ_LEN / Q_BLOCK) * math.ceil(SEQ_LEN / 8), device=DEVICE),
            seq_len_q=SEQ_LEN, seq_len_kv=SEQ_LEN, q_block=Q_BLOCK, kv_block=8)},
         ValueError, r"layout.kv_block must be one of \(16, 32, 64, 128\), got 8"),
        (lambda a: {**a, "document_ids": torch.zeros(BATCH, SEQ_LEN, device=DEVICE)}, TypeError,
         "document_ids must be int32 or int64"),
    ],
)
def test_proxy_kl_loss_rejects_bad_inputs(change, error, match):
    tensors = _inputs(seed=11)
    layout = patterns.causal(SEQ_LEN, q_block=Q_BLOCK, kv_block=KV_BLOCK, device=DEVICE)
    arguments = dict(q_proxy=tensors["q_proxy"], k_proxy=tensors["k_proxy"], q=tensors["q"],
                     k=tensors["k"], lse=torch.zeros(BATCH, HEADS_Q, SEQ_LEN, device=DEVICE),
                     layout=layout, softmax_scale=1.0, proxy_softmax_scale=1.0)  # fmt: skip
    with pytest.raises(error, match=match):
        proxy_kl_loss(**change(arguments))


SM90_COMPILE = """
import json, sys
from flash_msa.msa import kl
from flash_msa.testing import compile_for_sm90
types = dict(q_proxy="*bf16", k_proxy="*bf16", q="*bf16", k="*bf16", grad_q_proxy="*bf16",
             grad_tiles="*bf16", grad_k_proxy="*fp32", lse="*fp32", grad_scale="*fp32",
             lse_proxy="*fp32", kl_rows="*fp32", query_masks="*i64", t_entries="*i64",
             proxy_scale="fp32", qk_scale_log2="fp32",
             **{name: "*i32" for name in ("documents", "q_blocks", "row_offsets", "col_indices",
                                          "t_row_offsets", "t_col_indices")})
sizes = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, PROXY_DIM=128, PROXY_DIM_PAD=128, KV_BLOCK=128,
             GROUP_PAD=16, HAS_DOCUMENTS=False, HAS_Q_BLOCKS=False, DOT_PRECISION="tf32")
for name, kernel, options in [
    ("rows", kl._kl_rows_kernel, dict(Q_BLOCK=1, HAS_QUERY_MASKS=False, GRAD=True)),
    ("rows", kl._kl_rows_kernel, dict(Q_BLOCK=16, HAS_QUERY_MASKS=True, GRAD=True)),
    ("dk_proxy", kl._kl_dk_proxy_kernel, dict(Q_BLOCK=16, ENTRIES=kl.dk_proxy_entries(16))),
]:
    warps, stages = (function(name, options["Q_BLOCK"]) for function in (kl.num_warps,
                                                                          kl.num_stages))
    constexprs = {key: value for key, value in dict(sizes, **options).items()
                  if key in kernel.arg_names}
    report = compile_for_sm90(kernel, constexprs, types, warps, stages, sys.argv[1],
                              aligned=True)
    print(json.dumps(dict(report, name=f"{name} q_block {options['Q_BLOCK']}")))
"""


def test_kl_kernels_compile_for_hopper(sm90):
    """The interpreter never reaches GPU code generation: compile the per-token KL kernels
    for sm_90 (bf16, D = D_p = 128) at the warps and stages they launch with (rows of one
    token: the broadcast-sum student; 16-row blocks, loads pipelined; dk_proxy's 16-row
    query blocks gathered four to a tile, on tensor cores, loads pipelined)."""
    reports = {report["name"]: report for report in sm90(SM90_COMPILE)}
    assert sorted(reports) == ["dk_proxy q_block 16", "rows q_block 1", "rows q_block 16"]
    assert reports["dk_proxy q_block 16"]["wgmma"]
    assert reports["dk_proxy q_block 16"]["pipelined"] and reports["rows q_block 16"]["pipelined"]


class _KernelNeedingStages:
    """A stand-in for a @triton.jit kernel whose buffers fit shared memory only at `fitting`
    stages or fewer: a launch above raises OutOfResources, as Triton's does before running."""

    def __init__(self, fitting: int):
        self.fn, self.fitting, self.launched = self, fitting, []
        self.__name__ = "needs_stages"

    def __getitem__(self, grid):
        def launch(num_stages, **arguments):
            if num_stages > self.fitting:
                raise OutOfResources(num_stages * 100_000, 232_448, "shared memory")
            self.launched.append((grid, num_stages))

        return launch


def test_kl_launch_takes_fewer_stages_where_the_tiles_do_not_fit(monkeypatch):
    """At D 256 or with fp32 inputs the measured stage counts overflow an H200's shared memory:
    the launch drops stages until it fits, keeps the count for the next call, and raises
    only where even 1 stage does not fit."""
    monkeypatch.setattr(kl, "_STAGES_THAT_FIT", {})
    arguments = dict(q_proxy=torch.empty(1), Q_BLOCK=64, HEAD_DIM_PAD=256, PROXY_DIM_PAD=256)
    kernel = _KernelNeedingStages(fitting=1)
    for _ in range(2):
        kl._launch(kernel, (4, 2), 3, arguments)
    assert kernel.launched == [((4, 2), 1), ((4, 2), 1)]
    assert list(kl._STAGES_THAT_FIT.values()) == [1]
    with pytest.raises(OutOfResources):
        kl._launch(_KernelNeedingStages(fitting=0), (1, 1), 2, arguments)
