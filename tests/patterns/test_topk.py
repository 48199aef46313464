"""patterns.topk against brute force: ties, -inf and NaN, causal diagonals of square and
rectangular blocks, and the fixed-count (MSA) selection against select_blocks_reference."""

import importlib
import json
import math

import pytest
import torch

from flash_msa import patterns
from flash_msa.msa import block_scores, select_blocks_reference
from flash_msa.patterns._build import diagonal_total

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
topk_module = importlib.import_module("flash_msa.patterns.topk")  # patterns.topk: the function


def causal_token_blocks(seq_len, q_block, kv_block):
    """bool [nq, nk]: the blocks holding a token pair j <= i, from the dense token mask."""
    i, j = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]
    num_q_blocks, num_kv_blocks = math.ceil(seq_len / q_block), math.ceil(seq_len / kv_block)
    padded = torch.zeros(num_q_blocks * q_block, num_kv_blocks * kv_block, dtype=torch.bool)
    padded[:seq_len, :seq_len] = j <= i
    return padded.view(num_q_blocks, q_block, num_kv_blocks, kv_block).any(3).any(1)


def brute_topk(scores, k, include_diagonal, causal):
    picked = torch.zeros(scores.shape, dtype=torch.bool)
    for row in range(scores.shape[0]):
        ranked = []
        for col in range(scores.shape[1]):
            score = float(scores[row, col])
            if causal and col > row:
                continue
            if include_diagonal and col == row:
                score = float("inf")
            if score > float("-inf"):
                ranked.append((-score, col))
        for _, col in sorted(ranked)[:k]:
            picked[row, col] = True
    return picked


