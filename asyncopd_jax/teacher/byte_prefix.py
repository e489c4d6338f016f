"""A teacher of another tokenizer scored on the student's own tokens: byte-prefix probabilities.

Exact-text mapping (:mod:`asyncopd_jax.teacher.cross_tokenizer`) gives a student token the
teacher's probability of *one teacher token of exactly its text*, so every student token
whose text no single teacher token spells — most multi-character ones — lands in the tail.
Here a student candidate ``c`` (e.g. one of the student's top-K ids at a position) gets
instead the teacher's probability that its continuation's bytes **start with** ``c``'s
bytes, summed over every teacher token sequence that writes them.

The math. The teacher is conditioned on a context ``ctx`` that ends exactly at the student's
token boundary. For a non-empty byte string ``b``::

    P(b | ctx) =  Σ_{u : bytes(u) starts with b}            q(u | ctx)                   (a)
               +  Σ_{u : bytes(u) proper non-empty prefix of b} q(u | ctx) · P(b[len(u):] | ctx + u)   (b)

(a) counts the teacher tokens that cover ``b`` at once, those that run past its end
included (``b'ab'`` is covered by ``b'abc'``); (b) recurses on the tokens that write only
the start of ``b``. Every ``ctx + path`` (a teacher-token path from the position's context)
is a node of a tree, and all the candidates of a position share it (``b'ab'`` and ``b'ac'``
both go through the node ``ctx + [a]``). Nodes are visited level by level — the level is the
path's length — and each level is **one batched teacher call**, one row per node (in
production a forward of one new token over the parent's KV cache). A node is expanded only
if some candidate still has bytes to write there, so a position costs
:func:`tree_rows` rows; ``min_log_weight`` prunes the nodes whose path probability is below
it (each pruned node loses at most ``exp(min_log_weight)`` of any candidate's probability).

The approximations, plainly:

* the teacher's context is **its own canonical tokenisation of the prefix text** (its
  prompt + the answer's text up to the student's boundary, encoded), not a marginal over
  every teacher tokenisation of that text. Where the student's boundary falls inside what
  would be one teacher token in the full text, the context ends on an unusual teacher token
  and the teacher's next-token distribution is off (the "token healing" problem). A caller
  can cut the context back to the last teacher boundary at or before the student's, and
  score ``tail + c`` and ``tail`` (``tail``: the prefix bytes after that boundary):
  ``log P(c | prefix) = log P(tail + c) − log P(tail)``, exact under the same rule;
* teacher tokens of **no bytes** (specials: ``<eos>``, chat markers, ids the vocabulary does
  not use; and those excluded when the index is built, :meth:`VocabIndex.of` excludes
  :attr:`TokenBytes.special`) end or leave the text: a path through one is not followed, so
  the probabilities of a set of candidates that covers every next byte sum to
  ``1 − q(specials | ctx)``.

Candidates are non-empty byte strings or, as an ``int``, a teacher id scored as itself
(``log q(id | ctx)`` at the root: the student's EOS paired with the teacher's, as
:func:`~asyncopd_jax.teacher.cross_tokenizer.id_map` pairs them). A candidate of no bytes
(a student special other than its EOS) is not scored: ``−inf``, and the caller masks it.

The numbers are **not a distribution over student tokens**: the events "starts with c"
overlap when one candidate's text is a prefix of another's (``b'a'`` and ``b'ab'``), so they
may sum past 1. :func:`longest_match` turns them into one: each candidate keeps the
continuations whose longest matching candidate it is, the rest is a tail bucket (its
docstring says why that split).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Collection, Sequence

import numpy as np

from asyncopd_jax.models.token_bytes import TokenBytes

NextLogprobs = Callable[[list[list[int]]], np.ndarray]
"""``next_logprobs(contexts) -> [n, V]``: log q of the teacher's next token after each of the
``n`` contexts (teacher ids), one batched forward; ``V`` ≥ the vocabulary's size (columns past
it, a padded embedding's, are no token and are never read)."""

Candidate = bytes | int


