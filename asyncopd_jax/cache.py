"""The data contracts between rollout, teacher and learner.

* :class:`RolloutBatch` — what the student's sampler produced.
* :class:`TeacherScoreCache` — the finite score cache the teacher keeps per position.
* :class:`StudentLogProbs` — the learner's current log-probs on the cached ids.

:mod:`asyncopd_jax.estimator_eval` evaluates the estimators by name on these three.

All per-position arrays are response-local and target-aligned: ``[B, T]`` (one value
per response token), ``[B, T, N]`` / ``[B, T, K]`` (several ids per response token);
index t describes the distribution of response token t given the prompt and the
response tokens before it. The classes are frozen dataclasses registered as JAX
pytrees (optional fields may be ``None``), so they pass through ``jit``, ``vmap`` and
``device_put``; they check their shapes on construction and name the field at fault.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp

Array = jax.Array


def _is_array_like(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _check_shapes(obj: Any, lead_field: str, per_token: tuple[str, ...], per_id: tuple[tuple[str, ...], ...]) -> None:
    """Check ``per_token`` fields have ``lead``'s shape and each group in ``per_id`` is ``lead + (n,)``.

    Skipped when the leaves are not arrays (JAX rebuilds pytrees with placeholder
    leaves internally). Only relative shapes are checked, so ``vmap`` still works.
    """
    name = type(obj).__name__
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    present = [v for v in values.values() if v is not None]
    if not all(_is_array_like(v) for v in present):
        return
    lead = tuple(values[lead_field].shape)
    if len(lead) < 1:
        raise ValueError(f"{name}.{lead_field} must have shape [B, T], got {lead}")
    for field in per_token:
        value = values[field]
        if value is not None and tuple(value.shape) != lead:
            raise ValueError(f"{name}.{field} must have shape {list(lead)} like {lead_field}, got {list(value.shape)}")
    for group in per_id:
        shapes = {f: tuple(values[f].shape) for f in group if values[f] is not None}
        if shapes and len(shapes) != len(group):
            missing = [f for f in group if values[f] is None]
            raise ValueError(f"{name}: {', '.join(group)} go together; missing {', '.join(missing)}")
        for field, shape in shapes.items():
            if len(shape) != len(lead) + 1 or shape[:-1] != lead:
                raise ValueError(
                    f"{name}.{field} must have shape {list(lead)} + [n] (ids per position), got {list(shape)}"
                )
        if len({s[-1] for s in shapes.values()}) > 1:
            raise ValueError(f"{name}: {', '.join(group)} disagree on the number of ids: {shapes}")


def _pytree(cls):
    """Register a frozen dataclass as a pytree whose fields are all children."""
    fields = [f.name for f in dataclasses.fields(cls)]
    return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])


@_pytree
@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    """What the student's sampler produced for B prompts.

    Attributes:
      prompt_tokens: ``[B, P]`` int32, left-padded prompts.
      prompt_mask: ``[B, P]`` bool, True on real prompt tokens.
      response_tokens: ``[B, T]`` int32, right-padded responses (EOS included).
      response_mask: ``[B, T]`` bool, True on real response tokens (EOS included).
      behavior_logp: ``[B, T]`` fp32, log μ of each response token under the
        distribution actually sampled from (temperature applied, nothing truncated).
      token_version: ``[B, T]`` int32, policy version (optimizer step) of the weights
        that sampled each token; a response can span several versions.
      candidate_ids: ``[B, T, N]`` int32 or None, Monte-Carlo candidates drawn from μ.
      candidate_behavior_logp: ``[B, T, N]`` fp32 or None, log μ of the candidates.
      student_topk_ids: ``[B, T, K]`` int32 or None, the sampling student's top-K ids.
      student_topk_behavior_logp: ``[B, T, K]`` fp32 or None, log μ of those ids (same
        distribution as ``behavior_logp``: temperature applied).
      advantages: ``[B, T]`` fp32 or None (reward-driven RL only): each response's
        group-relative reward advantage, the same on all its tokens, filled in by the
        reward stage (:mod:`asyncopd_jax.pipeline.reward_stage`).
      reference_logp: ``[B, T]`` fp32 or None: log π_ref of each response token under a
        fixed reference policy (e.g. the starting student) at the sampling temperature, for
        a KL-to-reference term; filled in by the scoring stage
        (:class:`asyncopd_jax.teacher.ReferenceScorer`).
      environment_mask: ``[B, T]`` bool or None (single-turn): True on the tokens an
        environment wrote into a multi-turn trajectory (a tool's observation). They are
        context for the student and the teacher (:attr:`context_mask`) and outside
        ``response_mask``, so outside every loss, metric and denominator.
      tool_calls: ``[B]`` int32 or None (single-turn): the tool calls each trajectory made.
      tool_errors: ``[B]`` int32 or None: its observations that reported an error.
      environment_seconds: ``[B]`` fp32 or None: the time its environment steps took.
      environment_blocked_seconds: ``[B]`` fp32 or None: of that time, what the rollout
        spent blocked on environments with nothing to decode (the rest overlapped decoding).
    """

    prompt_tokens: Array
    prompt_mask: Array
    response_tokens: Array
    response_mask: Array
    behavior_logp: Array
    token_version: Array
    candidate_ids: Array | None = None
    candidate_behavior_logp: Array | None = None
    student_topk_ids: Array | None = None
    student_topk_behavior_logp: Array | None = None
    advantages: Array | None = None
    reference_logp: Array | None = None
    environment_mask: Array | None = None
    tool_calls: Array | None = None
    tool_errors: Array | None = None
    environment_seconds: Array | None = None
    environment_blocked_seconds: Array | None = None

    @staticmethod
    def axis(field: str) -> Literal["prompt", "response", "row"]:
        """What field ``field``'s second axis runs over: the prompt's slots (``[B, P]``), the
        response's (``[B, T, ...]``), or none (``[B]``: a row's episode figures)."""
        if field.startswith("prompt_"):
            return "prompt"
        rows = ("tool_calls", "tool_errors", "environment_seconds", "environment_blocked_seconds")
        return "row" if field in rows else "response"

    def __post_init__(self) -> None:
        _check_shapes(
            self,
            "response_tokens",
            ("response_mask", "behavior_logp", "token_version", "advantages", "reference_logp", "environment_mask"),
            (("candidate_ids", "candidate_behavior_logp"), ("student_topk_ids", "student_topk_behavior_logp")),
        )
        if _is_array_like(self.prompt_tokens) and _is_array_like(self.response_tokens):
            p, m, r = self.prompt_tokens.shape, self.prompt_mask.shape, self.response_tokens.shape
            if tuple(p) != tuple(m) or tuple(p[:-1]) != tuple(r[:-1]):
                raise ValueError(
                    f"RolloutBatch.prompt_tokens {list(p)} and prompt_mask {list(m)} must share a shape "
                    f"[B, P] with B from response_tokens {list(r)}"
                )

    @property
    def context_mask(self) -> Array:
        """``[B, T]`` bool: the response slots the models read as context, the student's
        tokens (``response_mask``) and an environment's (``environment_mask``)."""
        mask = jnp.asarray(self.response_mask, bool)
        return mask if self.environment_mask is None else mask | jnp.asarray(self.environment_mask, bool)

    @property
    def oldest_version(self) -> Array:
        """``[B]`` the oldest policy version among each response's tokens: the student's
        (``response_mask``), so a multi-turn trajectory is as stale as its oldest student
        turn's oldest token; its environment tokens were written by no policy."""
        big = jnp.iinfo(jnp.int32).max
        return jnp.min(jnp.where(self.response_mask, self.token_version, big), axis=-1)

    @property
    def newest_version(self) -> Array:
        """``[B]`` the newest policy version among each response's (student) tokens."""
        return jnp.max(jnp.where(self.response_mask, self.token_version, -1), axis=-1)


