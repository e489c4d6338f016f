"""Byte-prefix probabilities against brute-force enumeration of a toy byte-pair teacher's
token sequences."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from asyncopd_jax.teacher.byte_prefix import (
    VocabIndex,
    longest_match,
    mean_tree_rows,
    score_prefixes,
    score_prefixes_batch,
    tree_rows,
)

# A byte-pair vocabulary over b'abc': single bytes, merges (one written twice, ids 4 and 5),
# an EOS of no bytes (id 0) and a special whose content is b'a' (id 1, excluded from the index).
VOCAB = [
    b"",
    b"a",
    b"a",
    b"b",
    b"ab",
    b"ab",
    b"c",
    b"abc",
    b"ba",
    b"bca",
    b"ca",
    b"cab",
    b"bb",
    b"aa",
    b"abca",
    b"cc",
    b"bcab",
    b"aab",
    b"bcc",
    b"cba",
]
EOS, SPECIAL = 0, 1
EXCLUDE = (SPECIAL,)
PAD = 3  # the teacher's rows are wider than its vocabulary (a padded embedding): no token
ALPHABET = b"abc"


def toy_teacher(contexts: list[list[int]]) -> np.ndarray:
    """``[n, V + PAD]`` log q of the next token: a softmax of a sine table of the last token,
    the context's length and its sum (the padded columns −inf)."""
    out = np.full((len(contexts), len(VOCAB) + PAD), -np.inf)
    u = np.arange(len(VOCAB))
    for row, ctx in enumerate(contexts):
        last = ctx[-1] if ctx else -1
        wave = 2.0 * np.sin(1.3 * u + 0.7 * last + 0.31 * len(ctx))
        logits = wave + 0.5 * np.cos(0.9 * u * (last + 2) + 0.17 * sum(ctx))
        out[row, : len(VOCAB)] = logits - np.logaddexp.reduce(logits)
    return out


def oracle(context: list[int], target: bytes) -> float:
    """P(the continuation's bytes start with ``target``) by enumerating every teacher token
    sequence until its bytes cover ``target`` or leave it; a token of no bytes (or the
    excluded special) ends the sequence."""

    def walk(ctx: list[int], written: bytes) -> float:
        probs = np.exp(toy_teacher([ctx])[0])
        total = 0.0
        for u, piece in enumerate(VOCAB):
            if not piece or u in EXCLUDE:
                continue
            text = written + piece
            if text.startswith(target):
                total += probs[u]
            elif target.startswith(text):
                total += probs[u] * walk([*ctx, u], text)
        return total

    return walk(list(context), b"")


def longest_match_oracle(context: list[int], candidates: list[bytes | int]) -> tuple[np.ndarray, float]:
    """Each continuation's probability to the longest candidate it starts with (an ``int``
    candidate: the continuation that is that token), else to the tail: sequences enumerated
    until no candidate is still being written."""
    texts = [c for c in candidates if isinstance(c, bytes) and c]
    masses = np.zeros(len(candidates))
    tail = 0.0

    def assign(written: bytes, weight: float, token: int | None) -> None:
        nonlocal tail
        if token is not None and token in candidates:
            masses[candidates.index(token)] += weight
            return
        matches = [c for c in texts if written.startswith(c)]
        if matches:
            masses[candidates.index(max(matches, key=len))] += weight
        else:
            tail += weight

    def walk(ctx: list[int], written: bytes, weight: float) -> None:
        probs = np.exp(toy_teacher([ctx])[0])
        for u, piece in enumerate(VOCAB):
            if not piece or u in EXCLUDE:
                assign(written, weight * probs[u], u if not ctx[len(context) :] else None)
                continue
            text = written + piece
            if any(c.startswith(text) and c != text for c in texts):
                walk([*ctx, u], text, weight * probs[u])
            else:
                assign(text, weight * probs[u], None)

    walk(list(context), b"", 1.0)
    return masses, tail


CONTEXTS = [[], [3], [7, 2], [11, 4, 6], [19, 19, 8, 3]]
CANDIDATES: list[bytes | int] = [
    b"a",
    b"b",
    b"c",
    b"ab",
    b"abc",
    b"abca",
    b"abcab",  # past the longest path of one token
    b"cb",  # no teacher token spells it
    b"bbb",
    b"aaaa",
    b"ccba",
    b"cabc",
    b"bcabca",
    b"d",  # a byte nothing writes
    b"",  # not scored
    EOS,  # a teacher id scored as itself
]


@pytest.fixture(scope="module")
def index() -> VocabIndex:
    return VocabIndex.build(VOCAB, EXCLUDE)


def test_index_ranges_and_prefixes_match_brute_force() -> None:
    pieces = [b"\xff", b"\xff\xff", b"\xfe\xff", b"\xff\x00", b"a", b"ab", b"b", b"\xfe"]
    index = VocabIndex.build(pieces)
    for n in range(1, 4):
        for b in map(bytes, itertools.product([0x00, 0x61, 0x62, 0xFE, 0xFF], repeat=n)):
            lo, hi = index.extending(b)
            assert sorted(index.order[lo:hi].tolist()) == [i for i, p in enumerate(pieces) if p.startswith(b)], b
            got = [(n, sorted(ids.tolist())) for n, ids in index.proper_prefixes(b)]
            want = [(m, [i for i, p in enumerate(pieces) if p == b[:m]]) for m in range(1, len(b))]
            assert got == [w for w in want if w[1]], b


