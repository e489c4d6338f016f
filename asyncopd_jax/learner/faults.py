"""Faults at run time: non-finite inputs drop their rows; a non-finite step stops the run.

Two kinds of NaN / inf reach a learner in a long run, and they call for opposite answers:

* **In the data** — a teacher that overflows on one sequence, a corrupted rollout record:
  one sample is bad, the rest of the batch is fine. :func:`drop_nonfinite_rows` gives that
  sample's tokens zero weight (the token mean is over the remaining tokens) and replaces
  the non-finite values by 0, because a masked-out NaN still poisons the gradient through
  ``0 · NaN = NaN`` in the backward pass of ``where`` / ``exp``. The train step counts the
  dropped rows (metric ``nonfinite_rows``) and the run goes on.
* **In the learner** — a loss, gradient or update that is not finite: the weights have
  diverged (or are about to). The jitted train step then leaves the state as it was
  (:func:`asyncopd_jax.learner.step.make_train_step`), and the trainer raises
  :class:`NonFiniteLoss` at once, naming the step and the last good checkpoint, before
  anything of that step is checkpointed or published.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from asyncopd_jax.cache import TeacherScoreCache

if TYPE_CHECKING:  # step.py imports this module
    from asyncopd_jax.learner.step import LearnerBatch

Array = jax.Array

# The float fields of a rollout that a loss reads. ``student_topk_behavior_logp`` is left out
# on purpose: with top-k / top-p or greedy sampling, the student's top-K ids outside the
# kept set have log μ = −inf legitimately, and no estimator reads it.
ROLLOUT_FIELDS: tuple[str, ...] = ("behavior_logp", "candidate_behavior_logp", "advantages", "reference_logp")
# Every score field of the teacher cache (the ``*_ids`` fields are integers, ``span_end`` a mask).
CACHE_FIELDS: tuple[str, ...] = tuple(
    f.name
    for f in dataclasses.fields(TeacherScoreCache)
    if not f.name.endswith("_ids") and f.name not in ("span_end", "teacher_index")  # ids and flags: not scores
)
# Fields where log q = −inf is a value, not a fault, in a cache of a teacher of another
# tokenizer: its top-K mapped to the student's ids holds −inf for an id no student token spells.
SPAN_CACHE_NEGINF: tuple[str, ...] = ("topk_logp",)
# The step's metrics that must be finite for its update to be applied (see step._apply).
STEP_FINITE_METRICS: tuple[str, ...] = ("loss", "grad_norm", "update_norm")


class NonFiniteLoss(ValueError):
    """A train step's loss, gradient or update was NaN or inf; the run stopped there.

    A ValueError so that the command line prints it as one line."""


def _checked(batch: LearnerBatch) -> dict[str, dict[str, Array]]:
    """The present fields :func:`nonfinite_rows` checks, by owner (``"rollout"``,
    ``"cache"``) and name."""
    owners = {"rollout": ROLLOUT_FIELDS, "cache": CACHE_FIELDS if batch.cache is not None else ()}
    return {
        owner: {
            name: getattr(getattr(batch, owner), name)
            for name in names
            if getattr(getattr(batch, owner), name) is not None
        }
        for owner, names in owners.items()
    }


def _wrong(batch: LearnerBatch, owner: str, name: str, value: Array) -> Array:
    """Where ``value`` (field ``name`` of ``owner``) is a fault: NaN or ±inf, but for −inf
    where a span cache holds it as a value (:data:`SPAN_CACHE_NEGINF`)."""
    spans = owner == "cache" and batch.cache is not None and batch.cache.span_end is not None
    if spans and name in SPAN_CACHE_NEGINF:
        return jnp.isnan(value) | (value == jnp.inf)
    return ~jnp.isfinite(value)


def nonfinite_rows(batch: LearnerBatch) -> Array:
    """``[B]`` bool: rows with a NaN or inf on one of their real response tokens.

    Checks the behaviour log-probs (``behavior_logp`` ``[B, T]``,
    ``candidate_behavior_logp`` ``[B, T, N]``), the RL ``advantages`` ``[B, T]`` and every
    score field of the teacher cache (``token_logp`` ``[B, T]``; ``candidate_logp``,
    ``student_topk_logp``, ``topk_logp``, ``sample_logp`` ``[B, T, K]``). Values on padding
    positions (``response_mask`` False) do not count: the loss never weighs them.
    """
    mask = jnp.asarray(batch.rollout.response_mask, bool)  # [B, T]
    bad = jnp.zeros(mask.shape, bool)
    for owner, fields in _checked(batch).items():
        for name, value in fields.items():
            wrong = _wrong(batch, owner, name, value)
            bad = bad | (wrong if wrong.ndim == mask.ndim else jnp.any(wrong, axis=-1))  # [B, T, K] → [B, T]
    return jnp.any(bad & mask, axis=-1)


def drop_nonfinite_rows(batch: LearnerBatch) -> tuple[LearnerBatch, Array]:
    """``batch`` without its non-finite rows, and the ``[B]`` bool mask of those rows.

    Pure (jit-able, shape-preserving): a dropped row keeps its place with
    ``response_mask`` all False, so the token mean of any loss is over the remaining
    tokens. Every non-finite value of the checked fields (:func:`nonfinite_rows`), in
    dropped rows and on padding alike, becomes 0: masked-out NaNs would otherwise leak
    into the gradients (the backward pass of a masked NaN is ``0 · NaN = NaN``). A batch
    with nothing non-finite comes back with the same values.
    """
    dropped = nonfinite_rows(batch)  # [B]
    clean = {
        owner: {
            name: jnp.where(_wrong(batch, owner, name, value), jnp.zeros((), value.dtype), value)
            for name, value in fields.items()
        }
        for owner, fields in _checked(batch).items()
    }
    mask = jnp.asarray(batch.rollout.response_mask, bool) & ~dropped[:, None]
    rollout = dataclasses.replace(
        batch.rollout, response_mask=mask.astype(batch.rollout.response_mask.dtype), **clean["rollout"]
    )
    cache = None if batch.cache is None else dataclasses.replace(batch.cache, **clean["cache"])
    return dataclasses.replace(batch, rollout=rollout, cache=cache), dropped


def step_is_finite(metrics: dict[str, float]) -> bool:
    """Whether a train step's update was applied: its loss, ``grad_norm`` and
    ``update_norm`` are finite (the predicate the jitted step uses to keep or skip it)."""
    return all(math.isfinite(float(metrics[k])) for k in STEP_FINITE_METRICS if k in metrics)


def nonfinite_step_error(
    step: int, metrics: dict[str, float], last_checkpoint: tuple[int, Path] | None
) -> NonFiniteLoss:
    """The one-line error for optimizer step ``step`` (1-based, as in metrics.jsonl)."""
    values = ", ".join(f"{k} = {float(metrics[k])}" for k in STEP_FINITE_METRICS if k in metrics)
    where = (
        "no checkpoint yet"
        if last_checkpoint is None
        else f"last good checkpoint: {last_checkpoint[1]} (step {last_checkpoint[0]})"
    )
    return NonFiniteLoss(
        f"training diverged at step {step}: {values}; the update was not applied and nothing from this step was "
        f"checkpointed or published; {where}"
    )


__all__ = [
    "CACHE_FIELDS",
    "NonFiniteLoss",
    "ROLLOUT_FIELDS",
    "STEP_FINITE_METRICS",
    "drop_nonfinite_rows",
    "nonfinite_rows",
    "nonfinite_step_error",
    "step_is_finite",
]