@_pytree
@dataclasses.dataclass(frozen=True)
class TeacherScoreCache:
    """The teacher's finite score cache: log-probs on a few ids per response position.

    Attributes:
      token_logp: ``[B, T]`` log q of the sampled response tokens.
      candidate_logp: ``[B, T, N]`` or None, log q of the rollout's MC candidates.
      student_topk_logp: ``[B, T, K]`` or None, log q on the student's top-K support.
      topk_ids: ``[B, T, Kq]`` or None, the teacher's own top-K ids.
      topk_logp: ``[B, T, Kq]`` or None, their log q.
      sample_ids: ``[B, T, M]`` or None, ids sampled from q (forward-KL MC).
      sample_logp: ``[B, T, M]`` or None, their log q.
      span_end: ``[B, T]`` bool or None. None: the teacher shares the student's
        tokenizer, and every field is per student token as above. Set: a teacher of another
        tokenizer, aligned by text spans (:mod:`asyncopd_jax.teacher.span_alignment`); True on the
        last student token of each span the teacher scored. ``token_logp`` then holds log q
        of the whole span on that token (0 elsewhere), and ``topk_ids`` / ``topk_logp`` the
        teacher's next-token top-K at each span's first token, mapped to the student ids of
        the same text (log q −inf: none; −inf off the span starts). The estimators read
        it through :mod:`asyncopd_jax.estimators.spans`.
      hidden: ``[B, T, H_q]`` or None: the teacher's final hidden states at the response
        positions, target-aligned (row t is what the teacher's LM head reads to predict
        response token t), with ``teacher.payload: hidden``; the learner applies the
        teacher's head to them (:mod:`asyncopd_jax.estimators.dense_from_hidden`).
        Several teachers' are padded with zeros to the widest.
      teacher_index: ``[B, T]`` int32 or None: with ``hidden`` and several teachers, each
        row's teacher (an index into the run's teachers, the same along the row): whose
        head reads its hidden states. None: the only teacher's.
    """

    token_logp: Array
    candidate_logp: Array | None = None
    student_topk_logp: Array | None = None
    topk_ids: Array | None = None
    topk_logp: Array | None = None
    sample_ids: Array | None = None
    sample_logp: Array | None = None
    span_end: Array | None = None
    hidden: Array | None = None
    teacher_index: Array | None = None

    def __post_init__(self) -> None:
        _check_shapes(
            self,
            "token_logp",
            ("span_end", "teacher_index"),
            (
                ("candidate_logp",),
                ("student_topk_logp",),
                ("topk_ids", "topk_logp"),
                ("sample_ids", "sample_logp"),
                ("hidden",),  # [B, T, H_q]: the same [B, T] + [n] shape rule
            ),
        )


