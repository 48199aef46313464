"""select_blocks (device top-k into a BlockLayout) against the brute-force reference."""

import math

import pytest
import torch

from flash_msa.msa import block_scores, select_blocks, select_blocks_reference

# (S, q_block, kv_block): equal blocks, q_block < kv_block, q_block > kv_block, ragged tails.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the Triton interpreter
GEOMETRIES = [(256, 32, 32), (200, 64, 128), (130, 128, 64), (77, 16, 32), (16, 16, 16)]


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
def test_select_blocks_matches_reference_with_ties(geometry, top_k):
    seq_len, q_block, kv_block = geometry
    scores = _tied_scores(seq_len, q_block, kv_block, seed=top_k)
    layout = select_blocks(scores, top_k, seq_len=seq_len, q_block=q_block, kv_block=kv_block)
    _check_layout(layout, scores, top_k, seq_len, q_block, kv_block)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_select_blocks_from_kernel_scores(geometry):
    seq_len, q_block, kv_block = geometry
    generator = torch.Generator().manual_seed(seq_len)
    q_proxy = torch.randn(2, seq_len, 4, 16, generator=generator).to(DEVICE)
    k_proxy = torch.randn(2, seq_len, 2, 16, generator=generator).to(DEVICE)
    scores = block_scores(q_proxy, k_proxy, q_block=q_block, kv_block=kv_block)
    layout = select_blocks(scores, 3, seq_len=seq_len, q_block=q_block, kv_block=kv_block)
    _check_layout(layout, scores, 3, seq_len, q_block, kv_block)


def _rows(layout, head=0):
    offsets = layout.row_offsets[head].tolist()
    return [
        layout.col_indices[start:end].tolist()
        for start, end in zip(offsets[:-1], offsets[1:], strict=True)
    ]


def test_select_blocks_orders_floats_exactly():
    """Negative scores, -0.0 tied with +0.0 (the lower index wins, whichever sign it has),
    values one ulp apart, and scores past the diagonal ignored however large."""
    tiny = torch.finfo(torch.float32).tiny
    row = [-1.0, -0.0, 0.0, -3.0, 1.0 + 2**-23, 1.0, -tiny, 5.0]
    scores = torch.tensor(row).repeat(8, 1)[None, None]  # [1, 1, 8, 8]
    past_diagonal = torch.ones(8, 8, dtype=torch.bool).triu(1)
    layout = select_blocks(
        scores.masked_fill(past_diagonal, 1e30), 4, seq_len=128, q_block=16, kv_block=16
    )
    assert _rows(layout) == [
        [0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 4], [1, 2, 4, 5], [1, 4, 5, 6],
        [1, 4, 5, 7],
    ]  # fmt: skip
    expected = select_blocks_reference(scores.masked_fill(past_diagonal, float("-inf")), 4)
    assert torch.equal(layout.to_dense().view(expected.shape), expected)


def test_select_blocks_half_precision_scores():
    scores = _tied_scores(200, 32, 32, seed=5)
    layout = select_blocks(scores.bfloat16(), 3, seq_len=200, q_block=32, kv_block=32)
    _check_layout(layout, scores, 3, 200, 32, 32)


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        (dict(scores=torch.zeros(1, 1, 4, 4, dtype=torch.float64)), TypeError, "float64"),
        (dict(scores=torch.zeros(1, 1, 4, 4).numpy()), TypeError, "ndarray"),
        (dict(scores=torch.zeros(1, 4, 4)), ValueError, r"\[B, H_p, 4, 4\], got \[1, 4, 4\]"),
        (dict(scores=torch.zeros(1, 1, 4, 3)), ValueError, r"got \[1, 1, 4, 3\]"),
        (dict(top_k=0), ValueError, "top_k must be a positive int, got 0"),
        (dict(top_k=2.0), ValueError, "got 2.0"),
        (dict(seq_len=0), ValueError, "seq_len must be a positive int, got 0"),
        (dict(kv_block=48), ValueError, "kv_block must be one of"),
    ],
)
def test_select_blocks_rejects_bad_arguments(arguments, error, match):
    call = dict(scores=torch.zeros(1, 1, 4, 4), top_k=2, seq_len=64, q_block=16, kv_block=16)
    call.update(arguments)
    with pytest.raises(error, match=match):
        select_blocks(
            call["scores"],
            call["top_k"],
            seq_len=call["seq_len"],
            q_block=call["q_block"],
            kv_block=call["kv_block"],
        )


@pytest.mark.gpu
def test_select_blocks_never_synchronises():
    scores = _tied_scores(4096, 64, 128, batch=2, heads=4).cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layout = select_blocks(scores, 16, seq_len=4096, q_block=64, kv_block=128)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _check_layout(layout.to("cpu"), scores.cpu(), 16, 4096, 64, 128)


def test_select_blocks_in_row_chunks(monkeypatch):
    """Ranking a few rows at a time (as at long lengths) gives the same layout."""
    from flash_msa.msa import selection

    scores = _tied_scores(200, 16, 32, seed=11)  # [2, 3, 13, 7]
    monkeypatch.setattr(selection, "CHUNK_ELEMENTS", 2 * 3 * 7 * 4)  # 4 rows per chunk
    layout = select_blocks(scores, 3, seq_len=200, q_block=16, kv_block=32)
    _check_layout(layout, scores, 3, 200, 16, 32)
