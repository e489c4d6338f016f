"""A teacher of another tokenizer scored on the student's own tokens (``teacher.mapping:
byte_prefix``), in-process.

Where :class:`~asyncopd_jax.teacher.cross_tokenizer.CrossTokenizerTeacher` compares the two
models on text spans, this teacher gives each student position a per-token cache, as a
teacher of the student's tokenizer would:

* ``topk_ids`` ``[B, T, K]``: the **student's** top-K ids at the position (the rollout's
  ``student_topk_ids``: the support is the student's own), and ``topk_logp`` the teacher's
  log-mass on each, from :func:`~asyncopd_jax.teacher.byte_prefix.longest_match` of the
  byte-prefix probabilities (each candidate keeps the continuations whose longest matching
  candidate it is; the rest is the tail that ``forward_kl_topk`` buckets);
* ``token_logp`` ``[B, T]``: ``log P(the continuation starts with the sampled token's
  bytes)`` (for the metrics' KL and the estimators that read it).

Both are at least :data:`FLOOR`: a token no teacher path writes, a special id, a repeated
candidate would otherwise be −inf, and outside a span cache the learner takes −inf for a
fault and drops the row (:mod:`asyncopd_jax.learner.faults`); ``exp(FLOOR)`` is a mass no
estimator can tell from 0.

The teacher's context at student position t is its prompt (already in its tokens) and its
own tokens of the answer's text before t up to the last complete UTF-8 character; bytes
after that (a student token ending inside a character) are scored as a prefix of each
candidate and divided out: ``log P(tail + c) − log P(tail)``. The student's EOS is scored
as the teacher's EOS (an ``int`` candidate); other special student ids are not scored
(−inf mass, as an id outside a top-K is).

Cost: each position is a small tree of teacher rows (:func:`~asyncopd_jax.teacher.byte_prefix.tree_rows`),
every level one batched call. Each answer's whole sequence (the teacher's prompt and its
tokens of the answer) is run once, its keys and values kept; a tree's root (the context at
a position: a prefix of that sequence) is read off that forward, and a node's path (the ≤ a
few teacher tokens after the root) runs over the kept keys and values of the root's
prefix, so a node costs its path's tokens, not its context's. A context that is no prefix
of its answer's sequence (a tokenizer that encodes a text's prefix otherwise than the text)
is run whole. :attr:`last_rows` gives the tree rows of the last batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncopd_jax.cache import RolloutBatch, TeacherScoreCache
from asyncopd_jax.models.decoder import Decoder, KVCache
from asyncopd_jax.teacher.byte_prefix import Candidate, VocabIndex, longest_match, score_prefixes_batch
from asyncopd_jax.teacher.cross_tokenizer import Retokenizer
from asyncopd_jax.teacher.scorer import ScoringParams, power_of_two
from asyncopd_jax.teacher.span_alignment import valid_prefix

Array = jax.Array

#: The least ``token_logp`` a position gets (a token the teacher cannot write).
FLOOR = -30.0

#: Teacher rows one forward takes at most (a level's rows go in chunks of this many).
CHUNK_ROWS = 512


class BytePrefixTeacher:
    """A :class:`~asyncopd_jax.teacher.scorer.Teacher` of another tokenizer, scored on the
    student's tokens by byte prefixes (module docstring).

    Args:
      model: the teacher.
      tokens: the tokenizer pair.
      params: what to score: ``temperature`` (the teacher's), ``store_dtype``.
      name: the teacher's name (errors).
    """

    def __init__(
        self, model: Decoder, tokens: Retokenizer, params: ScoringParams, name: str = "teacher", from_teacher: int = 0
    ):
        self.tokens, self.params, self.name, self.from_teacher = tokens, params, name, from_teacher
        self.index = VocabIndex.of(tokens.teacher_bytes)
        self.graphdef, self.state = nnx.split(model)
        self.last_rows = 0  # teacher rows (contexts) the last score() ran
        self._answers: _Answers | None = None  # the batch's answer sequences, run once (score())

    last_wait_s = None  # in-process: no server to wait for

    @property
    def last_requests(self) -> int:
        return 1

    @functools.cached_property
    def _logp_at(self):
        """``(state, ids [n, L], row [m], last [m]) → [m, V]``: log-softmax of the next token
        after ``ids[row, :last + 1]`` (right-padded rows: causal attention never reads the pad)."""
        temperature = self.params.temperature

        def logp_at(state, ids, row, last):
            model = nnx.merge(self.graphdef, state)
            hidden = model.hidden_states(ids)[row, last]  # [m, H]
            return jax.nn.log_softmax(model.logits(hidden) / temperature, axis=-1)

        return jax.jit(logp_at)

    @functools.cached_property
    def _run_answers(self):
        """``(state, ids [B, W], valid [B, W], slots) → (hidden [B, W, H], cache of slots)``."""

        def run(state, ids, valid, slots):
            model = nnx.merge(self.graphdef, state)
            positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
            cache = KVCache.empty(model.config, ids.shape[0], slots, model.compute_dtype)
            return model.forward(ids, positions, valid, cache, 0)

        return jax.jit(run, static_argnums=3)

    @functools.cached_property
    def _read(self):
        """``(state, hidden [B, W, H], row [m], last [m]) → [m, V]``: log q after each answer
        sequence's token ``last``."""
        temperature = self.params.temperature

        def read(state, hidden, row, last):
            model = nnx.merge(self.graphdef, state)
            return jax.nn.log_softmax(model.logits(hidden[row, last]) / temperature, axis=-1)

        return jax.jit(read)

    @functools.cached_property
    def _extend(self):
        """``(state, cache, row [n], start [n], path [n, d], width) → [n, V]``: log q after
        answer sequence ``row``'s first ``start`` tokens and then ``path``: the path runs over
        the kept keys and values of that prefix (written after the sequence's ``width`` slots,
        at RoPE positions ``start …``)."""
        temperature = self.params.temperature

        def extend(state, cache, row, start, path, width):
            model = nnx.merge(self.graphdef, state)
            mine = KVCache(
                tuple(k[row] for k in cache.keys),
                tuple(v[row] for v in cache.values),
                jnp.arange(cache.slots)[None, :] < start[:, None],  # the prefix; the path's slots are written
            )
            positions = start[:, None] + jnp.arange(path.shape[1])
            hidden, _ = model.forward(path, positions, jnp.ones(path.shape, bool), mine, width)
            return jax.nn.log_softmax(model.logits(hidden[:, -1]) / temperature, axis=-1)

        return jax.jit(extend, static_argnums=5)

    def next_logprobs(self, contexts: list[list[int]]) -> np.ndarray:
        """``[n, V]`` log q of the next teacher token after each context: off the answers'
        own forward where it is a prefix of one, over their kept keys and values where it is
        such a prefix and a short path, else run whole (:meth:`_whole`)."""
        answers, found = self._answers, []
        out: np.ndarray | None = None
        rest = list(range(len(contexts)))
        if answers is not None:
            rest = []
            by_depth: dict[int, list[tuple[int, int, int, list[int]]]] = {}
            for i, context in enumerate(contexts):
                for depth in range(min(answers.depth, len(context)) + 1):
                    base = answers.roots.get(tuple(context[: len(context) - depth]))
                    if base is not None:
                        by_depth.setdefault(depth, []).append((i, *base, context[len(context) - depth :]))
                        break
                else:
                    rest.append(i)
            for depth, items in by_depth.items():
                found.append(([i for i, *_ in items], self._at_depth(answers, depth, items)))
        if rest:
            found.append((rest, self._whole([contexts[i] for i in rest])))
        for where, logp in found:
            out = np.zeros((len(contexts), logp.shape[1])) if out is None else out
            out[where] = logp
        assert out is not None
        return out

    def _at_depth(self, answers: _Answers, depth: int, items: list) -> np.ndarray:
        """log q after ``(index, row, start, path)`` items whose paths have ``depth`` tokens."""
        out = []
        for at in range(0, len(items), CHUNK_ROWS):
            part = items[at : at + CHUNK_ROWS]
            n = power_of_two(len(part))
            row, start = np.zeros((2, n), np.int32)
            row[: len(part)] = [r for _, r, _, _ in part]
            start[: len(part)] = [s for _, _, s, _ in part]
            if depth == 0:  # the answer's own forward, at the root's last token
                logp = self._read(self.state, answers.hidden, jnp.asarray(row), jnp.asarray(np.maximum(start - 1, 0)))
            else:
                path = np.zeros((n, depth), np.int32)
                path[: len(part)] = [p for *_, p in part]
                start[len(part) :] = 1
                logp = self._extend(
                    self.state, answers.cache, jnp.asarray(row), jnp.asarray(start), jnp.asarray(path), answers.width
                )
            out.append(np.asarray(logp)[: len(part)])
        return np.concatenate(out)

    def _whole(self, contexts: list[list[int]]) -> np.ndarray:
        """``[n, V]`` log q of the next teacher token after each context, run whole; a
        context that is a prefix of another is read off that one's forward. The rows run
        sorted by length, a power of two of rows and columns per call (few compiled shapes)."""
        order = sorted(range(len(contexts)), key=lambda i: contexts[i])
        cover = list(order)  # cover[j]: the sorted context the j-th sorted one is read from
        for j in range(len(order) - 2, -1, -1):  # a prefix sorts just before an extension of it
            here, after = contexts[order[j]], contexts[cover[j + 1]]
            if len(here) <= len(after) and after[: len(here)] == here:
                cover[j] = cover[j + 1]
        rows = sorted(set(cover), key=lambda i: len(contexts[i]))
        at = {row: k for k, row in enumerate(rows)}
        reads = np.zeros((len(contexts), 2), np.int64)  # each context: (its row, its last position)
        for j, i in enumerate(order):
            reads[i] = at[cover[j]], len(contexts[i]) - 1
        out = np.zeros((len(contexts), 0))
        for start in range(0, len(rows), CHUNK_ROWS):
            part = [contexts[i] for i in rows[start : start + CHUNK_ROWS]]
            height, width = power_of_two(len(part)), power_of_two(max(map(len, part)))
            ids = np.zeros((height, width), np.int32)
            for k, context in enumerate(part):
                ids[k, : len(context)] = context
            mine = np.flatnonzero((reads[:, 0] >= start) & (reads[:, 0] < start + len(part)))
            row, last = np.zeros((2, power_of_two(max(mine.size, 1))), np.int32)
            row[: mine.size], last[: mine.size] = reads[mine, 0] - start, reads[mine, 1]
            logp = np.asarray(self._logp_at(self.state, jnp.asarray(ids), jnp.asarray(row), jnp.asarray(last)))
            if not out.size:
                out = np.zeros((len(contexts), logp.shape[1]))
            out[mine] = logp[: mine.size]
        return out

    def _candidate(self, student_id: int) -> Candidate:
        """A student id as a candidate: its bytes, the teacher's EOS for the student's, b''
        (not scored) for another special id."""
        if student_id in self.tokens.student_eos:
            return self.tokens.teacher_eos
        if student_id in self.tokens.student_bytes.special:
            return b""
        return self.tokens.student_bytes.pieces[student_id]

    def _context(self, prompt: list[int], prefix: bytes) -> tuple[list[int], bytes]:
        """The teacher's ids for ``prompt`` + the answer's text ``prefix`` up to its last
        complete UTF-8 character, and the bytes after it."""
        cut = valid_prefix(prefix)
        text = prefix[:cut].decode("utf-8")
        ids = self.tokens.teacher.encode(text, add_special_tokens=False) if text else []
        return prompt + list(ids), prefix[cut:]

    def score(self, batch: RolloutBatch, key: Array | None = None) -> TeacherScoreCache:
        """The per-token cache of ``batch`` (its prompts: the teacher's, in teacher tokens;
        its ``student_topk_ids``: the support scored, with :meth:`teacher_ids` ahead of them
        where ``from_teacher``)."""
        del key  # nothing is sampled
        if batch.student_topk_ids is None:
            raise ValueError(
                f"teacher {self.name!r} (mapping = byte_prefix) scores the student's top-K ids: the rollout has none "
                "(set sampling.student_topk)"
            )
        tokens, mask = np.asarray(batch.response_tokens), np.asarray(batch.response_mask, bool)
        prompts, prompt_mask = np.asarray(batch.prompt_tokens), np.asarray(batch.prompt_mask, bool)
        support = np.array(batch.student_topk_ids)
        b, t, k = support.shape
        places: list[tuple[int, int, list[int], bytes, int]] = []  # row, position, context, tail, sampled id
        sequences: list[list[int]] = []  # each answer's teacher sequence: its prompt and its answer's text
        for row in range(b):
            prompt, prefix = prompts[row][prompt_mask[row]].tolist(), b""
            for position in np.flatnonzero(mask[row]).tolist():
                context, tail = self._context(prompt, prefix)
                sampled = int(tokens[row, position])
                places.append((row, position, context, tail, sampled))
                prefix += self.tokens.student_bytes.pieces[sampled]
            sequences.append(self._context(prompt, prefix)[0])
        if not places:
            return self._cache(support, np.zeros((b, t)), np.full((b, t, k), FLOOR))
        where = tuple(np.asarray([place[:2] for place in places]).T)  # (rows, positions) scored
        self._answers = self._run(sequences, places)
        try:
            if self.from_teacher:
                roots = self.next_logprobs([context for _, _, context, _, _ in places])
                support[where] = self.teacher_ids(roots, [tail for *_, tail, _ in places], support[where])
            queries: list[tuple[list[int], list[Candidate]]] = []
            for (_, _, context, tail, sampled), ids in zip(places, support[where], strict=True):
                candidates = [self._candidate(sampled)] + [self._candidate(int(i)) for i in ids]
                queries.append((context, [_after(tail, c) for c in candidates] + ([tail] if tail else [])))
            longest = max((len(c) for _, asked in queries for c in asked if isinstance(c, bytes)), default=1)
            self._answers = self._answers.with_room(power_of_two(longest))
            logp, rows = score_prefixes_batch(self.next_logprobs, self.index, queries)
        finally:
            self._answers = None
        self.last_rows = sum(rows)
        token_logp = np.zeros((b, t))
        topk_logp = np.full((b, t, k), FLOOR)
        for q, (row, position, _, tail, _) in enumerate(places):
            scores = logp[q, : k + 1] - (logp[q, k + 1] if tail else 0.0)
            candidates = [self._candidate(int(i)) for i in support[row, position]]
            token_logp[row, position] = scores[0]
            topk_logp[row, position] = longest_match(scores[1:], candidates)[0]
        return self._cache(support, token_logp, topk_logp)

    def _cache(self, support: np.ndarray, token_logp: np.ndarray, topk_logp: np.ndarray) -> TeacherScoreCache:
        """The cache of ``support`` ``[B, T, K]`` and its log-masses, each at least :data:`FLOOR`."""
        store = jnp.dtype(self.params.store_dtype)
        return TeacherScoreCache(
            token_logp=jnp.asarray(np.maximum(token_logp, FLOOR), store),
            topk_ids=jnp.asarray(support, jnp.int32),
            topk_logp=jnp.asarray(np.maximum(topk_logp, FLOOR), store),
        )

    def teacher_ids(self, roots: np.ndarray, tails: list[bytes], own: np.ndarray) -> np.ndarray:
        """``[n, K]``: each position's support, the student tokens that start the teacher's
        ``from_teacher`` most likely next tokens (:meth:`starts`; distinct, the teacher's
        order, a token no student token starts skipped) and then the student's own top ids
        ``own`` ``[n, K]`` not among them, in the student's order, K in all.

        ``roots`` ``[n, V]``: the teacher's next-token log-probs at each position's context.
        Only the teacher's ``4 · from_teacher`` most likely tokens are looked at."""
        n, k = own.shape
        look = min(4 * self.from_teacher, roots.shape[1])
        best = np.argpartition(-roots, look - 1, axis=1)[:, :look]
        best = np.take_along_axis(best, np.argsort(-np.take_along_axis(roots, best, axis=1), axis=1), axis=1)
        out = np.empty_like(own)
        for i in range(n):
            chosen: list[int] = []
            for j in best[i].tolist():
                start = self.start(j, tails[i])
                if start >= 0 and start not in chosen:
                    chosen.append(start)
                    if len(chosen) == self.from_teacher:
                        break
            out[i] = (chosen + [int(s) for s in own[i] if int(s) not in chosen])[:k]
        return out

    def start(self, teacher_id: int, tail: bytes = b"") -> int:
        """The student token that starts teacher token ``teacher_id`` written after ``tail``
        (the answer's bytes past the context): its longest student prefix after ``tail``; the
        student's EOS for the teacher's; −1 for none (a special, a token that does not
        continue ``tail``, an id past the teacher's tokenizer)."""
        if not tail:
            return int(self.starts[teacher_id]) if teacher_id < self.starts.size else -1
        pieces = self.tokens.teacher_bytes.pieces
        if teacher_id >= len(pieces) or teacher_id in self.tokens.teacher_bytes.special:
            return -1
        piece = pieces[teacher_id]
        return self._longest_student_prefix(piece[len(tail) :]) if piece.startswith(tail) else -1

    @functools.cached_property
    def starts(self) -> np.ndarray:
        """``[V_teacher]`` int64: :meth:`start` of each teacher id after no tail."""
        teacher = self.tokens.teacher_bytes
        out = np.full(len(teacher.pieces), -1, np.int64)
        for i, piece in enumerate(teacher.pieces):
            if piece and i not in teacher.special:
                out[i] = self._longest_student_prefix(piece)
        out[self.tokens.teacher_eos] = self.tokens.student_eos[0]
        return out

    def _longest_student_prefix(self, text: bytes) -> int:
        """The student id of the longest non-empty prefix of ``text`` it has (−1: none)."""
        table = self.tokens.student_bytes.by_bytes
        for end in range(len(text), 0, -1):
            if text[:end] in table:
                return table[text[:end]]
        return -1

    def _run(self, sequences: list[list[int]], places: list[tuple[int, int, list[int], bytes, int]]) -> _Answers:
        """The answers' sequences run once (:class:`_Answers`, no room for paths yet), each
        position's context that is a prefix of its answer's sequence a root read off it."""
        width = power_of_two(max(map(len, sequences)))
        ids, valid = np.zeros((2, len(sequences), width), np.int32)
        for row, sequence in enumerate(sequences):
            ids[row, : len(sequence)], valid[row, : len(sequence)] = sequence, 1
        hidden, cache = self._run_answers(self.state, jnp.asarray(ids), jnp.asarray(valid, bool), width)
        roots = {
            tuple(context): (row, len(context))
            for row, _, context, _, _ in places
            if context and sequences[row][: len(context)] == context
        }
        return _Answers(hidden, cache, width, 0, roots)


@dataclasses.dataclass(frozen=True)
class _Answers:
    """A batch's answer sequences run once: ``hidden`` ``[B, W, H]`` and their keys and values
    (``cache``, ``width`` W slots and room for paths of up to ``depth`` tokens after them);
    ``roots`` maps a context that is a prefix of answer ``row``'s sequence to ``(row, its
    length)``."""

    hidden: Array
    cache: KVCache
    width: int
    depth: int
    roots: dict[tuple[int, ...], tuple[int, int]]

    def with_room(self, depth: int) -> _Answers:
        """These answers with room for paths of up to ``depth`` tokens after their slots."""
        room = self.width + depth - self.cache.slots

        def pad(a: Array, axis: int) -> Array:
            return jnp.pad(a, [(0, room if i == axis else 0) for i in range(a.ndim)])

        keys, values = (tuple(pad(a, 2) for a in arrays) for arrays in (self.cache.keys, self.cache.values))
        return dataclasses.replace(self, cache=KVCache(keys, values, pad(self.cache.valid, 1)), depth=depth)


def _after(tail: bytes, candidate: Candidate) -> Candidate:
    """``candidate`` scored after ``tail``: their bytes joined; a teacher id cannot follow a
    partial character (b'': not scored)."""
    if isinstance(candidate, bytes):
        return tail + candidate if candidate else b""
    return candidate if not tail else b""