@pytest.mark.parametrize("k", [1, 2, 5, 12])
@pytest.mark.parametrize("include_diagonal", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_topk_against_brute_force_with_ties(k, include_diagonal, causal):
    generator = torch.Generator().manual_seed(k)
    scores = torch.randint(0, 3, (2, 10, 10), generator=generator).float()  # many ties
    scores[0, 3, :2] = float("-inf")  # never chosen
    layout = patterns.topk(
        scores, k, seq_len_q=300, include_diagonal=include_diagonal, causal=causal, block_size=32
    )
    layout._validate()
    expected = torch.stack([brute_topk(s, k, include_diagonal, causal) for s in scores])
    assert torch.equal(layout.to_dense(), expected)


def test_topk_errors():
    with pytest.raises(ValueError, match="contains NaN"):
        patterns.topk(torch.full((2, 2), float("nan")), 1, seq_len_q=64, block_size=32)
    with pytest.raises(ValueError, match="k must be a positive int, got 0"):
        patterns.topk(torch.zeros(2, 2), 0, seq_len_q=64, block_size=32)
    with pytest.raises(TypeError, match="must be floating point"):
        patterns.topk(torch.zeros(2, 2, dtype=torch.long), 1, seq_len_q=64, block_size=32)


# ---- fixed counts: MSA's selection ------------------------------------------------------
# (S, q_block, kv_block): equal blocks, q_block < kv_block, q_block > kv_block, ragged tails.
GEOMETRIES = [(256, 32, 32), (200, 64, 128), (130, 128, 64), (77, 16, 32), (16, 16, 16)]


def select(scores, top_k, seq_len, q_block, kv_block):
    """MSA's selection: the diagonal plus the top_k - 1 best earlier blocks."""
    return patterns.topk(
        scores, top_k, seq_len_q=seq_len, q_block=q_block, kv_block=kv_block, fixed_counts=True
    )


def _diagonals(seq_len, q_block, kv_block):
    num_q_blocks = math.ceil(seq_len / q_block)
    return [(min((b + 1) * q_block, seq_len) - 1) // kv_block for b in range(num_q_blocks)]


def _tied_scores(seq_len, q_block, kv_block, *, batch=2, heads=3, seed=0):
    """Few distinct values (ties everywhere, some -inf earlier), -inf past each diagonal."""
    generator = torch.Generator().manual_seed(seed)
    grid = (math.ceil(seq_len / q_block), math.ceil(seq_len / kv_block))
    scores = torch.randint(-2, 3, (batch, heads, *grid), generator=generator).float()
    scores[scores == -2] = float("-inf")
    for row, diagonal in enumerate(_diagonals(seq_len, q_block, kv_block)):
        scores[..., row, diagonal] = 0.0
        scores[..., row, diagonal + 1 :] = float("-inf")
    return scores


def _check_layout(layout, scores, top_k, seq_len, q_block, kv_block):
    batch, heads = scores.shape[:2]
    layout._validate()
    assert (layout.layout_batch, layout.layout_heads) == (batch, heads)
    assert (layout.q_block, layout.kv_block, layout.seq_len_q) == (q_block, kv_block, seq_len)
    counts = [min(top_k, d + 1) for d in _diagonals(seq_len, q_block, kv_block)]
    assert layout.row_counts().tolist() == counts * (batch * heads)
    expected = select_blocks_reference(scores, top_k)
    assert torch.equal(layout.to_dense().view(expected.shape), expected)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("top_k", [1, 2, 3, 100])
def test_fixed_counts_match_reference_with_ties(geometry, top_k):
    seq_len, q_block, kv_block = geometry
    scores = _tied_scores(seq_len, q_block, kv_block, seed=top_k)
    layout = select(scores, top_k, seq_len, q_block, kv_block)
    _check_layout(layout, scores, top_k, seq_len, q_block, kv_block)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_fixed_counts_from_kernel_scores(geometry):
    seq_len, q_block, kv_block = geometry
    generator = torch.Generator().manual_seed(seq_len)
    q_proxy = torch.randn(2, seq_len, 4, 16, generator=generator).to(DEVICE)
    k_proxy = torch.randn(2, seq_len, 2, 16, generator=generator).to(DEVICE)
    scores = block_scores(q_proxy, k_proxy, q_block=q_block, kv_block=kv_block)
    layout = select(scores, 3, seq_len, q_block, kv_block)
    _check_layout(layout, scores, 3, seq_len, q_block, kv_block)


def _rows(layout, head=0):
    offsets = layout.row_offsets[head].tolist()
    return [
        layout.col_indices[start:end].tolist()
        for start, end in zip(offsets[:-1], offsets[1:], strict=True)
    ]


def test_fixed_counts_order_floats_exactly():
    """Negative scores, -0.0 tied with +0.0 (the lower index wins, whichever sign it has),
    values one ulp apart, and scores past the diagonal ignored however large."""
    tiny = torch.finfo(torch.float32).tiny
    row = [-1.0, -0.0, 0.0, -3.0, 1.0 + 2**-23, 1.0, -tiny, 5.0]
    scores = torch.tensor(row).repeat(8, 1)[None, None]  # [1, 1, 8, 8]
    past_diagonal = torch.ones(8, 8, dtype=torch.bool).triu(1)
    layout = select(scores.masked_fill(past_diagonal, 1e30), 4, 128, 16, 16)
    assert _rows(layout) == [
        [0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 4], [1, 2, 4, 5], [1, 4, 5, 6],
        [1, 4, 5, 7],
    ]  # fmt: skip
    expected = select_blocks_reference(scores.masked_fill(past_diagonal, float("-inf")), 4)
    assert torch.equal(layout.to_dense().view(expected.shape), expected)


def test_fixed_counts_half_precision_scores():
    scores = _tied_scores(200, 32, 32, seed=5)
    layout = select(scores.bfloat16(), 3, 200, 32, 32)
    _check_layout(layout, scores, 3, 200, 32, 32)


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        (dict(scores=torch.zeros(1, 1, 4, 4, dtype=torch.float64)), TypeError, "float64"),
        (dict(scores=torch.zeros(1, 1, 4, 4).numpy()), TypeError, "ndarray"),
        (dict(scores=torch.zeros(1, 1, 1, 4, 4)), ValueError, r"got shape \[1, 1, 1, 4, 4\]"),
        (dict(scores=torch.zeros(1, 1, 4, 3)), ValueError, r"has \[4, 3\] blocks.* need \[4, 4\]"),
        (dict(top_k=0), ValueError, "k must be a positive int, got 0"),
        (dict(top_k=2.0), ValueError, "got 2.0"),
        (dict(top_k=True), ValueError, "k must be a positive int, got True"),
        (dict(seq_len=0), ValueError, "seq_len_q must be a positive int, got 0"),
        (dict(seq_len=64.0), ValueError, "seq_len_q must be a positive int, got 64.0"),
        (dict(kv_block=48), ValueError, "kv_block must be one of"),
        (dict(q_block=16.0), ValueError, "q_block must be one of .* got 16.0"),
    ],
)
def test_fixed_counts_reject_bad_arguments(arguments, error, match):
    call = dict(scores=torch.zeros(1, 1, 4, 4), top_k=2, seq_len=64, q_block=16, kv_block=16)
    call.update(arguments)
    with pytest.raises(error, match=match):
        select(call["scores"], call["top_k"], call["seq_len"], call["q_block"], call["kv_block"])


