"""Every builder against a brute-force construction at small sizes."""

import pytest
import torch

from flash_msa import patterns

SIZES = [(256, 32), (200, 32), (100, 16), (130, 64)]  # (seq_len, block): ragged tails too


def blocks_of(token_mask: torch.Tensor, block: int) -> torch.Tensor:
    """bool [S_q, S_kv] token mask -> [1, nq, nk]: a block is active if any pair in it is."""
    seq_q, seq_kv = token_mask.shape
    padded = torch.zeros(-(-seq_q // block) * block, -(-seq_kv // block) * block, dtype=torch.bool)
    padded[:seq_q, :seq_kv] = token_mask
    grid = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block)
    return grid.any(dim=3).any(dim=1)[None]


def positions(seq_len):
    return torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]


def window_tokens(seq_len, window, causal):
    i, j = positions(seq_len)
    return (j >= i - window) & ((j <= i) if causal else (j <= i + window))


def global_token_mask(seq_len, num_global, causal):
    i, j = positions(seq_len)
    sinks = (j < num_global) & ((j <= i) if causal else True)
    return sinks if causal else sinks | (i < num_global)


@pytest.mark.parametrize("seq_len, block", SIZES)
def test_causal(seq_len, block):
    i, j = positions(seq_len)
    layout = patterns.causal(seq_len, block_size=block)
    layout._validate()
    assert torch.equal(layout.to_dense(), blocks_of(j <= i, block))


@pytest.mark.parametrize("seq_len, block", SIZES)
@pytest.mark.parametrize("window", [0, 1, 40, 64, 500])
@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window(seq_len, block, window, causal):
    layout = patterns.sliding_window(seq_len, window, causal=causal, block_size=block)
    layout._validate()
    assert torch.equal(layout.to_dense(), blocks_of(window_tokens(seq_len, window, causal), block))


@pytest.mark.parametrize("seq_len, block", SIZES)
@pytest.mark.parametrize("num_global", [0, 1, 32, 70])
@pytest.mark.parametrize("causal", [True, False])
def test_global_tokens(seq_len, block, num_global, causal):
    layout = patterns.global_tokens(seq_len, num_global, causal=causal, block_size=block)
    layout._validate()
    expected = blocks_of(global_token_mask(seq_len, num_global, causal), block)
    assert torch.equal(layout.to_dense(), expected)


@pytest.mark.parametrize("seq_len, block", SIZES)
@pytest.mark.parametrize("window, dilation", [(64, 1), (100, 2), (256, 3)])
@pytest.mark.parametrize("causal", [True, False])
def test_dilated(seq_len, block, window, dilation, causal):
    layout = patterns.dilated(seq_len, window, dilation, causal=causal, block_size=block)
    layout._validate()
    band = blocks_of(window_tokens(seq_len, window, causal), block)
    rows, cols = torch.meshgrid(
        torch.arange(band.shape[1]), torch.arange(band.shape[2]), indexing="ij"
    )
    assert torch.equal(layout.to_dense(), band & ((rows - cols) % dilation == 0))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("blocks_per_row", [0, 1, 3, 20])
def test_random_blocks_counts_range_and_seed(causal, blocks_per_row):
    layout = patterns.random_blocks(200, blocks_per_row, seed=7, causal=causal, block_size=16)
    layout._validate()  # sorted and unique within each row
    dense = layout.to_dense()[0]
    rows = torch.arange(dense.shape[0])
    available = rows + 1 if causal else torch.full_like(rows, dense.shape[1])
    assert torch.equal(dense.sum(1), available.clamp(max=blocks_per_row))
    if causal:
        assert not dense.triu(1).any()
    again = patterns.random_blocks(200, blocks_per_row, seed=7, causal=causal, block_size=16)
    assert torch.equal(again.to_dense()[0], dense)


def test_random_blocks_differ_by_seed_and_are_uniform():
    draws = torch.stack(
        [
            patterns.random_blocks(128, 2, seed=seed, causal=False, block_size=16).to_dense()[0]
            for seed in range(400)
        ]
    ).float()  # [seeds, 8, 8]
    assert not torch.equal(draws[0], draws[1])
    frequency = draws.mean(0)  # each of 8 blocks is chosen with probability 2 / 8
    assert torch.allclose(frequency, torch.full_like(frequency, 0.25), atol=0.08)


@pytest.mark.parametrize("causal", [True, False])
def test_longformer_and_bigbird_are_unions(causal):
    seq_len, block = 300, 32
    window, sinks = window_tokens(seq_len, 50, causal), global_token_mask(seq_len, 40, causal)
    longformer = patterns.longformer(seq_len, 50, 40, causal=causal, block_size=block)
    assert torch.equal(longformer.to_dense(), blocks_of(window | sinks, block))
    random = patterns.random_blocks(seq_len, 2, seed=3, causal=causal, block_size=block)
    bigbird = patterns.bigbird(seq_len, 50, 40, 2, seed=3, causal=causal, block_size=block)
    bigbird._validate()
    assert torch.equal(bigbird.to_dense(), blocks_of(window | sinks, block) | random.to_dense())


