"""Estimators by name: their settings, what each one needs, and how to evaluate it.

The learner, the config and the studies refer to an estimator by its name (e.g.
``"reverse_kl_mc"``), configured by one :class:`EstimatorConfig` (the ``estimator``
section of a run's config). Each :class:`EstimatorSpec` declares what the estimator reads
besides the sampled tokens (the id sets of :data:`~asyncopd_jax.estimator_ids.ID_SOURCES`
and the config setting that makes each, proximal log-probs, an advantage), and its adapter
evaluates the pure function of :mod:`asyncopd_jax.estimators` on the data contracts of
:mod:`asyncopd_jax.cache` (:class:`~asyncopd_jax.estimator_inputs.EstimatorInputs`; the
learner's :func:`~asyncopd_jax.estimator_eval.evaluate_estimator` runs it). The
config's validation, the scoring stage and the learner all ask the spec: no list of names
to keep in step.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax

from asyncopd_jax import estimators as est
from asyncopd_jax.config_checks import check_fields
from asyncopd_jax.estimator_inputs import EstimatorInputs, given
from asyncopd_jax.estimator_spec import EstimatorFn, EstimatorSpec
from asyncopd_jax.estimators.stabilisers import ClipEps, clip_bounds

Array = jax.Array


def _clip_range_ok(clip_eps: ClipEps | None) -> bool:
    """Whether the stabilisers accept ``clip_eps`` (None: no clip); they check it again
    when traced, which is too late for a config."""
    if clip_eps is None:
        return True
    try:
        clip_bounds(clip_eps)
    except (TypeError, ValueError):  # out of range, or a list of other than two numbers
        return False
    return True


_CLIP_RANGE = "ε with 0 <= ε < 1, or [ε_low, ε_high] with 0 <= ε_low < 1 and ε_high >= 0"


@dataclasses.dataclass(frozen=True)
class MCConfig:
    """``estimator.mc``: the reverse-KL Monte-Carlo estimators (``reverse_kl_mc``,
    ``reverse_kl_mc_stale``, ``reverse_kl_pg``, ``reverse_kl_pg_stale``).

    Attributes:
      clip_eps: PPO-style clip of the MC importance ratio: ``ε`` or ``(ε_low, ε_high)``;
        None: no clip.
      importance_sampling: weight MC candidates by ``π_θ / μ``; False treats μ's draws as
        if from π_θ (biased under staleness: for the studies).
    """

    clip_eps: ClipEps | None = None
    importance_sampling: bool = True

    def __post_init__(self) -> None:
        check_fields(
            "estimator.mc", [("clip_eps", self.clip_eps, _clip_range_ok(self.clip_eps), f"null, {_CLIP_RANGE}")]
        )


@dataclasses.dataclass(frozen=True)
class ForwardMCConfig:
    """``estimator.forward_mc``: ``forward_kl_mc``.

    Attributes:
      control_variate: use the k3 form of the estimator.
    """

    control_variate: bool = False


@dataclasses.dataclass(frozen=True)
class TopKConfig:
    """``estimator.topk``: the top-K estimators (``forward_kl_topk``, ``reverse_kl_topk``).

    Attributes:
      tail: add the tail bucket (the mass outside the K ids).
    """

    tail: bool = True


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """``estimator.ppo``: the PPO-style losses (``ppo_clip``, ``decoupled_ppo``; ``dual_clip``
    also ``second_moment_clip``'s).

    Attributes:
      clip_eps: the clip range: ``ε`` or ``(ε_low, ε_high)``.
      dual_clip: dual-clip constant ``c > 1``, or None.
      behavior_weight_cap: decoupled PPO's cap on ``π_prox / μ``.
      behavior_weight_mode: what that cap does: mask the token (``"mask"``) or clamp the
        weight (``"truncate"``).
      behavior_weight_floor: decoupled PPO masks tokens whose ``π_prox / μ`` is below it.
    """

    clip_eps: ClipEps = 0.2
    dual_clip: float | None = None
    behavior_weight_cap: float | None = 5.0
    behavior_weight_mode: Literal["mask", "truncate"] = "mask"
    behavior_weight_floor: float | None = None

    def __post_init__(self) -> None:
        floor, cap = self.behavior_weight_floor, self.behavior_weight_cap
        check_fields(
            "estimator.ppo",
            [
                ("clip_eps", self.clip_eps, _clip_range_ok(self.clip_eps), _CLIP_RANGE),
                (
                    "behavior_weight_floor",
                    floor,
                    floor is None or 0 <= floor < (cap or float("inf")),
                    "null, or >= 0 and below estimator.ppo.behavior_weight_cap",
                ),
            ],
        )


@dataclasses.dataclass(frozen=True)
class GSPOConfig:
    """``estimator.gspo``: ``gspo`` and ``gspo_token``.

    Attributes:
      clip_low, clip_high: the clip range ``(ε_low, ε_high)`` of the sequence ratio.
    """

    clip_low: float = 3e-4
    clip_high: float = 4e-4

    def __post_init__(self) -> None:
        check_fields(
            "estimator.gspo",
            [
                ("clip_low", self.clip_low, 0 <= self.clip_low < 1, "0 <= ε_low < 1"),
                ("clip_high", self.clip_high, self.clip_high >= 0, ">= 0"),
            ],
        )


@dataclasses.dataclass(frozen=True)
class TISConfig:
    """``estimator.tis``: ``truncated_is``.

    Attributes:
      cap: the cap of the truncated importance weights.
    """

    cap: float = 2.0


@dataclasses.dataclass(frozen=True)
class M2POConfig:
    """``estimator.m2po``: ``m2po``.

    Attributes:
      budget: the second-moment budget τ_M2.
    """

    budget: float = 0.04

    def __post_init__(self) -> None:
        check_fields("estimator.m2po", [("budget", self.budget, self.budget >= 0, ">= 0")])


@dataclasses.dataclass(frozen=True)
class SecondMomentClipConfig:
    """``estimator.second_moment_clip``: ``second_moment_clip`` (its dual clip is
    ``estimator.ppo.dual_clip``).

    Attributes:
      budget: the second-moment budget that sets the clip range.
      min_low, min_high: the floors of the range's low and high margins.
    """

    budget: float = 0.04
    min_low: float = 0.3
    min_high: float = 0.5


@dataclasses.dataclass(frozen=True)
class RegularisersConfig:
    """``estimator.regularisers``: terms added to every token's loss, whatever the estimator
    (:func:`~asyncopd_jax.estimator_eval.evaluate_estimator` adds them).

    Attributes:
      entropy_coef: weight c of the entropy bonus ``−c · H(π_θ)`` (0: none; the entropy is
        a metric either way).
      reference_kl_coef, reference_kl: weight and estimator (k1 / k2 / k3) of a
        KL(π_θ ‖ π_ref) term, on ``RolloutBatch.reference_logp`` (0: none; π_ref: the run's
        ``reference`` model).
    """

    entropy_coef: float = 0.0
    reference_kl_coef: float = 0.0
    reference_kl: est.ReferenceKL = "k3"

    def __post_init__(self) -> None:
        check_fields(
            "estimator.regularisers",
            [
                (
                    "reference_kl_coef",
                    self.reference_kl_coef,
                    self.reference_kl_coef >= 0,
                    ">= 0 (0: no KL-to-reference term)",
                )
            ],
        )


@dataclasses.dataclass(frozen=True)
class EstimatorConfig:
    """The estimator and its knobs: the ``estimator`` section of a run's config (hashable,
    so it can be a static jit argument). The knobs are grouped by what reads them, one
    sub-section each; every field is checked on construction.

    Attributes:
      name: one of :data:`ESTIMATORS`.
      aggregation: how per-token losses become the loss (verl's ``loss_agg_mode`` names;
        see :mod:`asyncopd_jax.estimators.reductions`).
      stabiliser_signal: the teacher reward the advantage estimators (``needs_advantage``)
        use as advantage in distillation: ``"stale"`` = ``log q − log μ`` fixed at rollout
        time (the async-RL practice), ``"recompute"`` = ``log q − log π_θ`` at learner time.
      check_inputs: add ``checkify`` checks that every log-prob the estimator is given is a
        log-prob (:mod:`asyncopd_jax.estimators.checks`; a debug mode: the learner then
        checks each step's error on the host).
      mc, forward_mc, topk, ppo, gspo, tis, m2po, second_moment_clip: the knobs of the
        estimators that read them (each class says which).
      regularisers: the entropy bonus and KL-to-reference term added to every estimator.

    The RL weight β of the teacher's signal (``rl.distill_coef``) is not a knob of the
    estimator but of the run: the loss takes it beside this config
    (:func:`~asyncopd_jax.estimator_eval.evaluate_estimator`).
    """

    name: str = "reverse_kl_mc"
    aggregation: est.Aggregation = "token-mean"
    stabiliser_signal: Literal["stale", "recompute"] = "stale"
    check_inputs: bool = False
    mc: MCConfig = MCConfig()
    forward_mc: ForwardMCConfig = ForwardMCConfig()
    topk: TopKConfig = TopKConfig()
    ppo: PPOConfig = PPOConfig()
    gspo: GSPOConfig = GSPOConfig()
    tis: TISConfig = TISConfig()
    m2po: M2POConfig = M2POConfig()
    second_moment_clip: SecondMomentClipConfig = SecondMomentClipConfig()
    regularisers: RegularisersConfig = RegularisersConfig()

    def __post_init__(self) -> None:
        check_fields("estimator", [("name", self.name, self.name in ESTIMATORS, ", ".join(sorted(ESTIMATORS)))])

    @property
    def spec(self) -> EstimatorSpec:
        """The named estimator's spec."""
        return ESTIMATORS[self.name]

    @property
    def needs_reference_logp(self) -> bool:
        """Whether the loss has a KL-to-reference term, read on ``RolloutBatch.reference_logp``."""
        return self.regularisers.reference_kl_coef != 0


# --- the adapters: each feeds one function of asyncopd_jax.estimators ---------------


def _forward_kl_topk(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.forward_kl_topk(given(x.student.teacher_topk), given(x.scores.topk_logp), tail=c.topk.tail)


def _forward_kl_topk_renormalized(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.forward_kl_topk_renormalized(given(x.student.teacher_topk), given(x.scores.topk_logp))


def _forward_kl_mc(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.forward_kl_mc(
        given(x.student.teacher_samples), given(x.scores.sample_logp), control_variate=c.forward_mc.control_variate
    )


def _forward_kl_dense(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return given(x.student.forward_kl)


def _reverse_kl_dense(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return given(x.student.reverse_kl)


def _reverse_kl_topk(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.reverse_kl_topk(given(x.student.student_topk), given(x.scores.student_topk_logp), tail=c.topk.tail)


def _mc(student: Array, behavior: Array, teacher: Array, c: EstimatorConfig, *, recompute: bool) -> Array:
    """``reverse_kl_mc`` on ``[B, T, n]`` draws of μ, with the config's IS and clip."""
    return est.reverse_kl_mc(
        student,
        behavior,
        teacher,
        recompute=recompute,
        importance_sampling=c.mc.importance_sampling,
        clip_eps=c.mc.clip_eps,
    )


def _candidates(x: EstimatorInputs) -> tuple[Array, Array, Array]:
    """``(log π_θ, log μ, log q)`` ``[B, T, N]`` of the rollout's N candidates."""
    return (given(x.student.candidates), given(x.batch.candidate_behavior_logp), given(x.scores.candidate_logp))


def _reverse_kl_mc(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return _mc(*_candidates(x), c, recompute=True)


def _reverse_kl_mc_stale(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return _mc(*_candidates(x), c, recompute=False)


def _reverse_kl_mc_loo(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.reverse_kl_mc_loo(*_candidates(x))


def _reverse_kl_hybrid(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    b, s = x.batch, x.student
    return est.reverse_kl_hybrid(
        given(s.student_topk),
        given(x.scores.student_topk_logp),
        given(b.student_topk_ids),
        *_candidates(x),
        given(b.candidate_ids),
    )


def _reverse_kl_pg(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    # the emitted token as the one MC draw
    return _mc(
        x.student.token[..., None], x.batch.behavior_logp[..., None], x.scores.token_logp[..., None], c, recompute=True
    )


def _reverse_kl_pg_stale(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return _mc(
        x.student.token[..., None], x.batch.behavior_logp[..., None], x.scores.token_logp[..., None], c, recompute=False
    )


def _ppo_clip(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.ppo_clip_loss(
        x.student.token, x.batch.behavior_logp, given(x.advantage), clip_eps=c.ppo.clip_eps, dual_clip=c.ppo.dual_clip
    )


def _decoupled_ppo(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.decoupled_ppo_loss(
        x.student.token,
        given(x.proximal).token,
        x.batch.behavior_logp,
        given(x.advantage),
        clip_eps=c.ppo.clip_eps,
        dual_clip=c.ppo.dual_clip,
        behavior_weight_cap=c.ppo.behavior_weight_cap,
        behavior_weight_mode=c.ppo.behavior_weight_mode,
        behavior_weight_floor=c.ppo.behavior_weight_floor,
    )


def _gspo_at(level: Literal["sequence", "token"]) -> EstimatorFn:
    """GSPO's adapter with its ratio per sequence (GSPO) or per token (GSPO-token)."""

    def gspo(x: EstimatorInputs, c: EstimatorConfig) -> Array:
        return est.gspo_loss(
            x.student.token,
            x.batch.behavior_logp,
            given(x.advantage),
            x.batch.response_mask,
            clip_eps=(c.gspo.clip_low, c.gspo.clip_high),
            level=level,
        )

    return gspo


def _truncated_is(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.truncated_is_loss(x.student.token, x.batch.behavior_logp, given(x.advantage), cap=c.tis.cap)


def _m2po(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.m2po_loss(
        x.student.token,
        x.batch.behavior_logp,
        given(x.advantage),
        x.batch.response_mask,
        second_moment_budget=c.m2po.budget,
    )


def _second_moment_clip(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.second_moment_clip_loss(
        x.student.token,
        x.batch.behavior_logp,
        given(x.advantage),
        x.batch.response_mask,
        second_moment_budget=c.second_moment_clip.budget,
        min_low_margin=c.second_moment_clip.min_low,
        min_high_margin=c.second_moment_clip.min_high,
        dual_clip=c.ppo.dual_clip,
    )


ESTIMATORS: dict[str, EstimatorSpec] = {
    spec.name: spec
    for spec in [
        EstimatorSpec(
            "forward_kl_topk",
            _forward_kl_topk,
            ("teacher_topk",),
            description="KL(teacher‖student) on the teacher's top-K ids",
            spans="start",
        ),
        EstimatorSpec(
            "forward_kl_topk_renormalized",
            _forward_kl_topk_renormalized,
            ("teacher_topk",),
            description="KL(teacher‖student), both renormalised over the teacher's top-K ids (Tunix's distill_top_k)",
            spans="start",
        ),
        EstimatorSpec(
            "forward_kl_dense",
            _forward_kl_dense,
            needs_teacher_hidden=True,
            description="KL(teacher‖student) over the whole vocabulary, from the teacher's hidden states (exact)",
        ),
        EstimatorSpec(
            "reverse_kl_dense",
            _reverse_kl_dense,
            needs_teacher_hidden=True,
            description="KL(student‖teacher) over the whole vocabulary, from the teacher's hidden states (exact)",
        ),
        EstimatorSpec(
            "forward_kl_mc",
            _forward_kl_mc,
            ("teacher_samples",),
            description="KL(teacher‖student), Monte Carlo over teacher samples",
        ),
        EstimatorSpec(
            "reverse_kl_topk",
            _reverse_kl_topk,
            ("student_topk",),
            description="KL(student‖teacher) on the rollout student's top-K ids",
        ),
        EstimatorSpec(
            "reverse_kl_mc",
            _reverse_kl_mc,
            ("candidates",),
            description="KL(student‖teacher), N-sample MC, recompute + importance sampling (unbiased)",
        ),
        EstimatorSpec(
            "reverse_kl_mc_loo",
            _reverse_kl_mc_loo,
            ("candidates",),
            description="as reverse_kl_mc with a leave-one-out baseline over the N candidates (unbiased)",
        ),
        EstimatorSpec(
            "reverse_kl_hybrid",
            _reverse_kl_hybrid,
            ("student_topk", "candidates"),
            description="KL(student‖teacher): exact on the rollout student's top-K, MC + IS outside it (unbiased)",
        ),
        EstimatorSpec(
            "reverse_kl_mc_stale",
            _reverse_kl_mc_stale,
            ("candidates",),
            description="as reverse_kl_mc with the stale signal log μ − log q",
        ),
        EstimatorSpec(
            "reverse_kl_pg",
            _reverse_kl_pg,
            description="KL(student‖teacher), 1 sample (the emitted token), recompute + IS",
            spans="sum",
        ),
        EstimatorSpec(
            "reverse_kl_pg_stale",
            _reverse_kl_pg_stale,
            description="as reverse_kl_pg with the stale signal log μ − log q",
            spans="sum",
        ),
        EstimatorSpec(
            "ppo_clip",
            _ppo_clip,
            needs_advantage=True,
            description="PPO clip on the emitted token, reward log q − log μ",
            spans="sum",
        ),
        EstimatorSpec(
            "decoupled_ppo",
            _decoupled_ppo,
            needs_proximal=True,
            needs_advantage=True,
            description="AReaL decoupled PPO (needs proximal log-probs)",
            spans="sum",
        ),
        EstimatorSpec(
            "gspo",
            _gspo_at("sequence"),
            needs_advantage=True,
            description="GSPO: PPO clip on the response's geometric-mean ratio (aggregate with seq-mean-token-mean)",
            spans="sum",
        ),
        EstimatorSpec(
            "gspo_token",
            _gspo_at("token"),
            needs_advantage=True,
            description="GSPO-token: GSPO's sequence ratio with per-token advantages",
            spans="sum",
        ),
        EstimatorSpec(
            "truncated_is",
            _truncated_is,
            needs_advantage=True,
            description="policy gradient with truncated importance weights",
            spans="sum",
        ),
        EstimatorSpec(
            "m2po",
            _m2po,
            needs_advantage=True,
            description="M2PO: mask the largest squared log-ratios until the batch's second moment is in budget",
            spans="sum",
        ),
        EstimatorSpec(
            "second_moment_clip",
            _second_moment_clip,
            needs_advantage=True,
            description="PPO surrogate with a clip range set by a second-moment budget (not M2PO; E2's earlier arm)",
            spans="sum",
        ),
    ]
}

# The estimators reward-driven RL can train with: those weighting an advantage.
RL_ESTIMATORS: tuple[str, ...] = tuple(name for name, spec in ESTIMATORS.items() if spec.needs_advantage)


# The estimators a teacher of another tokenizer can train with (spec.spans set).
CROSS_TOKENIZER_ESTIMATORS: tuple[str, ...] = tuple(name for name, spec in ESTIMATORS.items() if spec.spans)


def check_cross_tokenizer(name: str, teacher: str) -> None:
    """A ValueError unless estimator ``name`` can compare a student with ``teacher``, a
    teacher of another tokenizer (its spec's ``spans``)."""
    if not get_estimator(name).spans:
        raise ValueError(
            f"estimator {name!r} cannot compare the student with teacher {teacher!r}, whose tokenizer differs (it "
            "reads teacher log-probs of ids the student chose, or teacher samples, which do not map across "
            f"tokenizers); allowed: {', '.join(CROSS_TOKENIZER_ESTIMATORS)}"
        )


def get_estimator(name: str) -> EstimatorSpec:
    """The spec of a named estimator, or a ValueError listing the allowed names."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown estimator {name!r}; allowed: {', '.join(sorted(ESTIMATORS))}") from None