@dataclasses.dataclass(frozen=True, eq=False)
class VocabIndex:
    """One teacher vocabulary's bytes, indexed for the two look-ups of the recursion.

    Attributes:
      size: ``V_t``, the vocabulary's ids.
      sorted_bytes: the ``S`` non-empty, non-excluded tokens' bytes, sorted (bytewise).
      order: ``[S]`` int64, the teacher id of each of ``sorted_bytes``.
      by_bytes: each token's bytes → ``[m]`` int64 all ids of exactly those bytes.
      longest: the longest token's bytes.
    """

    size: int
    sorted_bytes: tuple[bytes, ...]
    order: np.ndarray
    by_bytes: dict[bytes, np.ndarray]
    longest: int

    @classmethod
    def build(cls, token_bytes: Sequence[bytes], exclude: Collection[int] = ()) -> VocabIndex:
        """The index of ``token_bytes`` (``V_t`` entries, ``b''`` for an id of no text),
        leaving ``exclude`` out (special tokens whose content is text)."""
        skip = {int(i) for i in exclude}
        kept = sorted((piece, i) for i, piece in enumerate(token_bytes) if piece and i not in skip)
        groups: dict[bytes, list[int]] = {}
        for piece, i in kept:
            groups.setdefault(piece, []).append(i)
        return cls(
            size=len(token_bytes),
            sorted_bytes=tuple(piece for piece, _ in kept),
            order=np.asarray([i for _, i in kept], np.int64),
            by_bytes={piece: np.asarray(ids, np.int64) for piece, ids in groups.items()},
            longest=max((len(piece) for piece, _ in kept), default=0),
        )

    @classmethod
    def of(cls, tokens: TokenBytes) -> VocabIndex:
        """The index of a tokenizer's :class:`TokenBytes`, its special tokens left out."""
        return cls.build(tokens.pieces, tokens.special)

    def extending(self, b: bytes) -> tuple[int, int]:
        """``(lo, hi)``: ``sorted_bytes[lo:hi]`` are the tokens whose bytes start with ``b``
        (non-empty), a contiguous run of the sorted order: from ``b`` itself up to the
        shortest string past every extension of ``b`` (``b`` with its last byte below 0xFF
        raised by one and the rest dropped)."""
        lo = bisect.bisect_left(self.sorted_bytes, b)
        head = b.rstrip(b"\xff")
        if not head:  # b is all 0xFF: every string from b on extends it
            return lo, len(self.sorted_bytes)
        return lo, bisect.bisect_left(self.sorted_bytes, head[:-1] + bytes([head[-1] + 1]), lo)

    def proper_prefixes(self, b: bytes) -> list[tuple[int, np.ndarray]]:
        """``[(n, ids)]``: for each ``n`` with ``0 < n < len(b)`` where ``b[:n]`` is a token's
        bytes, the ids of those bytes."""
        out = []
        for n in range(1, min(len(b) - 1, self.longest) + 1):
            ids = self.by_bytes.get(b[:n])
            if ids is not None:
                out.append((n, ids))
        return out


@dataclasses.dataclass
class _Node:
    """A tree node: position ``query``'s context + ``path``, of log-probability
    ``log_weight``, with ``pending`` ``(candidate, bytes it has still to write)``."""

    query: int
    path: tuple[int, ...]
    log_weight: float
    pending: list[tuple[int, bytes]]


