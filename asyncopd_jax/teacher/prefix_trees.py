"""The teacher's side of ``teacher.mapping: byte_prefix``: byte-prefix probabilities at many
contexts of a batch of answers (:mod:`asyncopd_jax.teacher.byte_prefix`), one teacher in this
process. ``asyncopd serve-teacher`` answers the same two calls over HTTP
(:mod:`asyncopd_jax.teacher.prefix_wire`); the student's side is
:class:`~asyncopd_jax.teacher.byte_prefix_teacher.BytePrefixTeacher`.

A batch is its answers' teacher sequences (each its prompt and its answer's text, in the
teacher's tokens) and the contexts scored in it, each ``(row, ids)``: the answer it belongs
to and the teacher ids it ends with. Two calls:

* :meth:`PrefixTrees.top`: each context's ``m`` likeliest next teacher ids, and their log-probs;
* :meth:`PrefixTrees.prefixes`: ``log P(the continuation's bytes start with c)`` of each
  context's candidates ``c`` (:func:`~asyncopd_jax.teacher.byte_prefix.score_prefixes_batch`).

Cost: each context is a small tree of teacher rows (:func:`~asyncopd_jax.teacher.byte_prefix.tree_rows`),
every level one batched call. Each answer's whole sequence is run once, its keys and values
kept (also between the two calls of a batch: the last batch's are kept); a tree's root (a
context that is a prefix of its answer's sequence) is read off that forward, and a node's
path (the ≤ a few teacher tokens after the root) runs over the kept keys and values of the
root's prefix, so a node costs its path's tokens, not its context's. A context that is no
prefix of its answer's sequence (a tokenizer that encodes a text's prefix otherwise than
the text) is run whole. :attr:`PrefixTrees.last_rows` gives the tree rows of the last call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncopd_jax.models.decoder import Decoder, KVCache
from asyncopd_jax.models.token_bytes import TokenBytes
from asyncopd_jax.teacher.byte_prefix import Candidate, VocabIndex, score_prefixes_batch
from asyncopd_jax.teacher.scorer import power_of_two

Array = jax.Array

#: A context scored: the answer (row) it belongs to, and the teacher ids it ends with.
Context = tuple[int, list[int]]

#: Teacher rows one forward takes at most (a level's rows go in chunks of this many).
CHUNK_ROWS = 512


class PrefixTrees:
    """Byte-prefix probabilities of one teacher in this process (module docstring).

    Args:
      model: the teacher.
      teacher_bytes: its tokenizer's bytes per id.
      temperature: its distribution ``softmax(z / temperature)``.
    """

    def __init__(self, model: Decoder, teacher_bytes: TokenBytes, temperature: float = 1.0):
        self.temperature = temperature
        self.index = VocabIndex.of(teacher_bytes)
        self.graphdef, self.state = nnx.split(model)
        self.vocab_size = int(model.vocab_limit or model.config.vocab_size)
        self.context = int(model.config.max_position_embeddings)
        self.last_rows = 0  # teacher rows (contexts) the last call ran
        self.last_levels: list[int] = []  # the last prefixes() call's rows, level by level
        self._answers: _Answers | None = None  # during a call: the batch's answers, run once
        self._kept: tuple[tuple, _Answers] | None = None  # the last batch's sequences and answers

    def top(self, sequences: list[list[int]], contexts: Sequence[Context], m: int) -> tuple[np.ndarray, np.ndarray]:
        """``([n, m]`` int64 ids, ``[n, m]`` float64 log-probs``)``: each context's ``m``
        likeliest next teacher ids (fewer where the vocabulary is smaller), likeliest first."""
        with self._over(sequences, contexts, 0):
            logp = self.next_logprobs([list(ids) for _, ids in contexts])
        self.last_rows = len(contexts)
        m = min(m, logp.shape[1])
        best = np.argpartition(-logp, m - 1, axis=1)[:, :m]
        best = np.take_along_axis(best, np.argsort(-np.take_along_axis(logp, best, axis=1), axis=1), axis=1)
        return best.astype(np.int64), np.take_along_axis(logp, best, axis=1)

    def prefixes(
        self, sequences: list[list[int]], contexts: Sequence[Context], asked: Sequence[Sequence[Candidate]]
    ) -> np.ndarray:
        """``[n, C]`` float64: ``log P(the continuation's bytes start with c)`` for each
        context's candidates ``c`` (non-empty bytes, or an ``int`` teacher id scored as
        itself; ``b''``: −inf), ``C`` the most candidates a context has, −inf past its own."""
        longest = max((len(c) for cands in asked for c in cands if isinstance(c, bytes)), default=1)
        queries = [(list(ids), list(cands)) for (_, ids), cands in zip(contexts, asked, strict=True)]
        with self._over(sequences, contexts, power_of_two(max(longest, 1))):
            logp, rows = score_prefixes_batch(self.next_logprobs, self.index, queries)
        self.last_rows, self.last_levels = sum(rows), rows
        return logp

    def forget(self) -> None:
        """Drop the kept forward (its keys and values): the next call runs its answers anew."""
        self._kept = None

    @contextlib.contextmanager
    def _over(self, sequences: list[list[int]], contexts: Sequence[Context], depth: int) -> Iterator[None]:
        """Within: :meth:`next_logprobs` reads ``contexts`` off the answers of ``sequences``
        (run once, kept for the next call on the same sequences), with room for paths of up
        to ``depth`` tokens."""
        key = tuple(map(tuple, sequences))
        if self._kept is None or self._kept[0] != key:
            self.forget()  # the last batch's keys and values go before this one's are made
            self._kept = (key, self._run(sequences))
        roots = {
            tuple(ids): (row, len(ids))
            for row, ids in contexts
            if ids and list(sequences[row][: len(ids)]) == list(ids)
        }
        self._answers = dataclasses.replace(self._kept[1].with_room(depth), roots=roots)
        try:
            yield
        finally:
            self._answers = None

    @functools.cached_property
    def _logp_at(self):
        """``(state, ids [n, L], row [m], last [m]) → [m, V]``: log-softmax of the next token
        after ``ids[row, :last + 1]`` (right-padded rows: causal attention never reads the pad)."""
        temperature = self.temperature

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
        temperature = self.temperature

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
        temperature = self.temperature

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

    def _run(self, sequences: list[list[int]]) -> _Answers:
        """The answers' sequences run once (:class:`_Answers`, no room for paths yet)."""
        width = power_of_two(max(map(len, sequences)))
        ids, valid = np.zeros((2, len(sequences), width), np.int32)
        for row, sequence in enumerate(sequences):
            ids[row, : len(sequence)], valid[row, : len(sequence)] = sequence, 1
        hidden, cache = self._run_answers(self.state, jnp.asarray(ids), jnp.asarray(valid, bool), width)
        return _Answers(hidden, cache, width, 0, {})


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
        if room == 0:
            return dataclasses.replace(self, depth=depth)

        def pad(a: Array, axis: int) -> Array:
            return jnp.pad(a, [(0, room if i == axis else 0) for i in range(a.ndim)])

        keys, values = (tuple(pad(a, 2) for a in arrays) for arrays in (self.cache.keys, self.cache.values))
        return dataclasses.replace(self, cache=KVCache(keys, values, pad(self.cache.valid, 1)), depth=depth)
