"""The needle tasks: a haystack of filler tokens with needles (key -> value) inserted at
chosen depths and queries, generated from a seed (RULER's single needle, multi-key and
multi-value needle tasks, over token ids instead of words).

The haystack is a random sequence of phrases: phrase_len random filler tokens each, drawn
with replacement from a pool of random phrases, so that each occurs about phrase_repeats
times (as RULER's noise haystack repeats its sentences). The tokens of a phrase's later
occurrences are predictable from its earlier ones: a small language-model loss on them
teaches the model to copy from earlier context, which it then needs to retrieve needles.

A needle is ``NEEDLE k_1 .. k_K v_1 .. v_V END``; a query is ``QUERY k_1 .. k_K`` then the
answer: the key's value, or for a key of several needles all its values in order of
appearance, each but the last followed by END. Keys, values and filler are drawn from
disjoint token ranges, so a key occurs only in its needles and queries and every answer is
well defined. The model sees the answer tokens teacher-forced; a sample is right when every
answer token is its argmax (what greedy decoding returns: both agree up to the first wrong
token).

Evaluation samples (TASKS) hold a few needles and one query at the end. Training mixes
them with recall samples, which hold one key per `recall_spacing` tokens, each queried at a
random point after its needles: many answers per sequence at every distance, where the
evaluation tasks give one per sequence, however long. Their keys are dense (a needle and its
query take 9 of the 12 tokens per key at the defaults): at the short lengths the training
starts with they are an associative recall drill, mostly needles, queries and answers. The
lookup (an induction head: the query's key finds the needle's value, which follows the same
key, and copies it) starts to be learned there, where the needle's weight under the uniform
attention of a fresh model, 1 / length, is largest; among long filler it barely starts. And
the keys are few (num_keys 64), each recurring in most training batches: with 256 keys, a
small model that answered most single needles after 1000 steps still matched almost no key
among four needles; with 64 it matched most of them by step 600.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

TASKS = ("single", "multikey", "multivalue")
BOS, NEEDLE, END, QUERY = 1, 2, 3, 4  # 0 is never produced
FIRST_FREE_TOKEN = 8  # keys start here; 5 to 7 are kept free
RECALL_SHARE = 0.75  # of the training samples; the rest are evaluation tasks, random depths


class Sample(NamedTuple):
    """One sample: tokens int64 [S]; answer_positions int64 [A], the positions whose next
    token is an answer token, and answers [A], those tokens; repeat_positions [R] and
    repeats [R], the same for the haystack tokens that repeat a phrase seen before."""

    tokens: np.ndarray
    answer_positions: np.ndarray
    answers: np.ndarray
    repeat_positions: np.ndarray
    repeats: np.ndarray


def seed_of(*parts) -> int:
    """A 63-bit seed from any printable parts, the same on every machine and Python."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass(frozen=True)
