"""The Gluon forward's masked path on the CPU: its launch arguments (kernel_masks,
document_bounds), a torch emulation of what its consumers compute per block (the bounds of
_visible_keys, the decision of _partial, the mask of _mask_scores, the online softmax of
_softmax_step with the -inf guard) against the reference masks and attention, and the
backend's refusals."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from flash_msa import _env  # noqa: E402
from flash_msa.ops import registry  # noqa: E402
from flash_msa.ops.gluon import forward  # noqa: E402
from flash_msa.reference import visible  # noqa: E402

HALF, KEYS = forward.HALF_M, forward.BLOCK_N


def random_documents(seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """int32 [S], non-decreasing: runs of 1 to 300 tokens (some of one token)."""
    lengths = []
    while sum(lengths) < seq_len:
        lengths.append(int(torch.randint(1, 300, (1,), generator=generator)))
        if torch.rand(1, generator=generator) < 0.2:
            lengths.append(1)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids[:seq_len].int()


def emulated_mask(seq_len_q, seq_len_kv, causal, window_size, documents) -> torch.Tensor:
    """bool [S_q rounded up to 128, S_kv rounded up to 128]: what the kernel keeps of every
    block (all active) of one batch element, computed as its consumers do: per warpgroup
    of 64 rows the bounds of _visible_keys, per block the test of _partial, in partial
    blocks the compares of _mask_scores; full blocks keep every score."""
    masks, window_left, window_right = forward.kernel_masks(
        causal, window_size, documents is not None, seq_len_q, seq_len_kv
    )
    if documents is not None:
        first, last = (bound[0] for bound in forward.document_bounds(documents[None]))
    rows, columns = forward.padded_length(seq_len_q), forward.padded_length(seq_len_kv)
    kept = torch.ones(rows, columns, dtype=torch.bool)
    for query_first in range(0, rows, HALF):
        queries = query_first + torch.arange(HALF)
        query_last = query_first + HALF - 1
        lower, upper = torch.zeros(HALF, dtype=torch.long), torch.full((HALF,), seq_len_kv - 1)
        lowest, highest = 0, seq_len_kv - 1
        if masks.left:
            lower = torch.maximum(lower, queries - window_left)
            lowest = max(lowest, query_last - window_left)
        if masks.right:
            upper = torch.minimum(upper, queries + window_right)
            highest = min(highest, query_first + window_right)
        if masks.documents:
            tokens = queries.clamp(max=seq_len_kv - 1)
            lower = torch.maximum(lower, first[tokens].long())
            upper = torch.minimum(upper, last[tokens].long())
            lowest = max(lowest, int(first[min(query_last, seq_len_kv - 1)]))
            highest = min(highest, int(last[min(query_first, seq_len_kv - 1)]))
        for key_first in range(0, columns, KEYS):
            partial = (masks.lower and key_first < lowest) or (
                masks.upper and key_first + KEYS - 1 > highest
            )
            if not partial:
                continue
            keys = key_first + torch.arange(KEYS)
            keep = torch.ones(HALF, KEYS, dtype=torch.bool)
            if masks.upper:
                keep &= keys[None, :] <= upper[:, None]
            if masks.lower:
                keep &= keys[None, :] >= lower[:, None]
            kept[query_first : query_first + HALF, key_first : key_first + KEYS] = keep
    return kept


def expected_mask(seq_len_q, seq_len_kv, causal, window_size, documents) -> torch.Tensor:
    """bool [S_q, S_kv rounded up to 128]: reference.visible and one document, keys past S_kv
    (another batch element's rows, or TMA's zeros) never."""
    columns = forward.padded_length(seq_len_kv)
    q_pos, k_pos = torch.arange(seq_len_q)[:, None], torch.arange(columns)[None, :]
    keep = visible(q_pos, k_pos, causal, window_size) & (k_pos < seq_len_kv)
    if documents is not None:
        key_documents = torch.cat([documents, torch.full((columns - seq_len_kv,), -1)])
        keep &= documents[:, None] == key_documents[None, :]
    return keep


CASES = [
    # S_q, S_kv, causal, window_size, documents
    (512, 512, True, (-1, -1), False),  # the causal diagonal
    (1000, 1000, True, (-1, -1), False),  # ragged tails, causal
    (650, 650, True, (-1, -1), False),  # a tail of 10 rows: the lower half is past S_q
    (300, 1000, False, (-1, -1), False),  # only the ragged tails
    (300, 1000, True, (-1, -1), False),  # causal with S_q < S_kv: j <= i
    (1000, 300, True, (-1, -1), False),  # and S_q > S_kv: rows past S_kv see all keys
    (1536, 1536, False, (200, 100), False),  # two window edges
    (777, 777, True, (100, -1), False),  # left edge and the diagonal
    (777, 777, False, (0, 0), False),  # each query sees itself only
    (640, 640, False, (-1, 5), False),  # right edge only
    (700, 700, False, (10**9, 10**9), False),  # windows past the sequence: unbounded
    (900, 900, True, (-1, -1), True),  # documents, causal, ragged
    (1024, 1024, False, (-1, -1), True),  # documents alone
    (833, 833, False, (64, 64), True),  # documents and a window
]


@pytest.mark.parametrize("seq_len_q, seq_len_kv, causal, window_size, with_documents", CASES)
def test_emulated_blocks_keep_what_the_reference_keeps(
    seq_len_q, seq_len_kv, causal, window_size, with_documents
):
    """Over rows before S_q, the kernel's decisions keep exactly the reference's pairs: a
    block it calls full needs no mask, a partial one's compares hide the rest, and the keys
    past S_kv in the last block are hidden."""
    generator = torch.Generator().manual_seed(seq_len_q * 7 + seq_len_kv)
    documents = random_documents(seq_len_q, generator) if with_documents else None
    kept = emulated_mask(seq_len_q, seq_len_kv, causal, window_size, documents)
    expected = expected_mask(seq_len_q, seq_len_kv, causal, window_size, documents)
    mismatches = (kept[:seq_len_q] != expected).nonzero()
    assert mismatches.numel() == 0, f"first mismatches (query, key): {mismatches[:5].tolist()}"


def test_emulated_blocks_on_random_calls():
    generator = torch.Generator().manual_seed(0)

    def side():
        choice = int(torch.randint(4, (1,), generator=generator))
        return (-1, 0, int(torch.randint(1, 400, (1,), generator=generator)), 10**6)[choice]

    for _ in range(40):
        seq_len_q = int(torch.randint(1, 700, (1,), generator=generator))
        same = bool(torch.rand(1, generator=generator) < 0.6)
        seq_len_kv = seq_len_q if same else int(torch.randint(1, 700, (1,), generator=generator))
        causal = bool(torch.rand(1, generator=generator) < 0.5)
        window_size = (side(), side())
        documents = random_documents(seq_len_q, generator) if same else None
        kept = emulated_mask(seq_len_q, seq_len_kv, causal, window_size, documents)
        expected = expected_mask(seq_len_q, seq_len_kv, causal, window_size, documents)
        case = (seq_len_q, seq_len_kv, causal, window_size, documents is not None)
        assert torch.equal(kept[:seq_len_q], expected), case


def test_partial_blocks_are_the_cut_ones():
    """A dense causal layout of whole blocks has one partial block per row (its diagonal),
    for both warpgroups; the rest are full, so they take the fast path's work."""
    masks, _, window_right = forward.kernel_masks(True, (-1, -1), False, 1024, 1024)
    assert masks == forward.Masks(right=True) and window_right == 0
    for query_first in range(0, 1024, HALF):
        highest = query_first + window_right
        partial = [key_first + KEYS - 1 > highest for key_first in range(0, query_first + 1, KEYS)]
        assert partial == [False] * (query_first // KEYS) + [True]


def online_softmax(scores: torch.Tensor, values: torch.Tensor, qk_scale: float, masked: bool):
    """out [M, D], lse [M] (natural log) of scores [M, N] (-inf where masked) in blocks of
    KEYS keys, as the consumers compute them: _softmax_step (block 0 with FIRST), the
    rescale of the accumulator, the division with l = 0 made 1 when masked."""
    m_i = l_i = acc = None
    for first in range(0, scores.shape[1], KEYS):
        s, v = scores[:, first : first + KEYS], values[first : first + KEYS]
        row_max = s.max(dim=1).values * qk_scale
        m_new = row_max if m_i is None else torch.maximum(m_i, row_max)
        shift = torch.where(m_new == float("-inf"), 0.0, m_new) if masked else m_new
        p = torch.exp2(s * qk_scale - shift[:, None])
        if m_i is None:
            l_i, acc = p.sum(dim=1), p @ v
        else:
            alpha = torch.exp2(m_i - shift)
            l_i, acc = l_i * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ v
        m_i = m_new
    if masked:
        l_i = torch.where(l_i == 0.0, 1.0, l_i)
    return acc / l_i[:, None], (m_i + torch.log2(l_i)) * _env.LN_2


def test_emulated_softmax_gives_zero_and_minus_infinity_to_rows_that_see_nothing():
    """Rows masked in their first blocks, rows masked everywhere: out and lse match the
    reference's (0 and -inf where a row sees nothing), no NaN; without the guard a row
    whose first block is all -inf is NaN (why the masked path has it)."""
    generator = torch.Generator().manual_seed(1)
    rows, keys, head_dim, scale = HALF, 3 * KEYS, 16, 0.25
    scores = torch.randn(rows, keys, generator=generator, dtype=torch.float64)
    values = torch.randn(keys, head_dim, generator=generator, dtype=torch.float64)
    keep = torch.rand(rows, keys, generator=generator) < 0.5
    keep[:8, :KEYS] = False  # nothing in block 0
    keep[8:16, : 2 * KEYS] = False  # nothing in blocks 0 and 1
    keep[16:20] = False  # nothing at all
    masked_scores = scores.masked_fill(~keep, float("-inf"))
    out, lse = online_softmax(masked_scores, values, scale * _env.LOG2_E, masked=True)
    expected_lse = torch.logsumexp(masked_scores * scale, dim=1)
    weights = torch.softmax(masked_scores * scale, dim=1).nan_to_num(0.0)
    assert torch.allclose(out, weights @ values, atol=1e-12)
    assert torch.equal(lse[16:20], expected_lse[16:20]) and (lse[16:20] == float("-inf")).all()
    seen = torch.ones(rows, dtype=torch.bool)
    seen[16:20] = False
    assert torch.allclose(lse[seen], expected_lse[seen])
    assert torch.equal(out[16:20], torch.zeros(4, head_dim, dtype=torch.float64))
    unguarded, _ = online_softmax(masked_scores, values, scale * _env.LOG2_E, masked=False)
    assert torch.isnan(unguarded[:8]).all()


def test_kernel_masks():
    """Causal is the right bound 0; a negative side is unbounded; sides past the longer
    sequence are cut to it; tails from lengths that are not multiples of 128."""
    assert forward.kernel_masks(False, (-1, -1), False, 256, 512) == (forward.Masks(), 0, 0)
    masks, left, right = forward.kernel_masks(True, (-1, 7), False, 256, 256)
    assert masks == forward.Masks(right=True) and (left, right) == (0, 0)
    masks, left, right = forward.kernel_masks(False, (3, -1), True, 300, 300)
    assert masks == forward.Masks(left=True, documents=True, kv_tail=True, q_tail=True)
    assert (left, right) == (3, 0)
    assert forward.kernel_masks(False, (10**12, 10**12), False, 256, 1000)[1:] == (1000, 1000)
    assert not forward.Masks().scores and forward.Masks(q_tail=True).scores is False
    assert forward.Masks(kv_tail=True).upper and not forward.Masks(kv_tail=True).lower
    assert forward.Masks(documents=True).lower and forward.Masks(documents=True).upper


def test_document_bounds():
    generator = torch.Generator().manual_seed(2)
    ids = torch.stack([random_documents(1000, generator), random_documents(1000, generator)])
    first, last = forward.document_bounds(ids)
    assert first.dtype == last.dtype == torch.int32 and first.shape == ids.shape
    for row in range(2):
        for position in range(0, 1000, 37):
            same = (ids[row] == ids[row, position]).nonzero().flatten()
            assert (int(first[row, position]), int(last[row, position])) == (
                int(same.min()), int(same.max()),
            )  # fmt: skip


def test_backend_takes_masks_and_any_length(monkeypatch):
    """On an sm_90 device (its capability stubbed) the backend takes causal, windows,
    documents and lengths that are not multiples of 128; it still refuses dropout, other
    layout head counts, other block sizes and B * S past 2^31 with a reason."""
    hopper = {"cuda": (9, 0)}
    monkeypatch.setattr(_env, "capability", lambda device: hopper.get(device.type))
    gluon = registry.get("gluon")
    call = registry.AttentionCall(
        device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=128, q_block=128,
        kv_block=128, dropout=False, documents=True, deterministic=True, element_masks=True,
        seq_len_q=4000, seq_len_kv=4000, batch=2, heads_q=16, heads_kv=4, layout_heads=4,
    )  # fmt: skip
    assert gluon.refusal(call) is None
    for change, reason in (
        (dict(dropout=True), "gluon has no dropout"),
        (dict(layout_heads=2), "gluon takes layout_heads 1, H_kv or H_q, not 2"),
        (dict(kv_block=64), "gluon takes kv_block in (128,), not 64"),
        (dict(batch=2**20), "gluon addresses B * S below 2^31 tokens"),
    ):
        assert gluon.refusal(dataclasses.replace(call, **change)).reason.startswith(reason)
