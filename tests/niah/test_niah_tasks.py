"""The needle tasks: deterministic per seed, well formed, needles where asked, answers right."""

import numpy as np
import pytest
import torch

from flash_msa.niah.tasks import (
    BOS,
    END,
    NEEDLE,
    QUERY,
    TASKS,
    NeedleConfig,
    collate,
    make_recall_sample,
    make_sample,
    training_batch,
)

CONFIG = NeedleConfig()


def parse(tokens: list[int], config: NeedleConfig):
    """Read a sample back: the needles (start, key, value) in order, and the positions and
    tokens each query's answer must be, from its key's values in order of appearance."""
    assert tokens[0] == BOS
    needles, by_key, positions, answers = [], {}, [], []
    index = 1
    while index < len(tokens):
        token = tokens[index]
        key = tuple(tokens[index + 1 : index + 1 + config.key_len])
        if token == NEEDLE:
            value = tokens[index + 1 + config.key_len : index + config.needle_len - 1]
            assert tokens[index + config.needle_len - 1] == END
            needles.append((index, key, value))
            by_key.setdefault(key, []).append(value)
            index += config.needle_len
        elif token == QUERY:
            answer = []
            for number, value in enumerate(by_key.pop(key)):  # each key is queried once
                answer += ([END] if number else []) + value
            first = index + 1 + config.key_len
            assert tokens[first : first + len(answer)] == answer
            positions += range(first - 1, first - 1 + len(answer))
            answers += answer
            index = first + len(answer)
        else:
            assert config.filler_start <= token < config.vocab_size  # filler only
            index += 1
    return needles, positions, answers


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [64, 300, 4096])
def test_samples_are_well_formed_with_the_needle_at_its_depth(task, length):
    rng = np.random.Generator(np.random.PCG64(0))
    for depth in (0.0, 0.3, 1.0, None):
        sample = make_sample(task, length, CONFIG, rng, depth=depth)
        tokens, positions = sample.tokens, sample.answer_positions.tolist()
        answers = sample.answers.tolist()
        assert tokens.dtype == np.int64 and tokens.shape == (length,)
        needles, expected_positions, expected_answers = parse(tokens.tolist(), CONFIG)
        assert (positions, answers) == (expected_positions, expected_answers)
        assert positions[-1] == length - 2  # the query ends the sample
        count = {"single": 1, "multikey": CONFIG.multikey_needles}.get(
            task, CONFIG.multivalue_values
        )
        assert len(needles) == count
        assert len(answers) == CONFIG.value_len * (count if task == "multivalue" else 1) + (
            count - 1 if task == "multivalue" else 0
        )
        if depth is None:
            continue
        filler = length - 1 - count * CONFIG.needle_len - len(answers) - 1 - CONFIG.key_len
        queried = tuple(tokens[length - len(answers) - CONFIG.key_len : length - len(answers)])
        start = next(start for start, key, _ in needles if key == queried)
        # The needle starts depth of the filler in, after any needles placed before it.
        assert abs(start - (1 + depth * filler)) <= count * CONFIG.needle_len


@pytest.mark.parametrize(
    "config, length, keys",
    [
        (CONFIG, 128, (8, 10)),  # 10 keys asked, those of two needles may leave no room
        (CONFIG, 1000, (64, 64)),  # every key
        (CONFIG, 8192, (64, 64)),
        (NeedleConfig(recall_spacing=9, recall_multivalue=1.0), 180, (10, 10)),  # 17 each
    ],
)
def test_recall_samples_query_every_key_after_its_needles(config, length, keys):
    rng = np.random.Generator(np.random.PCG64(1))
    for _ in range(4):
        sample = make_recall_sample(length, config, rng)
        tokens = sample.tokens
        assert tokens.shape == (length,)
        needles, expected_positions, expected_answers = parse(tokens.tolist(), config)
        assert sample.answer_positions.tolist() == expected_positions
        assert sample.answers.tolist() == expected_answers
        queried = {key for _, key, _ in needles}
        assert keys[0] <= len(queried) <= keys[1]
        assert (tokens == QUERY).sum() == len(queried)