class NeedleConfig:
    """Token ranges and the shape of each task.

    Attributes:
        num_keys, num_values, num_filler: distinct tokens of each range (a recall sample
            holds at most num_keys keys).
        key_len, value_len: tokens of a key and of one value.
        multikey_needles: needles of the multikey task (1 queried, the others distractors
            with other keys).
        multivalue_values: needles sharing the key of the multivalue task, and of the
            several-needle keys of recall samples.
        recall_spacing: tokens per key in recall samples (its needles, its query and
            filler); at least the 9 of a single needle and its query: keys of several
            needles take more, and a sample holds the keys that fit.
        recall_multivalue: the share of recall keys with multivalue_values needles.
        phrase_len, phrase_repeats: haystack phrases: tokens each, and occurrences of each.
    """

    num_keys: int = 64
    num_values: int = 64
    num_filler: int = 128
    key_len: int = 1
    value_len: int = 2
    multikey_needles: int = 4
    multivalue_values: int = 2
    recall_spacing: int = 12
    recall_multivalue: float = 0.25
    phrase_len: int = 8
    phrase_repeats: int = 4

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "recall_multivalue":
                if not 0.0 <= value <= 1.0:
                    raise ValueError(f"recall_multivalue must be a fraction, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field.name} must be a positive int, got {value!r}")
        if self.num_keys**self.key_len < self.multikey_needles:
            raise ValueError(
                f"num_keys ** key_len = {self.num_keys**self.key_len} distinct keys cannot fill "
                f"{self.multikey_needles} needles with distinct keys"
            )
        if self.num_values**self.value_len < self.multivalue_values:
            raise ValueError(
                f"num_values ** value_len = {self.num_values**self.value_len} cannot give "
                f"{self.multivalue_values} distinct values"
            )
        if self.recall_spacing < self.key_tokens(1):
            raise ValueError(
                f"recall_spacing {self.recall_spacing} cannot hold a key's needle and its "
                f"query ({self.key_tokens(1)} tokens)"
            )

    @property
    def key_start(self) -> int:
        return FIRST_FREE_TOKEN

    @property
    def value_start(self) -> int:
        return self.key_start + self.num_keys

    @property
    def filler_start(self) -> int:
        return self.value_start + self.num_values

    @property
    def vocab_size(self) -> int:
        return self.filler_start + self.num_filler

    @property
    def needle_len(self) -> int:
        return self.key_len + self.value_len + 2

    def query_len(self, values):
        """Tokens of a query and its answer for a key of `values` needles (an int or an
        int array)."""
        return 1 + self.key_len + values * (self.value_len + 1) - 1

    def key_tokens(self, values):
        """Tokens of a key's needles and its query (an int or an int array)."""
        return values * self.needle_len + self.query_len(values)

    def chance(self, task: str) -> float:
        """Exact-match accuracy of guessing every value token uniformly."""
        answer_len = self.value_len * (self.multivalue_values if task == "multivalue" else 1)
        return float(self.num_values) ** -answer_len

    def min_length(self) -> int:
        """The fewest tokens that hold a sample of every task (with no filler)."""
        return 1 + max(
            (self.multikey_needles - 1) * self.needle_len + self.key_tokens(1),
            self.key_tokens(self.multivalue_values),
        )