def score_prefixes_batch(
    next_logprobs: NextLogprobs,
    index: VocabIndex,
    queries: Sequence[tuple[Sequence[int], Sequence[Candidate]]],
    *,
    min_log_weight: float = -np.inf,
) -> tuple[np.ndarray, list[int]]:
    """Byte-prefix log-probabilities (module docstring) at ``P`` positions, all trees
    expanded together: one ``next_logprobs`` call per tree level.

    Args:
      next_logprobs: the teacher (:data:`NextLogprobs`).
      index: its vocabulary's :class:`VocabIndex`.
      queries: ``P`` pairs ``(context, candidates)``: the teacher ids the position is
        conditioned on, and its ``K_p`` candidates (non-empty bytes, or an ``int`` teacher id
        scored as itself; ``b''`` is not scored).
      min_log_weight: nodes whose path log-probability is at most this are not expanded
        (−inf: exact).

    Returns:
      ``([P, K]`` float64 ``log P(the continuation's bytes start with the candidate's)``,
      ``K = max K_p``, −inf past a position's candidates and for ``b''``; the rows (nodes
      expanded) of each level``)``.
    """
    width = max((len(cands) for _, cands in queries), default=0)
    out = np.full((len(queries), width), -np.inf)
    contexts = [list(map(int, ctx)) for ctx, _ in queries]
    level = [
        _Node(p, (), 0.0, [(k, c) for k, c in enumerate(cands) if isinstance(c, bytes) and c])
        for p, (_, cands) in enumerate(queries)
    ]
    ids_at_root = [[(k, c) for k, c in enumerate(cands) if not isinstance(c, bytes)] for _, cands in queries]
    level = [node for node in level if node.pending or ids_at_root[node.query]]
    rows_per_level: list[int] = []
    count = len(index.sorted_bytes)
    while level:
        rows = np.asarray(next_logprobs([contexts[n.query] + list(n.path) for n in level]), np.float64)
        if rows.ndim != 2 or rows.shape[0] != len(level) or rows.shape[1] < index.size:
            raise ValueError(
                f"next_logprobs returned shape {rows.shape}; expected [{len(level)}, >= {index.size}] "
                "(one row per context, a column per teacher id)"
            )
        rows_per_level.append(len(level))
        # (a): each (node, candidate)'s log-sum over its run of the sorted vocabulary, one reduceat
        ranked = np.concatenate([rows[:, index.order], np.full((len(level), 1), -np.inf)], axis=1)  # [n, S+1]
        where: list[tuple[int, int]] = []
        bounds: list[int] = []
        weights: list[float] = []
        for i, node in enumerate(level):
            for k, rest in node.pending:
                lo, hi = index.extending(rest)
                where.append((node.query, k))
                bounds.extend((i * (count + 1) + lo, i * (count + 1) + hi))
                weights.append(node.log_weight if lo < hi else -np.inf)
        if where:
            sums = np.logaddexp.reduceat(ranked.ravel(), np.asarray(bounds, np.int64))[::2]
            target = np.asarray(where, np.int64).T
            np.logaddexp.at(out, (target[0], target[1]), np.asarray(weights) + sums)
        # (b): the children, each path once, shared by every candidate that goes through it
        children: dict[tuple[int, tuple[int, ...]], _Node] = {}
        for i, node in enumerate(level):
            if not node.path:
                for k, teacher_id in ids_at_root[node.query]:
                    out[node.query, k] = rows[i, int(teacher_id)]
            for k, rest in node.pending:
                for n, ids in index.proper_prefixes(rest):
                    for u in ids.tolist():
                        weight = node.log_weight + rows[i, u]
                        if weight <= min_log_weight or weight == -np.inf:
                            continue
                        key = (node.query, (*node.path, u))
                        child = children.setdefault(key, _Node(node.query, key[1], float(weight), []))
                        child.pending.append((k, rest[n:]))
        level = list(children.values())
    return out, rows_per_level


def score_prefixes(
    next_logprobs: NextLogprobs,
    index: VocabIndex,
    context: Sequence[int],
    candidates: Sequence[Candidate],
    *,
    min_log_weight: float = -np.inf,
) -> tuple[np.ndarray, int]:
    """:func:`score_prefixes_batch` at one position: ``([K]`` float64 log-probabilities, the
    teacher rows used``)``."""
    logp, rows = score_prefixes_batch(next_logprobs, index, [(context, candidates)], min_log_weight=min_log_weight)
    return logp[0, : len(candidates)], sum(rows)


def tree_rows(index: VocabIndex, candidates: Sequence[Candidate]) -> int:
    """The teacher rows one position costs with no pruning (every path of positive
    probability expanded): the distinct teacher-token paths whose bytes are a proper prefix
    of a candidate's, the empty path (the root) included; 0 when no candidate is scored.

    It depends on the vocabulary only, not on the teacher's probabilities. With a KV cache
    each row is one token's forward, about ``2 · N_params`` FLOPs (plus attention over the
    context: ``4 · layers · d_model · context_len``). The root row is the scoring forward's
    own row where the teacher's tokens of the answer end at the student's boundary (its
    context then is a prefix of the scored sequence): the extra rows there are ``rows − 1``.
    """
    if not any(not isinstance(c, bytes) or c for c in candidates):
        return 0
    seen: set[tuple[int, ...]] = {()}
    level: dict[tuple[int, ...], list[bytes]] = {(): [c for c in candidates if isinstance(c, bytes) and c]}
    while level:
        nxt: dict[tuple[int, ...], list[bytes]] = {}
        for path, rests in level.items():
            for rest in rests:
                for n, ids in index.proper_prefixes(rest):
                    for u in ids.tolist():
                        nxt.setdefault((*path, u), []).append(rest[n:])
        seen.update(nxt)
        level = nxt
    return len(seen)