@_pytree
@dataclasses.dataclass(frozen=True)
class StudentLogProbs:
    """The learner's log-probs on the cached ids (same shapes as the ids they score).

    Attributes:
      token: ``[B, T]`` on the sampled response tokens.
      candidates: ``[B, T, N]`` or None, on ``RolloutBatch.candidate_ids``.
      student_topk: ``[B, T, K]`` or None, on ``RolloutBatch.student_topk_ids``.
      teacher_topk: ``[B, T, Kq]`` or None, on ``TeacherScoreCache.topk_ids``.
      teacher_samples: ``[B, T, M]`` or None, on ``TeacherScoreCache.sample_ids``.
      entropy: ``[B, T]`` or None, the entropy of the student's distribution at each
        position (from the same fused pass).
      forward_kl, reverse_kl: ``[B, T]`` or None, the exact KL(q ‖ π_θ) and KL(π_θ ‖ q)
        over the whole vocabulary, from the student's hidden states and the teacher's in
        ``TeacherScoreCache.hidden`` (:func:`~asyncopd_jax.estimators.dense_kls_from_hidden`).
    """

    token: Array
    candidates: Array | None = None
    student_topk: Array | None = None
    teacher_topk: Array | None = None
    teacher_samples: Array | None = None
    entropy: Array | None = None
    forward_kl: Array | None = None
    reverse_kl: Array | None = None

    def __post_init__(self) -> None:
        _check_shapes(
            self,
            "token",
            ("entropy", "forward_kl", "reverse_kl"),
            (("candidates",), ("student_topk",), ("teacher_topk",), ("teacher_samples",)),
        )
