"""Every builder against a brute-force construction at small sizes."""

import pytest
import torch

from flash_msa import patterns

SIZES = [(256, 32), (200, 32), (100, 16), (130, 64)]  # (seq_len, block): ragged tails too


def blocks_of(token_mask: torch.Tensor, block: int, kv_block: int | None = None) -> torch.Tensor:
    """bool [S_q, S_kv] token mask -> [1, nq, nk] (blocks of block x kv_block, square when
    kv_block is None): a block is active if any pair in it is."""
    kv_block = block if kv_block is None else kv_block
    seq_q, seq_kv = token_mask.shape
    padded = torch.zeros(
        -(-seq_q // block) * block, -(-seq_kv // kv_block) * kv_block, dtype=torch.bool
    )
    padded[:seq_q, :seq_kv] = token_mask
    grid = padded.view(padded.shape[0] // block, block, padded.shape[1] // kv_block, kv_block)
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


RECTANGLES = [(300, 64, 128), (300, 128, 64), (200, 16, 32), (200, 32, 16), (77, 16, 64)]


def diagonal_of(seq_len, q_block, kv_block):
    """int64 [nq, 1]: the last kv block holding a causal pair of each query block."""
    causal_blocks = blocks_of(torch.ones(seq_len, seq_len).tril().bool(), q_block, kv_block)[0]
    columns = torch.arange(causal_blocks.shape[1])
    return torch.where(causal_blocks, columns, -1).amax(1, keepdim=True)


@pytest.mark.parametrize("seq_len, q_block, kv_block", RECTANGLES)
@pytest.mark.parametrize("causal", [True, False])
def test_rectangular_blocks(seq_len, q_block, kv_block, causal):
    """Every builder with q_block != kv_block against the token masks."""
    blocks = dict(q_block=q_block, kv_block=kv_block)

    def check(layout, token_mask):
        layout._validate()
        assert (layout.q_block, layout.kv_block) == (q_block, kv_block)
        assert torch.equal(layout.to_dense(), blocks_of(token_mask, q_block, kv_block))

    i, j = positions(seq_len)
    check(patterns.causal(seq_len, **blocks), j <= i)
    for window in [0, 1, 40, 64, 500]:
        check(
            patterns.sliding_window(seq_len, window, causal=causal, **blocks),
            window_tokens(seq_len, window, causal),
        )
    for num_global in [0, 1, 70]:
        check(
            patterns.global_tokens(seq_len, num_global, causal=causal, **blocks),
            global_token_mask(seq_len, num_global, causal),
        )
    diagonal = diagonal_of(seq_len, q_block, kv_block)  # [nq, 1]
    for window, dilation in [(64, 1), (100, 2), (256, 3)]:
        layout = patterns.dilated(seq_len, window, dilation, causal=causal, **blocks)
        layout._validate()
        band = blocks_of(window_tokens(seq_len, window, causal), q_block, kv_block)
        columns = torch.arange(band.shape[2])[None, :]
        assert torch.equal(layout.to_dense(), band & ((diagonal - columns) % dilation == 0))
    candidates = blocks_of(j <= i, q_block, kv_block) if causal else torch.ones_like(band)
    for blocks_per_row in [0, 1, 3, 20]:
        layout = patterns.random_blocks(seq_len, blocks_per_row, seed=2, causal=causal, **blocks)
        layout._validate()
        dense = layout.to_dense()
        assert not (dense & ~candidates).any()
        assert torch.equal(dense.sum(2), candidates.sum(2).clamp(max=blocks_per_row))
    sinks = global_token_mask(seq_len, 40, causal)
    bigbird = patterns.bigbird(seq_len, 50, 40, 2, seed=3, causal=causal, **blocks)
    random = patterns.random_blocks(seq_len, 2, seed=3, causal=causal, **blocks)
    expected = blocks_of(window_tokens(seq_len, 50, causal) | sinks, q_block, kv_block)
    assert torch.equal(bigbird.to_dense(), expected | random.to_dense())
    longformer = patterns.longformer(seq_len, 50, 40, causal=causal, **blocks)
    assert torch.equal(longformer.to_dense(), expected)


def test_rectangular_from_dense_mask():
    mask = torch.rand(2, 4, 2, generator=torch.Generator().manual_seed(1)) < 0.5
    layout = patterns.from_dense_mask(mask, seq_len_q=100, q_block=32, kv_block=64)
    assert (layout.q_block, layout.kv_block, layout.layout_heads) == (32, 64, 2)
    assert torch.equal(layout.to_dense(), mask)


def test_counts_past_the_candidates_are_capped():
    """Counts beyond what a row can hold give the capped layout, built as fast."""
    assert torch.equal(
        patterns.random_blocks(1024, 10**5).to_dense(), patterns.random_blocks(1024, 8).to_dense()
    )
    assert torch.equal(
        patterns.random_blocks(1024, 10**5, causal=False, q_block=64, kv_block=128).to_dense(),
        patterns.random_blocks(1024, 8, causal=False, q_block=64, kv_block=128).to_dense(),
    )
    assert torch.equal(
        patterns.bigbird(512, 128, 128, 10**7).to_dense(),
        patterns.bigbird(512, 128, 128, 4).to_dense(),
    )
    for window in [10**30, 2**63]:  # past int64 too
        assert torch.equal(
            patterns.sliding_window(300, window, causal=False, block_size=32).to_dense(),
            patterns.sliding_window(300, 300, causal=False, block_size=32).to_dense(),
        )
        assert torch.equal(
            patterns.global_tokens(300, window, causal=False, block_size=32).to_dense(),
            patterns.global_tokens(300, 300, causal=False, block_size=32).to_dense(),
        )
        assert patterns.dilated(300, 64, window, block_size=32).nnz == 10  # the diagonal only


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
    assert torch.equal(patterns.stack(iter(parts)).to_dense(), stacked.to_dense())
    with pytest.raises(TypeError, match="layouts must be a list .* of BlockLayouts, got BlockLay"):
        patterns.stack(parts[0])


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: patterns.causal(0), ValueError, "seq_len must be a positive int, got 0"),
        (lambda: patterns.sliding_window(64, -1), ValueError, "window must be a non-negative"),
        (lambda: patterns.dilated(64, 32, 0), ValueError, "dilation must be a positive int"),
        (lambda: patterns.random_blocks(64, -2), ValueError, "blocks_per_row must be"),
        (lambda: patterns.causal(64, block_size=100), ValueError, "block_size must be one of"),
        (lambda: patterns.causal(True), ValueError, "seq_len must be a positive int, got True"),
        (lambda: patterns.causal(64.0), ValueError, "seq_len must be a positive int, got 64.0"),
        (lambda: patterns.causal(64, block_size=0), ValueError, "block_size must be .* got 0"),
        (lambda: patterns.causal(64, q_block=64.0), ValueError, "q_block must be .* got 64.0"),
        (lambda: patterns.causal(64, kv_block=True), ValueError, "kv_block must be .* got True"),
        (
            lambda: patterns.causal(64, block_size=0, q_block=32, kv_block=32),
            ValueError,
            "block_size must be one of .* got 0",
        ),
        (lambda: patterns.sliding_window(64, True), ValueError, "window must be .* got True"),
        (lambda: patterns.sliding_window(64, 2.5), ValueError, "window must be .* got 2.5"),
        (lambda: patterns.global_tokens(64, -1), ValueError, "num_global must be .* got -1"),
        (lambda: patterns.dilated(64, 32, 2.0), ValueError, "dilation must be .* got 2.0"),
        (lambda: patterns.random_blocks(64, 1.0), ValueError, "blocks_per_row .* got 1.0"),
        (lambda: patterns.random_blocks(0, 1), ValueError, "seq_len must be .* got 0"),
        (lambda: patterns.random_blocks(64, 1, seed=True), TypeError, "seed must be an int"),
        (lambda: patterns.sliding_window(64, 16, causal="no"), TypeError,
         "causal must be a bool, got 'no'"),
        (lambda: patterns.bigbird(64, 16, 16, 1, causal=None), TypeError,
         "causal must be a bool, got None"),
        (lambda: patterns.dilated(64, 32, 2, causal=1), TypeError, "causal must be a bool"),
        (lambda: patterns.topk(torch.zeros(1, 2, 2), 1, seq_len_q=256, fixed_counts="yes"),
         TypeError, "fixed_counts must be a bool"),
        (lambda: patterns.topk(torch.zeros(1, 2, 2), 1, seq_len_q=256, chunk_elements=1e6),
         ValueError, "chunk_elements must be a positive int"),
        (
            lambda: patterns.documents(torch.tensor([0, 0], dtype=torch.int32)),
            ValueError,
            "positive number of tokens, got 0",
        ),
        (
            lambda: patterns.documents(torch.tensor([], dtype=torch.int32)),
            ValueError,
            "at least 2 entries",
        ),
        (
            lambda: patterns.from_dense_mask(
                torch.ones(0, 2, 2, dtype=torch.bool), seq_len_q=64, block_size=32
            ),
            ValueError,
            r"empty batch or head dimension \(shape \[0, 2, 2\]\)",
        ),
        (
            lambda: patterns.from_dense_mask(
                torch.ones(2, 2, dtype=torch.bool), seq_len_q=64, seq_len_kv=0, block_size=32
            ),
            ValueError,
            "seq_len_kv must be a positive int, got 0",
        ),
    ],
)
def test_builder_argument_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