@pytest.mark.parametrize("shape", [(4, 3), (2, 4, 3), (2, 3, 4, 3)])
def test_from_dense_mask(shape):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(0)) < 0.5
    layout = patterns.from_dense_mask(mask, seq_len_q=100, seq_len_kv=70, block_size=32)
    layout._validate()
    leading = (1,) * (4 - len(shape)) + shape[:-2]
    assert (layout.layout_batch, layout.layout_heads) == leading[-2:]
    assert torch.equal(layout.to_dense(), mask.reshape(-1, 4, 3))


def test_from_dense_mask_errors():
    with pytest.raises(ValueError, match=r"has \[4, 3\] blocks, but .* need \[4, 4\]"):
        patterns.from_dense_mask(torch.ones(4, 3, dtype=torch.bool), seq_len_q=100, block_size=32)
    with pytest.raises(TypeError, match="block_mask must be bool, got torch.int64"):
        patterns.from_dense_mask(torch.ones(4, 4, dtype=torch.long), seq_len_q=100, block_size=32)
    with pytest.raises(ValueError, match=r"must be \[nq, nk\].* got shape \[4\]"):
        patterns.from_dense_mask(torch.ones(4, dtype=torch.bool), seq_len_q=100, block_size=32)


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


def test_stack_gives_one_layout_head_each():
    parts = [patterns.causal(100, block_size=16), patterns.sliding_window(100, 20, block_size=16)]
    stacked = patterns.stack(parts)
    stacked._validate()
    assert stacked.layout_heads == 2
    assert torch.equal(stacked.to_dense(), torch.cat([p.to_dense() for p in parts]))
    with pytest.raises(ValueError, match=r"layouts\[1\].seq_len_q = 120 differs"):
        patterns.stack([parts[0], patterns.causal(120, block_size=16)])
    with pytest.raises(ValueError, match="already has 2 layout heads"):
        patterns.stack([stacked])


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: patterns.causal(0), ValueError, "seq_len must be a positive int, got 0"),
        (lambda: patterns.sliding_window(64, -1), ValueError, "window must be a non-negative"),
        (lambda: patterns.dilated(64, 32, 0), ValueError, "dilation must be a positive int"),
        (lambda: patterns.random_blocks(64, -2), ValueError, "blocks_per_row must be"),
        (lambda: patterns.causal(64, block_size=100), ValueError, "q_block must be one of"),
    ],
)
def test_builder_argument_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_builders_are_memory_linear_at_a_million_tokens():
    layout = patterns.sliding_window(1 << 20, 4096) | patterns.global_tokens(1 << 20, 128)
    assert layout.nnz == 8192 * 34 - sum(range(1, 34))  # 34 per row once the window is full
    metadata = layout.row_offsets.numel() * 4 + layout.col_indices.numel() * 4
    assert metadata < 1.2 * 2**20


DOCUMENTS = [
    [0, 300],
    [0, 100, 100, 130, 131, 300],  # an empty and a one-token document
    [0, 1, 2, 64, 200, 300],
]


def document_of(cu_seqlens):
    bounds = torch.tensor(cu_seqlens)
    positions = torch.arange(cu_seqlens[-1])
    document = torch.searchsorted(bounds, positions, right=True) - 1
    return document, bounds[document]  # document id and document start of each token


@pytest.mark.parametrize("cu_seqlens", DOCUMENTS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block", [16, 64])
def test_document_aware_builders(cu_seqlens, causal, block):
    cu = torch.tensor(cu_seqlens, dtype=torch.int32)
    seq_len = cu_seqlens[-1]
    document, start = document_of(cu_seqlens)
    same = document[:, None] == document[None, :]
    i, j = positions(seq_len)
    order = (j <= i) if causal else torch.ones_like(same)

    def check(layout, token_mask):
        layout._validate()
        assert torch.equal(layout.to_dense(), blocks_of(token_mask, block))

    check(patterns.documents(cu, block_size=block), same)
    if causal:
        check(patterns.causal(seq_len, block_size=block, cu_seqlens=cu), same & (j <= i))
    window = 40
    check(
        patterns.sliding_window(seq_len, window, causal=causal, block_size=block, cu_seqlens=cu),
        same & window_tokens(seq_len, window, causal),
    )
    sinks = same & (j - start[None, :] < 20) & order
    if not causal:
        sinks |= same & (i - start[:, None] < 20)
    check(
        patterns.global_tokens(seq_len, 20, causal=causal, block_size=block, cu_seqlens=cu),
        sinks,
    )


def test_cu_seqlens_errors():
    with pytest.raises(ValueError, match="must end at the number of packed tokens 300, got 200"):
        patterns.causal(300, cu_seqlens=torch.tensor([0, 200], dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens must be int32, got torch.int64"):
        patterns.documents(torch.tensor([0, 200]))
    with pytest.raises(ValueError, match="non-decreasing: document 1 has length -50"):
        patterns.documents(torch.tensor([0, 100, 50, 200], dtype=torch.int32))
    with pytest.raises(ValueError, match="must start at 0, got 5"):
        patterns.documents(torch.tensor([5, 200], dtype=torch.int32))