@dataclass(frozen=True)
class Batch:
    """Samples of one length and what the model must predict.

    tokens: int64 [B, S]. positions: int64 [N], the flat index b * S + i of each position
    whose next token is an answer token; targets: int64 [N], that token; sample: int64 [N],
    its b (exact match groups the answer tokens of a sample). repeat_positions and
    repeat_targets: int64 [R], the same for the haystack's repeated phrase tokens.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    sample: torch.Tensor
    repeat_positions: torch.Tensor
    repeat_targets: torch.Tensor

    def to(self, device) -> Batch:
        return Batch(*(tensor.to(device) for tensor in dataclasses.astuple(self)))


def _distinct_rows(rng: np.random.Generator, count: int, width: int, vocabulary: int, start: int):
    """count distinct rows of width tokens in [start, start + vocabulary), int64 [count, width]."""
    if width == 1:
        return rng.choice(vocabulary, size=(count, 1), replace=False) + start
    while True:
        rows = rng.integers(0, vocabulary, size=(count, width))
        if len({tuple(row) for row in rows}) == count:
            return rows + start


def _values(rng: np.random.Generator, counts: np.ndarray, config: NeedleConfig) -> np.ndarray:
    """counts[i] distinct values for each key i: int64 [keys, max count, value_len] (the
    slots past counts[i] unused)."""
    shape = (len(counts), int(counts.max()), config.value_len)
    values = rng.integers(0, config.num_values, size=shape) + config.value_start
    used = np.arange(shape[1]) < counts[:, None]  # [keys, n]
    while True:  # values of one key must differ (rarely redrawn)
        same = (values[:, :, None] == values[:, None, :]).all(-1)  # [keys, n, n]
        same &= ~np.eye(shape[1], dtype=bool) & used[:, :, None] & used[:, None, :]
        clashing = same.any(axis=(1, 2))
        if not clashing.any():
            return values
        redrawn = (int(clashing.sum()), *shape[1:])
        values[clashing] = rng.integers(0, config.num_values, size=redrawn) + config.value_start


def _haystack(rng: np.random.Generator, size: int, config: NeedleConfig):
    """size filler tokens of random phrases (each about phrase_repeats times), and whether
    each token repeats its phrase's earlier occurrence (a phrase's first token never does:
    the phrases follow each other at random). Returns int64 [size], bool [size]."""
    phrases = max(1, size // (config.phrase_len * config.phrase_repeats))
    pool = rng.integers(0, config.num_filler, size=(phrases, config.phrase_len))
    chosen = rng.integers(0, phrases, size=-(-size // config.phrase_len))
    seen_before = np.ones(len(chosen), dtype=bool)
    seen_before[np.unique(chosen, return_index=True)[1]] = False
    within = np.arange(len(chosen) * config.phrase_len) % config.phrase_len
    repeated = (np.repeat(seen_before, config.phrase_len) & (within > 0))[:size]
    return pool[chosen].ravel()[:size] + config.filler_start, repeated


def _assemble(
    length: int,
    config: NeedleConfig,
    rng: np.random.Generator,
    keys: np.ndarray,
    values: np.ndarray,
    counts: np.ndarray,
    needle_offsets: np.ndarray,
    query_offsets: np.ndarray,
) -> Sample:
    """Filler with the needles and queries placed at filler offsets (the number of filler
    tokens before them); a query follows needles of the same offset.

    keys [n, K], values [n, m, V] and needle_offsets [n, m] of key i's counts[i] needles,
    query_offsets [n]: where each key is queried (-1: it is not). An answer lists its key's
    values in order of appearance.
    """
    slots = needle_offsets.shape[1]
    needle_key, needle_slot = np.nonzero(np.arange(slots) < counts[:, None])  # key-major
    query_key = np.flatnonzero(query_offsets >= 0)
    offset = np.concatenate([needle_offsets[needle_key, needle_slot], query_offsets[query_key]])
    kind = np.repeat([0, 1], [len(needle_key), len(query_key)])  # needle, query
    key = np.concatenate([needle_key, query_key])
    slot = np.concatenate([needle_slot, np.zeros_like(query_key)])
    order = np.lexsort((slot, key, kind, offset))  # order of appearance
    offset, kind, key, slot = offset[order], kind[order], key[order], slot[order]
    query_lens = np.array([config.query_len(int(count)) for count in range(slots + 1)])
    lens = np.where(kind == 0, config.needle_len, query_lens[counts[key]])
    starts = 1 + offset + np.cumsum(lens) - lens

    tokens = np.full(length, -1, dtype=np.int64)
    tokens[0] = BOS
    needles = kind == 0
    content = np.concatenate(
        [np.full((needles.sum(), 1), NEEDLE), keys[key[needles]],
         values[key[needles], slot[needles]], np.full((needles.sum(), 1), END)], axis=1,
    )  # fmt: skip  # [needles, needle_len]
    tokens[starts[needles, None] + np.arange(config.needle_len)] = content
    # A key's values in order of appearance: its needles' slots sorted by position.
    by_key = np.lexsort((np.arange(needles.sum()), key[needles]))
    appearing = np.empty_like(values)
    ranks = np.arange(len(by_key)) - np.searchsorted(key[needles][by_key], key[needles][by_key])
    appearing[key[needles][by_key], ranks] = values[key[needles][by_key], slot[needles][by_key]]
    answer_positions, answers = [], []
    for count in np.unique(counts[key[~needles]]):
        chosen = ~needles & (counts[key] == count)
        answer = np.concatenate(
            [appearing[key[chosen], :count], np.full((chosen.sum(), count, 1), END)], axis=2
        ).reshape(chosen.sum(), -1)[:, :-1]  # v_1 END v_2 ... v_count
        content = np.concatenate([np.full((chosen.sum(), 1), QUERY), keys[key[chosen]], answer], 1)
        positions = starts[chosen, None] + np.arange(content.shape[1])
        tokens[positions] = content
        answer_positions.append(positions[:, config.key_len : -1].ravel())
        answers.append(answer.ravel())
    filler = np.flatnonzero(tokens < 0)
    tokens[filler], repeated = _haystack(rng, len(filler), config)
    # A repeated token is predictable where the token before it is its phrase's too.
    repeated[1:] &= filler[1:] - 1 == filler[:-1]
    repeated[:1] = False
    answer_positions = np.concatenate(answer_positions)
    ordered = np.argsort(answer_positions, kind="stable")
    return Sample(
        tokens, answer_positions[ordered], np.concatenate(answers)[ordered],
        filler[repeated] - 1, tokens[filler[repeated]],
    )  # fmt: skip


def make_sample(
    task: str,
    length: int,
    config: NeedleConfig,
    rng: np.random.Generator,
    *,
    depth: float | None = None,
) -> Sample:
    """One evaluation sample of task, exactly length tokens, its query last.

    Args:
        task: one of TASKS.
        length: tokens of the sample, the query and its answer included.
        config: token ranges and task shapes.
        rng: the numpy Generator every random choice comes from.
        depth: where the queried needle starts, as a fraction of the filler before it
            (0: right after BOS, 1: just before the query); multivalue places all its
            needles there, one after another. None: every needle at a uniform random depth.

    Returns:
        A Sample of length tokens.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be a fraction in [0, 1] (or None: random), got {depth!r}")
    if length < config.min_length():
        raise ValueError(
            f"length {length} cannot hold a {task} sample: it needs at least "
            f"{config.min_length()} tokens"
        )
    count = config.multikey_needles if task == "multikey" else 1
    values_per_key = config.multivalue_values if task == "multivalue" else 1
    keys = _distinct_rows(rng, count, config.key_len, config.num_keys, config.key_start)
    counts = np.full(count, values_per_key)
    values = _values(rng, counts, config)
    needles = count * values_per_key  # one of the two is 1
    filler_len = length - 1 - needles * config.needle_len - config.query_len(values_per_key)
    offsets = rng.integers(0, filler_len + 1, size=(count, values_per_key))
    if depth is not None:
        offsets[0] = round(depth * filler_len)  # key 0 is the one queried
    queries = np.full(count, -1)
    queries[0] = filler_len
    return _assemble(length, config, rng, keys, values, counts, offsets, queries)


