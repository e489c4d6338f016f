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

The teacher's side (its forwards over small prefix trees) is a
:class:`~asyncopd_jax.teacher.prefix_trees.PrefixTrees` in this process, or the same calls
answered by ``asyncopd serve-teacher`` (:class:`~asyncopd_jax.teacher.prefix_wire.ServedPrefixTrees`):
this class is the student's side, and needs only the two tokenizers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from asyncopd_jax.cache import RolloutBatch, TeacherScoreCache
from asyncopd_jax.teacher.byte_prefix import Candidate, longest_match
from asyncopd_jax.teacher.cross_tokenizer import Retokenizer, pieces
from asyncopd_jax.teacher.prefix_trees import PrefixTrees
from asyncopd_jax.teacher.prefix_wire import ServedPrefixTrees
from asyncopd_jax.teacher.scorer import ScoringParams
from asyncopd_jax.teacher.span_alignment import valid_prefix

Array = jax.Array

#: The least ``token_logp`` a position gets (a token the teacher cannot write).
FLOOR = -30.0


class BytePrefixTeacher:
    """A :class:`~asyncopd_jax.teacher.scorer.Teacher` of another tokenizer, scored on the
    student's tokens by byte prefixes (module docstring).

    Args:
      trees: the teacher's side: in this process or a server's.
      tokens: the tokenizer pair.
      params: what to score: ``store_dtype`` (the teacher's temperature is the trees').
      name: the teacher's name (errors).
      from_teacher: of the K ids a position scores, how many are the student tokens that
        start the teacher's likeliest next tokens (:meth:`teacher_ids`).
    """

    def __init__(
        self,
        trees: PrefixTrees | ServedPrefixTrees,
        tokens: Retokenizer,
        params: ScoringParams,
        name: str = "teacher",
        from_teacher: int = 0,
    ):
        self.trees, self.tokens, self.params, self.name, self.from_teacher = trees, tokens, params, name, from_teacher
        self.last_requests = 0  # the last batch's requests to a server (1 in-process: its answers run once)
        self.last_wait_s: float | None = None  # seconds the last batch waited to retry a server (None: in-process)

    @property
    def last_rows(self) -> int:
        """The teacher rows (tree nodes) the last batch's candidates took."""
        return self.trees.last_rows

    def _candidate(self, student_id: int, first: bool = False) -> Candidate:
        """A student id as a candidate: its bytes (:meth:`_bytes`), the teacher's EOS for the
        student's, b'' (not scored) for another special id."""
        if student_id in self.tokens.student_eos:
            return self.tokens.teacher_eos
        if student_id in self.tokens.student_bytes.special:
            return b""
        return self._bytes(student_id, first)

    def _bytes(self, student_id: int, first: bool) -> bytes:
        """The bytes student id ``student_id`` adds to the answer's text; ``first``: written
        before any other (:meth:`~asyncopd_jax.models.token_bytes.TokenBytes.at_text_start`,
        the rule :func:`~asyncopd_jax.teacher.span_alignment.answer_text` reads the text by)."""
        piece = self.tokens.student_bytes.pieces[student_id]
        return self.tokens.student_bytes.at_text_start(piece) if first else piece

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
        tokens, context_mask = np.asarray(batch.response_tokens), np.asarray(batch.context_mask, bool)
        environment = np.zeros_like(context_mask) if batch.environment_mask is None else batch.environment_mask
        environment = np.asarray(environment, bool)
        prompts, prompt_mask = np.asarray(batch.prompt_tokens), np.asarray(batch.prompt_mask, bool)
        support = np.array(batch.student_topk_ids)
        b, t, k = support.shape
        places: list[tuple[int, int, list[int], bytes, int]] = []  # row, position, context, tail, sampled id
        sequences: list[list[int]] = []  # each answer's teacher sequence: its prompt and its answer's text
        firsts: list[bool] = []  # each place: before the answer's first byte (a leading space is not text there)
        for row in range(b):
            # a trajectory turn by turn: the teacher reads each finished turn and observation in
            # its own tokens (``before``), then the current turn's text up to the position
            columns = np.flatnonzero(context_mask[row])
            before, prefix = prompts[row][prompt_mask[row]].tolist(), b""
            for start, stop, heard in pieces(environment[row, columns]):
                if heard:
                    before = before + self.tokens.observation(tokens[row, columns[start:stop]]).teacher_ids
                    continue
                prefix, first = b"", start == 0  # a later turn does not start the text
                for position in columns[start:stop].tolist():
                    context, tail = self._context(before, prefix)
                    sampled = int(tokens[row, position])
                    places.append((row, position, context, tail, sampled))
                    firsts.append(first)
                    if sampled not in self.tokens.student_eos:  # a stop is the turn's end, not its text
                        prefix += self._bytes(sampled, first)
                    first = first and not self.tokens.student_bytes.pieces[sampled]
                if stop < columns.size:  # a turn an observation follows: it stopped, as the teacher's EOS
                    before = self._context(before, prefix)[0] + [self.tokens.teacher_eos]
                    prefix = b""
            sequences.append(self._context(before, prefix)[0])
        if not places:
            return self._cache(support, np.zeros((b, t)), np.full((b, t, k), FLOOR))
        where = tuple(np.asarray([place[:2] for place in places]).T)  # (rows, positions) scored
        contexts = [(row, context) for row, _, context, _, _ in places]
        served = self.trees if isinstance(self.trees, ServedPrefixTrees) else None
        before = (served.wait_s, served.requests) if served is not None else (0.0, 0)
        if self.from_teacher:
            best, _ = self.trees.top(sequences, contexts, 4 * self.from_teacher)
            support[where] = self.teacher_ids(best, [tail for *_, tail, _ in places], support[where], firsts)
        asked: list[list[Candidate]] = []
        for (_, _, _, tail, sampled), ids, first in zip(places, support[where], firsts, strict=True):
            candidates = [self._candidate(sampled, first)] + [self._candidate(int(i), first) for i in ids]
            asked.append([_after(tail, c) for c in candidates] + ([tail] if tail else []))
        logp = self.trees.prefixes(sequences, contexts, asked)
        if served is not None:  # the server's requests and retries' waits
            self.last_wait_s, self.last_requests = served.wait_s - before[0], served.requests - before[1]
        else:  # the trees' calls: one forward of the answers
            self.last_wait_s, self.last_requests = None, 1
        token_logp = np.zeros((b, t))
        topk_logp = np.full((b, t, k), FLOOR)
        for q, (row, position, _, tail, _) in enumerate(places):
            scores = logp[q, : k + 1] - (logp[q, k + 1] if tail else 0.0)
            candidates = [self._candidate(int(i), firsts[q]) for i in support[row, position]]
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

    def teacher_ids(
        self, best: np.ndarray, tails: list[bytes], own: np.ndarray, firsts: list[bool] | None = None
    ) -> np.ndarray:
        """``[n, K]``: each position's support, the student tokens that start the teacher's
        ``from_teacher`` likeliest next tokens (:meth:`start`; distinct, the teacher's order,
        a token no student token starts skipped) and then the student's own top ids ``own``
        ``[n, K]`` not among them, in the student's order, K in all.

        ``best`` ``[n, m]``: the teacher's likeliest next ids at each position's context,
        likeliest first (:meth:`PrefixTrees.top`; ``m = 4 · from_teacher`` of them);
        ``firsts``: the positions before the answer's first byte (a SentencePiece student
        starts its text with a space its decoder drops: :meth:`start`'s ``lead``)."""
        n, k = own.shape
        lead = b" " if self.tokens.student_bytes.strips_leading_space else b""
        out = np.empty_like(own)
        for i in range(n):
            chosen: list[int] = []
            for j in best[i].tolist():
                start = self.start(int(j), tails[i], lead if firsts and firsts[i] else b"")
                if start >= 0 and start not in chosen:
                    chosen.append(start)
                    if len(chosen) == self.from_teacher:
                        break
            out[i] = (chosen + [int(s) for s in own[i] if int(s) not in chosen])[:k]
        return out

    def start(self, teacher_id: int, tail: bytes = b"", lead: bytes = b"") -> int:
        """The student token that starts teacher token ``teacher_id`` written after ``tail``
        (the answer's bytes past the context): its longest student prefix after ``tail``,
        ``lead`` put before it (a SentencePiece student's leading space, tried first); the
        student's EOS for the teacher's; −1 for none (a special, a token that does not
        continue ``tail``, an id past the teacher's tokenizer)."""
        if not tail and not lead:
            return int(self.starts[teacher_id]) if teacher_id < self.starts.size else -1
        pieces = self.tokens.teacher_bytes.pieces
        if teacher_id == self.tokens.teacher_eos:
            return self.tokens.student_eos[0] if not tail else -1
        if teacher_id >= len(pieces) or teacher_id in self.tokens.teacher_bytes.special:
            return -1
        piece = pieces[teacher_id]
        if not piece.startswith(tail) or not piece[len(tail) :]:
            return -1
        with_lead = self._longest_student_prefix(lead + piece[len(tail) :]) if lead else -1
        if with_lead >= 0 and len(self.tokens.student_bytes.pieces[with_lead]) > len(lead):  # more than the lead
            return with_lead
        return self._longest_student_prefix(piece[len(tail) :])

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


def _after(tail: bytes, candidate: Candidate) -> Candidate:
    """``candidate`` scored after ``tail``: their bytes joined; a teacher id cannot follow a
    partial character (b'': not scored)."""
    if isinstance(candidate, bytes):
        return tail + candidate if candidate else b""
    return candidate if not tail else b""