BUILDERS_WITH_DEVICE = {
    "causal": lambda device: patterns.causal(256, device=device),
    "sliding_window": lambda device: patterns.sliding_window(256, 64, device=device),
    "global_tokens": lambda device: patterns.global_tokens(256, 16, device=device),
    "dilated": lambda device: patterns.dilated(256, 64, 2, device=device),
    "random_blocks": lambda device: patterns.random_blocks(256, 1, device=device),
    "bigbird": lambda device: patterns.bigbird(256, 64, 16, 1, device=device),
    "longformer": lambda device: patterns.longformer(256, 64, 16, device=device),
    "documents": lambda device: patterns.documents(
        torch.tensor([0, 100, 256], dtype=torch.int32), device=device),
    "from_dense_mask": lambda device: patterns.from_dense_mask(
        torch.ones(2, 2, dtype=torch.bool), seq_len_q=256, device=device),
    "topk": lambda device: patterns.topk(torch.zeros(2, 2), 1, seq_len_q=256, device=device),
}  # fmt: skip


@pytest.mark.parametrize("builder", BUILDERS_WITH_DEVICE)
@pytest.mark.parametrize(
    "device, error, match",
    [
        ("gpu", ValueError, "device must name a torch device such as 'cpu' or 'cuda:0', got 'gpu'"),
        ("cuda:63", ValueError, r"device 'cuda:63': this machine has \d+ CUDA device"),
        (2.5, TypeError, "device must be a torch.device, str or int, got 2.5"),
        (63, ValueError, r"device 63: this machine has \d+ CUDA device"),  # an int: CUDA's
    ],
)
def test_builders_name_a_bad_device(builder, device, error, match):
    with pytest.raises(error, match=match):
        BUILDERS_WITH_DEVICE[builder](device)
    assert BUILDERS_WITH_DEVICE[builder]("cpu").row_offsets.device.type == "cpu"


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
@pytest.mark.parametrize("block, kv_block", [(16, 16), (64, 64), (64, 128), (128, 64), (16, 32)])
def test_document_aware_builders(cu_seqlens, causal, block, kv_block):
    cu = torch.tensor(cu_seqlens, dtype=torch.int32)
    blocks = dict(q_block=block, kv_block=kv_block)
    seq_len = cu_seqlens[-1]
    document, start = document_of(cu_seqlens)
    same = document[:, None] == document[None, :]
    i, j = positions(seq_len)
    order = (j <= i) if causal else torch.ones_like(same)

    def check(layout, token_mask):
        layout._validate()
        assert (layout.q_block, layout.kv_block) == (block, kv_block)
        assert torch.equal(layout.to_dense(), blocks_of(token_mask, block, kv_block))

    check(patterns.documents(cu, **blocks), same)
    if causal:
        check(patterns.causal(seq_len, **blocks, cu_seqlens=cu), same & (j <= i))
    window = 40
    check(
        patterns.sliding_window(seq_len, window, causal=causal, **blocks, cu_seqlens=cu),
        same & window_tokens(seq_len, window, causal),
    )
    sinks = same & (j - start[None, :] < 20) & order
    if not causal:
        sinks |= same & (i - start[:, None] < 20)
    check(patterns.global_tokens(seq_len, 20, causal=causal, **blocks, cu_seqlens=cu), sinks)