def make_recall_sample(length: int, config: NeedleConfig, rng: np.random.Generator) -> Sample:
    """One training sample of many keys: one per config.recall_spacing tokens (at least
    one, at most num_keys, and as many of them as fit), a share recall_multivalue of them
    with multivalue_values needles, each needle at a uniform random point and each key
    queried once, at a uniform random point after its last needle.

    Returns:
        As make_sample.
    """
    count = min(max(1, length // config.recall_spacing), config.num_keys**config.key_len)
    counts = np.where(rng.random(count) < config.recall_multivalue, config.multivalue_values, 1)
    fits = 1 + np.cumsum(config.key_tokens(counts)) <= length  # the keys that fit, a prefix
    if not fits[0]:
        raise ValueError(
            f"length {length} cannot hold a recall sample: its first key needs "
            f"{1 + config.key_tokens(int(counts[0]))} tokens"
        )
    count = int(fits.sum())
    counts = counts[:count]
    keys = _distinct_rows(rng, count, config.key_len, config.num_keys, config.key_start)
    values = _values(rng, counts, config)
    filler_len = length - 1 - int(config.key_tokens(counts).sum())
    offsets = rng.integers(0, filler_len + 1, size=(count, config.multivalue_values))
    last = np.where(np.arange(offsets.shape[1]) < counts[:, None], offsets, 0).max(axis=1)
    queries = last + (rng.random(count) * (filler_len + 1 - last)).astype(np.int64)
    return _assemble(length, config, rng, keys, values, counts, offsets, queries)


def collate(samples: list[Sample]) -> Batch:
    """A Batch on the CPU from samples of one length."""
    length = len(samples[0].tokens)
    for sample in samples:
        if len(sample.tokens) != length:
            raise ValueError(
                f"samples of one batch must share a length: {len(sample.tokens)} != {length}"
            )
    rows = np.arange(len(samples)) * length

    def flat(field: str, offset: bool) -> torch.Tensor:
        parts = [
            getattr(sample, field) + (row if offset else 0)
            for sample, row in zip(samples, rows, strict=True)
        ]
        return torch.from_numpy(np.concatenate(parts).astype(np.int64))

    sample_of = np.repeat(np.arange(len(samples)), [len(s.answers) for s in samples])
    return Batch(
        torch.from_numpy(np.stack([sample.tokens for sample in samples])),
        flat("answer_positions", True), flat("answers", False), torch.from_numpy(sample_of),
        flat("repeat_positions", True), flat("repeats", False),
    )  # fmt: skip


def training_batch(step: int, length: int, batch_size: int, config: NeedleConfig, seed: int):
    """The training batch of a step: batch_size samples of length tokens, each a recall
    sample (RECALL_SHARE of them) or an evaluation task placed as the grid places it, at a
    uniform random depth (a multivalue key's needles one after another); a function of
    (seed, step) alone, so every variant trains on the same data and a resumed run
    continues the same sequence.

    Returns:
        A Batch on the CPU.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    rng = np.random.Generator(np.random.PCG64(seed_of(seed, "train", step)))
    samples = []
    for _ in range(batch_size):
        if rng.random() < RECALL_SHARE:
            samples.append(make_recall_sample(length, config, rng))
        else:
            task = TASKS[int(rng.integers(0, len(TASKS)))]
            samples.append(make_sample(task, length, config, rng, depth=rng.random()))
    return collate(samples)