@pytest.mark.gpu
def test_fixed_counts_never_synchronise():
    scores = _tied_scores(4096, 64, 128, batch=2, heads=4).cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layout = select(scores, 16, 4096, 64, 128)
        warmup = patterns.causal(4096, q_block=64, kv_block=128, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _check_layout(layout.to("cpu"), scores.cpu(), 16, 4096, 64, 128)
    assert torch.equal(
        warmup.to_dense().cpu(), patterns.causal(4096, q_block=64, kv_block=128).to_dense()
    )


def test_fixed_counts_in_row_chunks():
    """Ranking a few rows at a time (as at long lengths) gives the same layout."""
    scores = _tied_scores(200, 16, 32, seed=11)  # [2, 3, 13, 7]
    chunked = dict(seq_len_q=200, q_block=16, kv_block=32, chunk_elements=2 * 3 * 7 * 4)
    layout = patterns.topk(scores, 3, fixed_counts=True, **chunked)  # 4 rows per chunk
    _check_layout(layout, scores, 3, 200, 16, 32)
    scores[0, 1, 9, 1] = float("nan")  # an earlier block of row 9, in the third chunk
    with pytest.raises(ValueError, match="contains NaN"):
        patterns.topk(scores, 3, **chunked)


def test_fixed_counts_trace_in_one_graph():
    """No host synchronisation and no data-dependent shape: torch.compile(fullgraph=True)
    traces the selection (and the causal warm-up layout) without a graph break."""
    scores = _tied_scores(200, 16, 32, seed=3)

    def build(scores):
        layout = select(scores, 3, 200, 16, 32)
        warmup = patterns.causal(200, q_block=16, kv_block=32, device=scores.device)
        return layout.row_offsets, layout.col_indices, warmup.row_offsets, warmup.col_indices

    traced = torch.compile(build, fullgraph=True, backend="eager")(scores)
    for got, want in zip(traced, build(scores), strict=True):
        assert torch.equal(got, want)


# ---- token-level brute force: any block sizes, both modes ---------------------------------
def brute_selection(scores, k, include_diagonal, candidates, diagonal, fixed_counts):
    """bool [nq, nk]: per row the k best candidates (bool [nq, nk]), ties to the lower index,
    diagonal[row] first with include_diagonal. Without fixed_counts -inf is never chosen;
    with it NaN ranks above every number."""
    picked = torch.zeros(scores.shape, dtype=torch.bool)
    for row in range(scores.shape[0]):
        ranked = []
        for col in candidates[row].nonzero().flatten().tolist():
            score = float(scores[row, col])
            if include_diagonal and col == diagonal[row]:
                ranked.append((0, 0.0, col))
            elif math.isnan(score):
                ranked.append((1, 0.0, col))
            elif fixed_counts or score > float("-inf"):
                ranked.append((2, -score, col))
        for *_, col in sorted(ranked)[:k]:
            picked[row, col] = True
    return picked


# (S, q_block, kv_block): square, both rectangular shapes, ragged tails.
TOKEN_GEOMETRIES = [(300, 64, 128), (300, 128, 64), (200, 16, 32), (200, 32, 16), (130, 32, 32)]


@pytest.mark.parametrize("geometry", TOKEN_GEOMETRIES, ids=str)
@pytest.mark.parametrize("k", [1, 3, 20])
@pytest.mark.parametrize("include_diagonal", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fixed_counts", [True, False])
def test_topk_against_token_masks(geometry, k, include_diagonal, causal, fixed_counts):
    """Candidates are the blocks holding a causal pair j <= i (every block without causal);
    the diagonal of a row is the last of its causal blocks."""
    seq_len, q_block, kv_block = geometry
    causal_blocks = causal_token_blocks(seq_len, q_block, kv_block)  # [nq, nk]
    diagonal = [int(row.nonzero().max()) for row in causal_blocks]
    candidates = causal_blocks if causal else torch.ones_like(causal_blocks)
    generator = torch.Generator().manual_seed(k + seq_len)
    scores = torch.randint(0, 3, (2, *causal_blocks.shape), generator=generator).float()
    scores[scores == 0] = float("-inf")  # ties and -inf everywhere
    if fixed_counts:
        scores[1, 2, :2] = float("nan")  # ranked above every number
    layout = patterns.topk(
        scores, k, seq_len_q=seq_len, include_diagonal=include_diagonal, causal=causal,
        q_block=q_block, kv_block=kv_block, fixed_counts=fixed_counts,
    )  # fmt: skip
    layout._validate()
    expected = torch.stack(
        [
            brute_selection(s, k, include_diagonal, candidates, diagonal, fixed_counts)
            for s in scores
        ]
    )
    assert torch.equal(layout.to_dense(), expected)
    if fixed_counts:
        assert torch.equal(layout.row_counts(), candidates.sum(1).clamp(max=k).repeat(2))


@pytest.mark.parametrize("geometry", TOKEN_GEOMETRIES, ids=str)
def test_fixed_counts_equal_the_free_selection_on_finite_scores(geometry):
    seq_len, q_block, kv_block = geometry
    nq, nk = math.ceil(seq_len / q_block), math.ceil(seq_len / kv_block)
    scores = torch.randn(3, nq, nk, generator=torch.Generator().manual_seed(nq))
    common = dict(seq_len_q=seq_len, q_block=q_block, kv_block=kv_block)
    free = patterns.topk(scores, 4, **common)
    fixed = patterns.topk(scores, 4, **common, fixed_counts=True)
    assert torch.equal(free.row_offsets, fixed.row_offsets)
    assert torch.equal(free.col_indices, fixed.col_indices)


def test_topk_block_size_is_the_square_default():
    scores = torch.randn(2, 7, 7, generator=torch.Generator().manual_seed(0))
    square = patterns.topk(scores, 3, seq_len_q=200, block_size=32)
    explicit = patterns.topk(scores, 3, seq_len_q=200, q_block=32, kv_block=32)
    assert torch.equal(square.to_dense(), explicit.to_dense())
    assert (square.q_block, square.kv_block) == (32, 32)


@pytest.mark.parametrize("q_block", [16, 32, 64, 128])
@pytest.mark.parametrize("kv_block", [16, 32, 64, 128])
def test_diagonal_total_counts_the_rows(q_block, kv_block):
    for seq_len in [1, 15, 16, 17, 100, 128, 129, 255, 256, 300, 1000]:
        meta = dict(seq_len_q=seq_len, seq_len_kv=seq_len, q_block=q_block, kv_block=kv_block)
        for limit in [1, 2, 3, 7, 64, 10**9]:
            expected = sum(min(limit, d + 1) for d in _diagonals(seq_len, q_block, kv_block))
            assert diagonal_total(meta, limit) == expected, (seq_len, limit)


# (S_q, S_kv, q_block, kv_block, top_k, q_blocks): a row longer than the kernel's tile of 1024
# scores, S_q above S_kv (diagonals past the last kv block), a rank's rows, top_k above nk,
# one kv block (one pick a row).
KERNEL_CASES = [
    (256, 256, 32, 32, 3, None),
    (200, 200, 64, 16, 5, None),
    (64, 132_000, 32, 128, 16, None),
    (520, 260, 64, 32, 4, None),
    (333, 333, 32, 64, 2, [0, 8, 3, 10]),
    (77, 77, 16, 32, 100, None),
    (40, 40, 16, 64, 3, None),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
@pytest.mark.parametrize("causal, include_diagonal", [(True, True), (True, False), (False, True),
                                                      (False, False)])  # fmt: skip
def test_fixed_counts_ranked_in_kernel_equal_torch(case, causal, include_diagonal, monkeypatch):
    """_top_blocks_kernel (on the CPU too, interpreted) makes the layout torch.topk's ranking
    makes, bit for bit: ties, -inf, +inf, NaN, -0.0 beside 0.0, bfloat16."""
    seq_len_q, seq_len_kv, q_block, kv_block, top_k, q_blocks = case
    rows = math.ceil(seq_len_q / q_block) if q_blocks is None else len(q_blocks)
    grid = (rows, math.ceil(seq_len_kv / kv_block))
    generator = torch.Generator().manual_seed(sum(grid))
    scores = torch.randint(-2, 3, (1, 2, *grid), generator=generator).float() / 2  # ties
    # Head 1's rows: +inf and NaN in columns 0 and 1 (in turns: NaN ranks above +inf), -0.0
    # (tied with 0.0) and -inf in 2 and 3.
    specials = torch.tensor([[float("inf"), float("nan"), -0.0, float("-inf")],
                             [float("nan"), float("inf"), -0.0, float("-inf")]])  # fmt: skip
    columns = min(4, grid[1])
    scores[0, 1, :, :columns] = specials[torch.arange(grid[0]) % 2, :columns]
    if q_blocks is not None:  # a rank's rows: the global blocks' own rows
        seq_len_q = sum(min(q_block, seq_len_kv - block * q_block) for block in q_blocks)
        q_blocks = torch.tensor(q_blocks, device=DEVICE)
    options = dict(seq_len_q=seq_len_q, seq_len_kv=seq_len_kv, q_block=q_block,
                   kv_block=kv_block, causal=causal, include_diagonal=include_diagonal,
                   fixed_counts=True, q_blocks=q_blocks)  # fmt: skip
    layouts = []
    for dtype in (torch.float32, torch.bfloat16):
        for kernel in (False, True):
            monkeypatch.setattr(topk_module, "_rank_in_kernel", lambda *_, kernel=kernel: kernel)
            layouts.append(patterns.topk(scores.to(DEVICE, dtype), top_k, **options))
    for torch_layout, kernel_layout in (layouts[:2], layouts[2:]):
        assert torch.equal(kernel_layout.row_offsets, torch_layout.row_offsets)
        assert torch.equal(kernel_layout.col_indices, torch_layout.col_indices)


# ---- a rank's query blocks (context parallelism) -----------------------------------------
# (S, q_block, kv_block, q_blocks): ragged global ends, q_block below, equal to and above
# kv_block; head-tail chunks, a subset without the last block, one in any order.
RANK_CASES = [
    (333, 32, 64, [0, 1, 2, 8, 9, 10]),
    (333, 16, 32, [1, 4, 5, 11, 12, 17, 20]),
    (300, 32, 32, [0, 2, 3, 6]),
    (400, 64, 32, [5, 0, 3, 6]),
]


@pytest.mark.parametrize("case", RANK_CASES, ids=str)
@pytest.mark.parametrize("causal, include_diagonal", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("fixed_counts", [True, False])
def test_topk_of_query_blocks_equal_the_global_rows(case, causal, include_diagonal, fixed_counts):
    """Scores of a rank's rows (seq_len_q local, seq_len_kv global) select the whole
    sequence's rows of those blocks, for every mode."""
    seq_len, q_block, kv_block, q_blocks = case
    q_blocks = torch.tensor(q_blocks)
    grid = (math.ceil(seq_len / q_block), math.ceil(seq_len / kv_block))
    generator = torch.Generator().manual_seed(len(q_blocks))
    scores = torch.randint(-1, 3, (2, 3, *grid), generator=generator).float()
    scores[scores == -1] = float("-inf")  # ties and -inf everywhere
    common = dict(include_diagonal=include_diagonal, causal=causal, q_block=q_block,
                  kv_block=kv_block, fixed_counts=fixed_counts)  # fmt: skip
    whole = patterns.topk(scores, 3, seq_len_q=seq_len, **common)
    local_len = sum(min(q_block, seq_len - b * q_block) for b in q_blocks.tolist())
    layout = patterns.topk(scores[:, :, q_blocks], 3, seq_len_q=local_len, seq_len_kv=seq_len,
                           q_blocks=q_blocks, **common)  # fmt: skip
    layout._validate()
    sizes = (layout.seq_len_q, layout.seq_len_kv, layout.num_q_blocks)
    assert sizes == (local_len, seq_len, len(q_blocks))
    assert torch.equal(layout.to_dense(), whole.to_dense()[:, q_blocks])


@pytest.mark.parametrize(
    "q_blocks, error, match",
    [
        (torch.tensor([0.0, 9.0]), TypeError, "integer block indices, got torch.float32"),
        (torch.tensor([0, 9], device="meta"), ValueError, "q_blocks is on meta but the"),
        (torch.tensor([0, 4, 9]), ValueError, r"2 for 44 local rows .* got shape \[3\]"),
        (torch.tensor([0, 10]), ValueError, r"lie in \[0, 10\) .* from 0 to 10"),
        (torch.tensor([0, 8]), ValueError, "block 1 holds 12 rows but global query block 8"),
    ],
)
def test_topk_rejects_bad_query_blocks(q_blocks, error, match):
    """300 tokens in blocks of 32: global blocks 0..9, block 9 holds 12; a rank of 44 rows."""
    scores = torch.zeros(1, 1, 2, 5)
    with pytest.raises(error, match=match):
        patterns.topk(scores, 2, seq_len_q=44, seq_len_kv=300, q_block=32, kv_block=64,
                      fixed_counts=True, q_blocks=q_blocks)  # fmt: skip


# Compiles _top_blocks_kernel for sm_90 at the (PICKS, TILE) of each [picks, num_kv_blocks]
# of argv[2] (kernel_tiles) and prints one JSON report per launch.
SM90_COMPILE = """
import importlib, json, sys
from flash_msa.testing import compile_for_sm90

topk_module = importlib.import_module("flash_msa.patterns.topk")
types = dict(scores="*fp32", diagonal="*i64", chosen="*i64")
for picks, num_kv_blocks in json.loads(sys.argv[2]):
    slots, tile = topk_module.kernel_tiles(picks, num_kv_blocks)
    constexprs = dict(PICKS=slots, TILE=tile, CAUSAL=True, INCLUDE_DIAGONAL=True)
    print(json.dumps(compile_for_sm90(topk_module._top_blocks_kernel, constexprs, types, 4, 3,
                                      sys.argv[1])))
"""


def test_top_blocks_kernel_compiles_for_hopper(sm90):
    """The interpreter never reaches GPU code generation: the launches _top_blocks makes
    compile for sm_90, one block a row (where tl.topk of one element would not compile) and
    rows of one to thousands of blocks included; MSA's top-16 without spills."""
    launches = [[1, 1], [1, 2], [3, 2], [15, 3], [16, 512], [16, 8192], [64, 64], [64, 8192]]
    reports = sm90(SM90_COMPILE, json.dumps(launches))
    assert len(reports) == len(launches)
    for (picks, _), report in zip(launches, reports, strict=True):
        assert picks > 16 or report["spills"] == 0, report