def test_matches_brute_force_enumeration(index: VocabIndex) -> None:
    for context in CONTEXTS:
        logp, rows = score_prefixes(toy_teacher, index, context, CANDIDATES)
        assert logp.shape == (len(CANDIDATES),) and rows == tree_rows(index, CANDIDATES)
        for c, got in zip(CANDIDATES, logp):
            if isinstance(c, int):
                assert got == toy_teacher([context])[0, c]
            elif not c:
                assert got == -np.inf
            else:
                want = oracle(context, c)
                assert abs(np.exp(got) - want) < 1e-12, (context, c)
                if want > 0:
                    assert got == pytest.approx(np.log(want), rel=1e-10, abs=1e-10), (context, c)
                else:
                    assert got == -np.inf, c


def test_batch_is_one_call_per_level_and_equals_each_position(index: VocabIndex) -> None:
    calls: list[int] = []

    def counted(contexts: list[list[int]]) -> np.ndarray:
        calls.append(len(contexts))
        return toy_teacher(contexts)

    rng = np.random.default_rng(0)
    queries = [
        (ctx, [CANDIDATES[i] for i in rng.permutation(len(CANDIDATES))[: 4 + 3 * p]]) for p, ctx in enumerate(CONTEXTS)
    ]
    logp, per_level = score_prefixes_batch(counted, index, queries)
    # every byte is a token: a path of single bytes reaches the longest candidate's last byte
    assert calls == per_level and len(calls) == max(len(c) for _, cs in queries for c in cs if isinstance(c, bytes))
    assert sum(per_level) == sum(tree_rows(index, cands) for _, cands in queries)
    assert logp.shape == (len(queries), max(len(c) for _, c in queries))
    for p, (ctx, cands) in enumerate(queries):
        single, _ = score_prefixes(toy_teacher, index, ctx, cands)
        np.testing.assert_allclose(logp[p, : len(cands)], single, rtol=1e-14, atol=0)
        assert (logp[p, len(cands) :] == -np.inf).all()


def test_every_next_byte_sums_to_one_less_the_specials(index: VocabIndex) -> None:
    for context in CONTEXTS:
        singles = [bytes([b]) for b in ALPHABET]
        logp, _ = score_prefixes(toy_teacher, index, context, singles)
        q = np.exp(toy_teacher([context])[0])
        assert np.exp(logp).sum() == pytest.approx(1.0 - q[EOS] - q[SPECIAL], abs=1e-12)
        assert np.exp(logp).sum() < 1.0 - 1e-3  # the specials do hold mass here


def test_longest_match_is_a_distribution_of_the_longest_candidate(index: VocabIndex) -> None:
    candidates: list[bytes | int] = [b"a", b"ab", b"abc", b"abca", b"b", b"bc", b"cab", b"cb", b"", b"ab", EOS]
    for context in CONTEXTS:
        logp, _ = score_prefixes(toy_teacher, index, context, candidates)
        masses, tail = longest_match(logp, candidates)
        want, want_tail = longest_match_oracle(context, candidates)
        want[candidates.index(b"ab", 2)] = 0.0  # a repeat gets nothing
        np.testing.assert_allclose(np.exp(masses), want, rtol=1e-9, atol=1e-13)
        assert np.exp(tail) == pytest.approx(want_tail, rel=1e-9, abs=1e-13)
        assert np.exp(masses).sum() + np.exp(tail) == pytest.approx(1.0, abs=1e-12)


def test_pruning_loses_at_most_the_pruned_nodes_mass(index: VocabIndex) -> None:
    for context in CONTEXTS:
        exact, rows = score_prefixes(toy_teacher, index, context, CANDIDATES)
        pruned, fewer = score_prefixes(toy_teacher, index, context, CANDIDATES, min_log_weight=-2.5)
        assert fewer < rows
        loss = np.exp(exact) - np.exp(pruned)
        assert (loss >= -1e-15).all() and (loss <= (rows - fewer) * np.exp(-2.5) + 1e-15).all()


def test_rows_counts_and_refusals(index: VocabIndex) -> None:
    assert tree_rows(index, [b""]) == 0 and tree_rows(index, [EOS]) == 1
    assert tree_rows(index, [b"a", b"b"]) == 1  # the root only: every one-byte text is covered there
    # b'abc': the root, [a] (x2 ids: the special is out), [ab] (x2 ids), [a, b]
    assert tree_rows(index, [b"abc"]) == 1 + 1 + 2 + 1
    assert mean_tree_rows(index, [[b"abc"], [b"a"]]) == 3.0 and mean_tree_rows(index, []) == 0.0
    logp, per_level = score_prefixes_batch(toy_teacher, index, [([], [b""]), ([2], [])])
    assert logp.shape == (2, 1) and (logp == -np.inf).all() and per_level == []
    with pytest.raises(ValueError, match="next_logprobs returned shape"):
        score_prefixes(lambda ctxs: np.zeros((len(ctxs), 3)), index, [], [b"a"])