def test_the_haystack_repeats_phrases_and_marks_their_predictable_tokens():
    rng = np.random.Generator(np.random.PCG64(2))
    sample = make_sample("single", 4096, CONFIG, rng)
    tokens, positions = sample.tokens, sample.repeat_positions
    assert np.array_equal(tokens[positions + 1], sample.repeats)
    is_filler = tokens >= CONFIG.filler_start
    assert is_filler[positions].all() and is_filler[positions + 1].all()
    filler = is_filler.sum()
    expected = (1 - 1 / CONFIG.phrase_repeats) * (1 - 1 / CONFIG.phrase_len)
    assert abs(len(positions) / filler - expected) < 0.1
    # A predictable token continues a bigram seen earlier (but where a needle split it).
    earlier = [
        any((tokens[j], tokens[j + 1]) == (tokens[p], tokens[p + 1]) for j in range(p))
        for p in positions[:200].tolist()
    ]
    assert np.mean(earlier) > 0.95


def test_generation_is_deterministic_per_seed():
    first = training_batch(7, 512, 4, CONFIG, seed=3)
    again = training_batch(7, 512, 4, CONFIG, seed=3)
    for field in ("tokens", "positions", "targets", "sample"):
        assert torch.equal(getattr(first, field), getattr(again, field))
    assert not torch.equal(first.tokens, training_batch(8, 512, 4, CONFIG, seed=3).tokens)
    assert not torch.equal(first.tokens, training_batch(7, 512, 4, CONFIG, seed=4).tokens)
    assert first.tokens.shape == (4, 512) and first.tokens.dtype == torch.int64
    flat = first.tokens.flatten()
    # Each answer token follows its position, in its own sample's row.
    assert torch.equal(flat[first.positions + 1], first.targets)
    assert torch.equal(first.positions // 512, first.sample)
    assert torch.equal(flat[first.repeat_positions + 1], first.repeat_targets)
    assert len(first.repeat_positions) > 0 and len(first.positions) > 0


def test_token_ranges_are_disjoint_and_chance_is_uniform_guessing():
    assert CONFIG.key_start + CONFIG.num_keys == CONFIG.value_start
    assert CONFIG.value_start + CONFIG.num_values == CONFIG.filler_start
    assert CONFIG.vocab_size == CONFIG.filler_start + CONFIG.num_filler
    assert CONFIG.chance("single") == CONFIG.chance("multikey") == 64.0**-2
    assert CONFIG.chance("multivalue") == 64.0**-4


def test_collate_refuses_mixed_lengths():
    rng = np.random.Generator(np.random.PCG64(0))
    samples = [make_sample("single", length, CONFIG, rng) for length in (64, 65)]
    with pytest.raises(ValueError, match="share a length"):
        collate(samples)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda rng: make_sample("needle", 64, CONFIG, rng), "task must be one of"),
        (lambda rng: make_sample("single", 64, CONFIG, rng, depth=1.5), "depth must be"),
        (lambda rng: make_sample("multikey", 16, CONFIG, rng), "needs at least"),
        (lambda rng: NeedleConfig(key_len=0), "key_len must be a positive int"),
        (lambda rng: NeedleConfig(num_keys=2, multikey_needles=4), "distinct keys"),
        (lambda rng: NeedleConfig(recall_spacing=8), "recall_spacing 8 cannot hold"),
        (lambda rng: NeedleConfig(recall_multivalue=2.0), "recall_multivalue must be"),
        (lambda rng: NeedleConfig(phrase_len=0), "phrase_len must be a positive int"),
        (lambda rng: training_batch(0, 256, 0, CONFIG, 0), "batch_size must be a positive int"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call(np.random.Generator(np.random.PCG64(0)))
