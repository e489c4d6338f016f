"""What an estimator's adapter reads: the rollout, its teacher scores, and the student's
(and the proximal policy's) log-probs, as one :class:`EstimatorInputs`.

The learner builds it (:func:`asyncopd_jax.estimator_eval.evaluate_estimator`); each
adapter of :data:`asyncopd_jax.estimator_registry.ESTIMATORS` reads it and feeds one pure
function of :mod:`asyncopd_jax.estimators`.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import jax

from asyncopd_jax.cache import RolloutBatch, StudentLogProbs, TeacherScoreCache

Array = jax.Array
_T = TypeVar("_T")


def given(value: _T | None) -> _T:
    """``value``, an optional input that the learner's ``_require_inputs``
    (:mod:`asyncopd_jax.estimator_eval`) has checked is given (the spec's ``needs``
    say which are; a type checker cannot follow that)."""
    if value is None:
        raise ValueError("an input the estimator's spec needs is missing (evaluate_estimator checks them first)")
    return value


@dataclasses.dataclass(frozen=True)
class EstimatorInputs:
    """What an estimator's adapter reads (all ``[B, T]`` or ``[B, T, n]``, see
    :mod:`asyncopd_jax.cache`).

    Attributes:
      batch, cache: the rollout and its teacher scores (``cache`` None: reward-driven RL
        without distillation).
      student: the current student's log-probs on the ids of
        :func:`~asyncopd_jax.estimator_eval.required_ids`.
      proximal: the proximal policy's, for a spec with ``needs_proximal``.
      advantage: ``[B, T]`` detached, for a spec with ``needs_advantage`` (the learner's
        ``_advantage``).
    """

    batch: RolloutBatch
    cache: TeacherScoreCache | None
    student: StudentLogProbs
    proximal: StudentLogProbs | None = None
    advantage: Array | None = None

    @property
    def scores(self) -> TeacherScoreCache:
        """``cache``, for an adapter that reads the teacher's scores."""
        return given(self.cache)
