"""What a named estimator is (:class:`EstimatorSpec`): what it reads besides the sampled
tokens and their log μ, and its adapter (:data:`EstimatorFn`); the table of them is
:data:`asyncopd_jax.estimator_registry.ESTIMATORS`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import jax

from asyncopd_jax.estimator_inputs import EstimatorInputs

if TYPE_CHECKING:  # the registry defines the config and imports this module
    from asyncopd_jax.estimator_registry import EstimatorConfig

Array = jax.Array

# An adapter: the inputs and the config → per-token losses [B, T].
EstimatorFn = Callable[[EstimatorInputs, "EstimatorConfig"], Array]


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
    """A named estimator: what it reads besides the sampled tokens and their log μ, and
    how to evaluate it.

    Attributes:
      name: its name in :data:`ESTIMATORS`.
      fn: its adapter (a named function of ``(EstimatorInputs, EstimatorConfig)``).
      needs: the id sets the student is scored on, fields of :class:`StudentLogProbs`
        (keys of :data:`~asyncopd_jax.estimator_ids.ID_SOURCES`, which says which setting
        makes each).
      needs_proximal: reads proximal log-probs (a no-grad forward of the weights before
        the batch's first optimizer step).
      needs_advantage: a policy-gradient surrogate weighted by an advantage (a
        stabiliser): the reward's in reward-driven RL, which only these estimators can
        train on, else the teacher's reverse-KL reward.
      needs_teacher_hidden: reads the exact KLs the learner computes from the teacher's
        hidden states (``teacher.payload: hidden``) with the teacher's LM head.
      description: one line for the docs.
      spans: how it compares a student and a teacher of different tokenizers
        (:mod:`asyncopd_jax.estimators.spans`): ``"sum"``, on the sampled tokens' log-probs
        summed over each span (exact: a span is one action); ``"start"``, on the
        teacher's top-K at each span's first token mapped to student ids; None: it cannot
        be made exact across tokenizers (it reads the teacher's log-probs of ids the
        student chose: MC candidates, the student's top-K; or samples the teacher), and a
        run with such a teacher refuses it (:func:`check_cross_tokenizer`).
    """

    name: str
    fn: EstimatorFn
    needs: tuple[str, ...] = ()
    needs_proximal: bool = False
    needs_advantage: bool = False
    needs_teacher_hidden: bool = False
    description: str = ""
    spans: Literal["sum", "start"] | None = None

    def needs_teacher_scores(self, *, rl: bool, distill_coef: float = 0.0) -> bool:
        """Whether it reads the teacher's scores (a :class:`TeacherScoreCache`): always,
        but for an advantage estimator in reward-driven RL (``rl``) without distillation
        (``distill_coef`` β = 0)."""
        return not (rl and self.needs_advantage and distill_coef == 0)