def mean_tree_rows(index: VocabIndex, candidate_sets: Sequence[Sequence[Candidate]]) -> float:
    """The mean of :func:`tree_rows` over positions (each a candidate set): teacher FLOPs
    per position ≈ this × ``2 · N_params`` (see :func:`tree_rows`)."""
    return float(np.mean([tree_rows(index, cands) for cands in candidate_sets])) if candidate_sets else 0.0


def longest_match(logp: np.ndarray, candidates: Sequence[Candidate]) -> tuple[np.ndarray, float]:
    """Byte-prefix log-probabilities made a distribution over the candidates and a tail.

    Candidate ``c`` keeps the continuations that start with ``c`` and with no longer
    candidate: ``P(c) − Σ P(c')`` over the candidates ``c'`` that extend ``c`` with no
    candidate between (those events are disjoint, and they hold every longer one's); an
    ``int`` candidate (a teacher id: EOS) is an event of its own. The tail is what no
    candidate starts: ``1 − Σ`` over the candidates no other is a prefix of. A repeat of a
    candidate after its first gets nothing (−inf).

    Why this split: a tokenizer writes a text with its longest tokens (BPE's merges, a
    greedy longest match), so the continuations starting with ``b'ab'`` are, in the
    student's canonical tokens, an ``b'ab'`` token, not ``b'a'``. Renormalising the raw
    overlapping numbers (``forward_kl_topk_renormalized`` on them) would count the ``b'ab…'``
    mass twice and teach the student to write ``b'a'`` too; this split asks it to write the
    teacher's text in its own longest tokens, what the exact-text mapping could not. The
    result feeds ``forward_kl_topk`` with a tail bucket (or, dropping the tail,
    ``forward_kl_topk_renormalized``).

    Args:
      logp: ``[K]`` log-probabilities of ``candidates`` (:func:`score_prefixes`).
      candidates: their ``K`` byte strings / teacher ids.

    Returns:
      ``([K]`` float64 log-masses, −inf where none; the tail's log-mass``)``, which sum
      (as probabilities) to 1: the tail holds the teacher's mass on tokens of no bytes
      unless an ``int`` candidate scores it.
    """
    logp = np.asarray(logp, np.float64)
    out = np.full(logp.shape, -np.inf)
    first: dict[Candidate, int] = {}
    for k, c in enumerate(candidates):
        if (not isinstance(c, bytes) or c) and logp[k] > -np.inf:
            first.setdefault(c, k)
    texts = sorted((c, k) for c, k in first.items() if isinstance(c, bytes))
    roots: list[float] = [float(logp[k]) for c, k in first.items() if not isinstance(c, bytes)]
    stack: list[tuple[bytes, int, list[float]]] = []  # the open chain of prefixes in sorted order
    for c, k in texts:
        while stack and not c.startswith(stack[-1][0]):
            _close(out, logp, stack.pop())
        (stack[-1][2] if stack else roots).append(float(logp[k]))
        stack.append((c, k, []))
    while stack:
        _close(out, logp, stack.pop())
    for k in first.values():
        if not isinstance(candidates[k], bytes):
            out[k] = logp[k]
    covered = np.logaddexp.reduce(np.asarray(roots)) if roots else -np.inf
    return out, float(_log1mexp(covered))


def _close(out: np.ndarray, logp: np.ndarray, entry: tuple[bytes, int, list[float]]) -> None:
    """``out[k] = log(P(c) − Σ P(children))`` for a closed trie entry ``(c, k, children)``."""
    _, k, children = entry
    inner = np.logaddexp.reduce(np.asarray(children)) if children else -np.inf
    out[k] = logp[k] + _log1mexp(inner - logp[k]) if inner > -np.inf else logp[k]


def _log1mexp(x: float) -> float:
    """``log(1 − exp(x))`` for ``x ≤ 0``, −inf where rounding puts ``x`` at or past 0."""
    return float(np.log(-np.expm1(x))) if x < 0 else -np.inf


__all__ = [
    "Candidate",
    "NextLogprobs",
    "VocabIndex",
    "longest_match",
    "mean_tree_rows",
    "score_prefixes",
    "score_prefixes_batch",
    "tree_rows",
]