@pytest.mark.parametrize(
    "seq_len, q_block, kv_block", [(300, 64, 128), (200, 16, 64), (77, 32, 32)]
)
@pytest.mark.parametrize("seed", range(4))
def test_causal_documents_keep_what_msa_keeps(seq_len, q_block, kv_block, seed):
    """MSA's rule for q_block <= kv_block (a query block lies in its diagonal kv block):
    keep c <= d(b) when the document of c's last key is that of b's first query, or c is
    d(b). It is the causal layout over the documents."""
    generator = torch.Generator().manual_seed(seed)
    cuts = torch.randint(0, seq_len, (5,), generator=generator).sort().values.tolist()
    cu = torch.tensor([0, *cuts, seq_len], dtype=torch.int32)
    document, _ = document_of(cu.tolist())
    rows = torch.arange(-(-seq_len // q_block))[:, None]
    cols = torch.arange(-(-seq_len // kv_block))[None, :]
    diagonal = ((rows + 1) * q_block).clamp(max=seq_len).sub(1) // kv_block
    last_key = ((cols + 1) * kv_block).clamp(max=seq_len) - 1
    same = document[last_key] == document[rows * q_block]
    kept = (cols <= diagonal) & (same | (cols == diagonal))
    layout = patterns.causal(seq_len, q_block=q_block, kv_block=kv_block, cu_seqlens=cu)
    assert torch.equal(layout.to_dense()[0], kept)


def test_cu_seqlens_errors():
    with pytest.raises(ValueError, match="must end at the number of packed tokens 300, got 200"):
        patterns.causal(300, cu_seqlens=torch.tensor([0, 200], dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens must be int32, got torch.int64"):
        patterns.documents(torch.tensor([0, 200]))
    with pytest.raises(ValueError, match="non-decreasing: document 1 has length -50"):
        patterns.documents(torch.tensor([0, 100, 50, 200], dtype=torch.int32))
    with pytest.raises(ValueError, match="must start at 0, got 5"):
        patterns.documents(torch.tensor([5, 200], dtype=torch.int32))


def test_builders_refuse_more_blocks_than_int32_offsets_count_before_allocating():
    """causal over 2**20 tokens in blocks of 16 holds 65536 * 65537 / 2 blocks: past int32's
    row_offsets, refused from the geometry (no [nnz] tensor is allocated)."""
    message = "the layout holds 2,147,516,416 active blocks, more than its int32 row_offsets"
    with pytest.raises(ValueError, match=message):
        patterns.causal(2**20, block_size=16)
