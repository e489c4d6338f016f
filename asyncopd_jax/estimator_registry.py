"""Estimators by name: their settings, what each one needs, and how to evaluate it.

The learner, the config and the studies refer to an estimator by its name (e.g.
``"reverse_kl_mc"``), configured by one :class:`EstimatorConfig` (the ``estimator``
section of a run's config). Each :class:`EstimatorSpec` declares what the estimator reads
besides the sampled tokens (the id sets of :data:`ID_SOURCES` and the config setting that
makes each, proximal log-probs, an advantage), and evaluates the pure function of
:mod:`asyncopd_jax.estimators` on the data contracts of :mod:`asyncopd_jax.cache`
(:func:`evaluate_estimator`). The config's validation, the scoring stage and the learner
all ask the spec: no list of names to keep in step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import jax
import jax.numpy as jnp

from asyncopd_jax import estimators as est
from asyncopd_jax.cache import RolloutBatch, StudentLogProbs, TeacherScoreCache
from asyncopd_jax.config_checks import check_fields
from asyncopd_jax.estimators.stabilisers import ClipEps, clip_bounds
from asyncopd_jax.metrics import Metrics

if TYPE_CHECKING:  # the config imports this module
    from asyncopd_jax.config import RunConfig

Array = jax.Array
_T = TypeVar("_T")
_O = TypeVar("_O", RolloutBatch, TeacherScoreCache)  # the data contracts an id set is read from


def _given(value: _T | None) -> _T:
    """``value``, an optional input that :func:`_require_inputs` has checked is given (the
    spec's ``needs`` say which are; a type checker cannot follow that)."""
    if value is None:
        raise ValueError("an input the estimator's spec needs is missing (evaluate_estimator checks them first)")
    return value


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
    (:func:`evaluate_estimator` adds them).

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
    estimator but of the run: the loss takes it beside this config (:func:`evaluate_estimator`).
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


@dataclasses.dataclass(frozen=True)
class EstimatorInputs:
    """What an estimator's adapter reads (all ``[B, T]`` or ``[B, T, n]``, see
    :mod:`asyncopd_jax.cache`).

    Attributes:
      batch, cache: the rollout and its teacher scores (``cache`` None: reward-driven RL
        without distillation).
      student: the current student's log-probs on the ids of :func:`required_ids`.
      proximal: the proximal policy's, for a spec with ``needs_proximal``.
      advantage: ``[B, T]`` detached, for a spec with ``needs_advantage`` (:func:`_advantage`).
    """

    batch: RolloutBatch
    cache: TeacherScoreCache | None
    student: StudentLogProbs
    proximal: StudentLogProbs | None = None
    advantage: Array | None = None

    @property
    def scores(self) -> TeacherScoreCache:
        """``cache``, for an adapter that reads the teacher's scores."""
        return _given(self.cache)


# An adapter: the inputs and the config → per-token losses [B, T].
EstimatorFn = Callable[[EstimatorInputs, EstimatorConfig], Array]


class _AttributePath:
    """Stands in for an object to record the attributes a reader follows (:func:`_attribute_path`)."""

    def __init__(self, names: tuple[str, ...] = ()) -> None:
        self._names = names

    def __getattr__(self, name: str) -> _AttributePath:
        return _AttributePath((*self._names, name))


def _attribute_path(read: Callable[[Any], object]) -> str:
    """The dotted attributes a pure attribute reader follows: ``lambda cfg:
    cfg.sampling.num_candidates`` → ``"sampling.num_candidates"``. The reader is typed (a
    type checker checks its attributes), and the name it is shown by is read off it, so the
    two cannot disagree."""
    path = read(_AttributePath())
    if not isinstance(path, _AttributePath) or not path._names:
        raise TypeError(f"{read!r} must only read attributes (e.g. lambda cfg: cfg.sampling.num_candidates)")
    return ".".join(path._names)


@dataclasses.dataclass(frozen=True)
class ArrayField(Generic[_O]):
    """One optional array field of a data contract (:class:`RolloutBatch`,
    :class:`TeacherScoreCache`), by typed reference: ``read`` is the field's accessor,
    ``str()`` names it (e.g. ``RolloutBatch.candidate_ids``)."""

    owner: type[_O]
    read: Callable[[_O], Array | None]
    name: str = dataclasses.field(init=False)  # read off ``read``

    def __post_init__(self) -> None:
        name = _attribute_path(self.read)
        if name not in {f.name for f in dataclasses.fields(self.owner)}:
            raise TypeError(f"{self.owner.__name__} has no field {name!r}")
        object.__setattr__(self, "name", name)

    def __str__(self) -> str:
        return f"{self.owner.__name__}.{self.name}"

    def read_from(self, *objects: object) -> Array | None:
        """The field of whichever of ``objects`` is an ``owner`` (None: none is, or it holds none)."""
        for obj in objects:
            if isinstance(obj, self.owner):
                return self.read(obj)
        return None


@dataclasses.dataclass(frozen=True)
class Setting:
    """A count of the run's config, by typed reference: ``read(cfg)`` its value, ``name`` (and
    ``str()``) its dotted name, as ``--set`` takes it (``sampling.num_candidates``)."""

    read: Callable[[RunConfig], int]
    name: str = dataclasses.field(init=False)  # read off ``read``

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", _attribute_path(self.read))

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class IdSource:
    """Where the ids of one :class:`StudentLogProbs` field come from.

    Attributes:
      ids: the field holding the ids ``[B, T, n]``, of the rollout or of the teacher's cache
        (``ids.owner``).
      scores: the :class:`TeacherScoreCache` field of the teacher's log-probs on them.
      setting: the run config's count that makes the rollout or scoring stage produce
        them; 0 makes none.
    """

    ids: ArrayField[RolloutBatch] | ArrayField[TeacherScoreCache]
    scores: ArrayField[TeacherScoreCache]
    setting: Setting


ID_SOURCES: dict[str, IdSource] = {
    "candidates": IdSource(
        ArrayField(RolloutBatch, lambda b: b.candidate_ids),
        ArrayField(TeacherScoreCache, lambda c: c.candidate_logp),
        Setting(lambda cfg: cfg.sampling.num_candidates),
    ),
    "student_topk": IdSource(
        ArrayField(RolloutBatch, lambda b: b.student_topk_ids),
        ArrayField(TeacherScoreCache, lambda c: c.student_topk_logp),
        Setting(lambda cfg: cfg.sampling.student_topk),
    ),
    "teacher_topk": IdSource(
        ArrayField(TeacherScoreCache, lambda c: c.topk_ids),
        ArrayField(TeacherScoreCache, lambda c: c.topk_logp),
        Setting(lambda cfg: cfg.scoring.topk),
    ),
    "teacher_samples": IdSource(
        ArrayField(TeacherScoreCache, lambda c: c.sample_ids),
        ArrayField(TeacherScoreCache, lambda c: c.sample_logp),
        Setting(lambda cfg: cfg.scoring.num_samples),
    ),
}


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
    """A named estimator: what it reads besides the sampled tokens and their log μ, and
    how to evaluate it.

    Attributes:
      name: its name in :data:`ESTIMATORS`.
      fn: its adapter (a named function of ``(EstimatorInputs, EstimatorConfig)``).
      needs: the id sets the student is scored on, fields of :class:`StudentLogProbs`
        (keys of :data:`ID_SOURCES`, which says which setting makes each).
      needs_proximal: reads proximal log-probs (a no-grad forward of the weights before
        the batch's first optimizer step).
      needs_advantage: a policy-gradient surrogate weighted by an advantage (a
        stabiliser): the reward's in reward-driven RL, which only these estimators can
        train on, else the teacher's reverse-KL reward.
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
    description: str = ""
    spans: Literal["sum", "start"] | None = None

    def needs_teacher_scores(self, *, rl: bool, distill_coef: float = 0.0) -> bool:
        """Whether it reads the teacher's scores (a :class:`TeacherScoreCache`): always,
        but for an advantage estimator in reward-driven RL (``rl``) without distillation
        (``distill_coef`` β = 0)."""
        return not (rl and self.needs_advantage and distill_coef == 0)


def _advantage(
    batch: RolloutBatch,
    cache: TeacherScoreCache | None,
    student_token: Array,
    signal: Literal["stale", "recompute"],
    distill_coef: float,
) -> Array:
    """``[B, T]`` the (detached) advantage the stabilisers weight.

    Distillation: the teacher's reverse-KL reward ``log q − log base`` (base: μ for the
    ``stale`` signal, π_θ's ``student_token`` log-probs for ``recompute``). Reward-driven RL
    (``batch.advantages`` set): the reward advantage, plus ``distill_coef`` β times that
    teacher reward when β > 0.
    """
    base = batch.behavior_logp if signal == "stale" else student_token
    if batch.advantages is None:
        return jax.lax.stop_gradient(_given(cache).token_logp - base)
    if distill_coef == 0:
        return jax.lax.stop_gradient(batch.advantages)
    return est.with_distillation(batch.advantages, _given(cache).token_logp, base, distill_coef)


# --- the adapters: each feeds one function of asyncopd_jax.estimators ---------------


def _forward_kl_topk(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.forward_kl_topk(_given(x.student.teacher_topk), _given(x.scores.topk_logp), tail=c.topk.tail)


def _forward_kl_topk_renormalized(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.forward_kl_topk_renormalized(_given(x.student.teacher_topk), _given(x.scores.topk_logp))


def _forward_kl_mc(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.forward_kl_mc(
        _given(x.student.teacher_samples), _given(x.scores.sample_logp), control_variate=c.forward_mc.control_variate
    )


def _reverse_kl_topk(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.reverse_kl_topk(_given(x.student.student_topk), _given(x.scores.student_topk_logp), tail=c.topk.tail)


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
    return (_given(x.student.candidates), _given(x.batch.candidate_behavior_logp), _given(x.scores.candidate_logp))


def _reverse_kl_mc(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return _mc(*_candidates(x), c, recompute=True)


def _reverse_kl_mc_stale(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return _mc(*_candidates(x), c, recompute=False)


def _reverse_kl_mc_loo(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.reverse_kl_mc_loo(*_candidates(x))


def _reverse_kl_hybrid(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    b, s = x.batch, x.student
    return est.reverse_kl_hybrid(
        _given(s.student_topk),
        _given(x.scores.student_topk_logp),
        _given(b.student_topk_ids),
        *_candidates(x),
        _given(b.candidate_ids),
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
        x.student.token, x.batch.behavior_logp, _given(x.advantage), clip_eps=c.ppo.clip_eps, dual_clip=c.ppo.dual_clip
    )


def _decoupled_ppo(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.decoupled_ppo_loss(
        x.student.token,
        _given(x.proximal).token,
        x.batch.behavior_logp,
        _given(x.advantage),
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
            _given(x.advantage),
            x.batch.response_mask,
            clip_eps=(c.gspo.clip_low, c.gspo.clip_high),
            level=level,
        )

    return gspo


def _truncated_is(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.truncated_is_loss(x.student.token, x.batch.behavior_logp, _given(x.advantage), cap=c.tis.cap)


def _m2po(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.m2po_loss(
        x.student.token,
        x.batch.behavior_logp,
        _given(x.advantage),
        x.batch.response_mask,
        second_moment_budget=c.m2po.budget,
    )


def _second_moment_clip(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.second_moment_clip_loss(
        x.student.token,
        x.batch.behavior_logp,
        _given(x.advantage),
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


def required_ids(name: str, batch: RolloutBatch, cache: TeacherScoreCache | None) -> dict[str, Array]:
    """The id sets the learner must score for estimator ``name``, by StudentLogProbs field.

    Always includes ``"token"`` (the sampled tokens, ``[B, T]``); the others are
    ``[B, T, n]``. Raises a ValueError naming the missing cache or batch field and the
    setting that makes it.
    """
    spec = get_estimator(name)
    ids: dict[str, Array] = {"token": batch.response_tokens}
    for field in spec.needs:
        source = ID_SOURCES[field]
        value = source.ids.read_from(batch, cache)
        if value is None or source.scores.read_from(cache) is None:
            raise ValueError(
                f"estimator {name!r} needs {source.ids} and {source.scores}; the rollout "
                f"or teacher-scoring stage was not configured to produce them ({source.setting} >= 1)"
            )
        ids[field] = value
    return ids


def student_logprobs(
    ids: Mapping[str, Array], gather: Callable[[Array], Array | tuple[Array, Array]]
) -> StudentLogProbs:
    """Score every id set with one call of ``gather`` (``[B, T, K] ids → [B, T, K] log-probs``,
    or ``→ (log-probs, [B, T] entropy)``: then the entropy is kept too).

    The id sets of :func:`required_ids` are concatenated along the last axis so that
    one fused pass (e.g. :func:`asyncopd_jax.estimators.gather_logprobs_and_entropy_from_hidden`)
    serves them all, then split back into a :class:`StudentLogProbs`.
    """
    names = list(ids)
    parts = [ids[n][..., None] if n == "token" else ids[n] for n in names]
    sizes = [p.shape[-1] for p in parts]
    logp = gather(jnp.concatenate([p.astype(jnp.int32) for p in parts], axis=-1))
    entropy = None
    if isinstance(logp, tuple):
        logp, entropy = logp
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    fields = {n: logp[..., o : o + s] for n, o, s in zip(names, offsets, sizes)}
    fields["token"] = fields["token"][..., 0]
    return StudentLogProbs(**fields, entropy=entropy)


# The log-prob fields checked with ``check_inputs``, by owner; (field, over distinct ids: its mass is ≤ 1).
_LOGPROB_FIELDS: dict[type, tuple[tuple[str, bool], ...]] = {
    RolloutBatch: (("behavior_logp", False), ("candidate_behavior_logp", False), ("reference_logp", False)),
    TeacherScoreCache: (
        ("token_logp", False),
        ("candidate_logp", False),
        ("student_topk_logp", True),
        ("topk_logp", True),
        ("sample_logp", False),
    ),
    StudentLogProbs: (
        ("token", False),
        ("candidates", False),
        ("student_topk", True),
        ("teacher_topk", True),
        ("teacher_samples", False),
    ),
}


def _check_logprobs(name: str, inputs: Mapping[str, object], valid: Array) -> None:
    """Value checks (:mod:`asyncopd_jax.estimators.checks`) that every log-prob field of the
    estimator's inputs (label → a RolloutBatch, TeacherScoreCache or StudentLogProbs, or
    None) holds log-probs, on the valid positions ``valid`` ``[B, T]`` (bool)."""
    for label, obj in inputs.items():
        if obj is None:
            continue
        fields = _LOGPROB_FIELDS[type(obj)]
        est.checks.check_logprobs(
            name,
            {f"{label}.{f}": getattr(obj, f) for f, _ in fields},
            supports=tuple(f"{label}.{f}" for f, support in fields if support),
            mask=valid,
        )


def _finite_padding(tree: _T, valid: Array) -> _T:
    """Every float field ``[B, T, ...]`` of ``tree`` (a RolloutBatch, TeacherScoreCache or
    StudentLogProbs, or None) with its non-finite values at the padded positions (``valid``
    ``[B, T]`` False) replaced by 0, before any arithmetic: a NaN a cache holds there then
    reaches neither the values nor the gradients (``0 · ∂f(NaN)`` would be NaN). Finite
    values are kept, padded or not, so the per-token values are those of the pure
    functions, padding included."""

    def fix(x):
        if not jnp.issubdtype(x.dtype, jnp.floating) or tuple(x.shape[: valid.ndim]) != tuple(valid.shape):
            return x
        keep = valid.reshape(valid.shape + (1,) * (x.ndim - valid.ndim)) | jnp.isfinite(x)
        return jnp.where(keep, x, jnp.zeros((), x.dtype))

    return jax.tree_util.tree_map(fix, tree)


def _require_inputs(
    config: EstimatorConfig,
    batch: RolloutBatch,
    cache: TeacherScoreCache | None,
    student: StudentLogProbs,
    proximal: StudentLogProbs | None,
    distill_coef: float,
) -> None:
    """A ValueError naming the first input the spec or the config needs and was not given."""
    spec, name = config.spec, config.name
    ids = required_ids(name, batch, cache)  # names a missing cache or batch field
    missing = [f for f in spec.needs if getattr(student, f) is None]
    if missing:
        raise ValueError(f"estimator {name!r} needs StudentLogProbs.{', '.join(missing)}")
    for field in spec.needs:
        if getattr(student, field).shape != ids[field].shape:
            raise ValueError(
                f"StudentLogProbs.{field} has shape {list(getattr(student, field).shape)}, "
                f"but its ids have shape {list(ids[field].shape)}"
            )
    if spec.needs_proximal and proximal is None:
        raise ValueError(f"estimator {name!r} needs proximal log-probs (a no-grad forward before the update)")
    rl = batch.advantages is not None
    if cache is None and spec.needs_teacher_scores(rl=rl, distill_coef=distill_coef):
        why = f"distill_coef = {distill_coef}" if rl else f"estimator {name!r}"
        raise ValueError(f"{why} needs the teacher's scores (a TeacherScoreCache)")
    regularisers = config.regularisers
    if config.needs_reference_logp and batch.reference_logp is None:
        raise ValueError(
            f"reference_kl_coef = {regularisers.reference_kl_coef} needs RolloutBatch.reference_logp "
            "(the scoring stage scores the reference policy)"
        )
    if regularisers.entropy_coef and student.entropy is None:
        raise ValueError(
            f"entropy_coef = {regularisers.entropy_coef} needs StudentLogProbs.entropy "
            "(gather_logprobs_and_entropy_from_hidden)"
        )


def evaluate_estimator(
    config: EstimatorConfig,
    batch: RolloutBatch,
    cache: TeacherScoreCache | None,
    student: StudentLogProbs,
    *,
    proximal: StudentLogProbs | None = None,
    distill_coef: float = 0.0,
) -> tuple[Array, Metrics]:
    """Evaluate the configured estimator: per-token losses ``[B, T]`` and scalar metrics.

    The losses include the optional regularisers of ``config`` (entropy bonus, KL to a
    reference). Reduce them with ``aggregate(values, batch.response_mask, mode)``
    (or the numerator/denominator forms across micro-batches). Non-finite inputs at
    padded positions (``batch.response_mask`` 0) are replaced by 0 first, so that they
    reach neither the loss nor its gradient; finite ones are left as they are. The metrics
    (:class:`~asyncopd_jax.metrics.Metrics`) are token means over the response mask
    (``means``): the loss, the 1-sample reverse-KL signal ``log π_θ − log q`` on the
    sampled tokens, the importance ratio ``π_θ / μ`` of the sampled tokens
    (``importance_ratio_mean``), ``zero_grad_fraction``, the share of tokens the estimator
    gives no gradient at all (PPO-style clipped or M2PO-masked), the student's ``entropy``
    where ``student.entropy`` is given, and ``reference_kl`` (k3) where the batch has
    reference log-probs; and the largest importance ratio (``maxes``:
    ``importance_ratio_max``).

    Args:
      config: the estimator (``config.name``, one of :data:`ESTIMATORS`) and its knobs.
      batch, cache: the rollout and its teacher scores (``cache`` None: reward-driven RL
        without distillation, for the advantage estimators only).
      student: current student log-probs on the ids of :func:`required_ids`.
      proximal: log-probs of the proximal policy (a spec with ``needs_proximal`` only).
      distill_coef: reward-driven RL (``batch.advantages`` set) only: β, the weight of the
        teacher's reverse-KL reward added to the reward advantage (``rl.distill_coef``;
        0: pure RL, no teacher scores needed).

    Returns:
      ``(values [B, T] fp32, metrics: fp32 scalars by their reduction over parts)``.
    """
    spec = config.spec
    _require_inputs(config, batch, cache, student, proximal, distill_coef)
    valid = est.checks.as_mask(batch.response_mask)
    if config.check_inputs:
        _check_logprobs(config.name, {"batch": batch, "cache": cache, "student": student, "proximal": proximal}, valid)
    batch, cache = _finite_padding(batch, valid), _finite_padding(cache, valid)
    student, proximal = _finite_padding(student, valid), _finite_padding(proximal, valid)
    spans = _SpanView.of(config, cache, valid)
    token_student = student  # the per-token log-probs, for the regularisers (the student's own tokens)
    scored, seen = spans.batch(batch), spans.cache(cache)
    adv = None
    if spec.needs_advantage:  # detached: computed once, outside the gradient below
        adv = _advantage(
            scored, seen, jax.lax.stop_gradient(spans.student(student).token), config.stabiliser_signal, distill_coef
        )
    proximal = None if proximal is None else spans.student(proximal, cache)
    inputs = EstimatorInputs(scored, seen, student, proximal, adv)
    # The estimator once, with its pull-back to the student's log-probs: ∂(Σ_valid values)/∂
    # (student log-probs), elementwise and cheap, says which tokens the update moves at all
    # (zero_grad_fraction) without evaluating the estimator a second time.
    values, pullback = jax.vjp(
        lambda s: spans.values(spec.fn(dataclasses.replace(inputs, student=spans.student(s, cache)), config)), student
    )
    mask = batch.response_mask
    (grads,) = pullback(jnp.where(mask, 1.0, 0.0).astype(values.dtype))
    moved = jnp.zeros(mask.shape, bool)
    for g in jax.tree_util.tree_leaves(jax.lax.stop_gradient(grads)):
        moved = moved | ((g != 0) if g.ndim == mask.ndim else jnp.any(g != 0, axis=-1))
    regularisers = config.regularisers
    if regularisers.entropy_coef:
        values = values - regularisers.entropy_coef * _given(student.entropy)
    if config.needs_reference_logp:
        values = values + regularisers.reference_kl_coef * est.reference_kl(
            token_student.token, _given(batch.reference_logp), regularisers.reference_kl
        )
    # the importance ratio of what was sampled: of each token, or of each span
    signal = jax.lax.stop_gradient(spans.sums(student.token))
    token_ratio = est.importance_ratio(signal, spans.sums(batch.behavior_logp))
    actions = spans.actions(mask)
    means = {
        "loss": est.token_mean(jax.lax.stop_gradient(values), mask),
        "importance_ratio_mean": est.token_mean(token_ratio, actions),
        "zero_grad_fraction": est.token_mean((~moved).astype(jnp.float32), mask),
    }
    maxes = {"importance_ratio_max": jnp.max(jnp.where(actions, token_ratio, 0.0))}
    if student.entropy is not None:
        means["entropy"] = est.token_mean(jax.lax.stop_gradient(student.entropy), mask)
    if batch.reference_logp is not None:
        means["reference_kl"] = est.token_mean(
            est.reference_kl(jax.lax.stop_gradient(student.token), batch.reference_logp, "k3"), mask
        )
    if cache is not None:  # reward-driven RL without distillation has no teacher scores
        # per token, or per span over the answer's tokens: the sequence's signal per student token either way
        means["reverse_kl_signal"] = est.token_mean(spans.values(signal - cache.token_logp, "sum"), mask)
    return values, Metrics(means=means, maxes=maxes)


@dataclasses.dataclass(frozen=True)
class _SpanView:
    """The estimator's inputs seen per span when the teacher's tokenizer differs from the
    student's (``cache.span_end`` set: :mod:`asyncopd_jax.estimators.spans`), else as they are.

    What an estimator reads is its spec's ``spans``: ``"sum"``, the sampled tokens' log-probs
    (π_θ, μ, the proximal policy's) summed over each span onto its last token, where its
    values then live; ``"start"``, the student's log-probs on the teacher's top-K mapped to
    student ids, at the span starts where one maps (its values live there). Off those
    positions every input is made finite *before* the estimator runs (the "double where" of
    :mod:`asyncopd_jax.estimators.checks`), then its values there are set to 0."""

    span_end: Array | None = None  # [B, T] bool, the answer's span ends (None: per token)
    kind: Literal["sum", "start"] | None = None
    where: Array | None = None  # [B, T] bool, where the estimator's values live

    @classmethod
    def of(cls, config: EstimatorConfig, cache: TeacherScoreCache | None, valid: Array) -> _SpanView:
        if cache is None or cache.span_end is None:
            return cls()
        kind = config.spec.spans
        if kind is None:
            check_cross_tokenizer(config.name, "of this cache")
        span_end = jnp.asarray(cache.span_end, bool) & valid
        if kind == "start":
            return cls(span_end, kind, est.spans.mapped_starts(_given(cache.topk_logp), span_end))
        return cls(span_end, kind, span_end)

    def sums(self, x: Array) -> Array:
        """``x`` ``[B, T]`` summed over each span onto its end (per token: ``x``)."""
        return x if self.span_end is None else est.spans.span_sums(x, self.span_end)

    def batch(self, batch: RolloutBatch) -> RolloutBatch:
        """``batch`` with μ's log-prob of each span (``"sum"``)."""
        if self.kind != "sum":
            return batch
        return dataclasses.replace(batch, behavior_logp=self.sums(batch.behavior_logp))

    def cache(self, cache: TeacherScoreCache | None) -> TeacherScoreCache | None:
        """``cache`` with the mapped top-K finite off the span starts (``"start"``)."""
        if cache is None or self.where is None or self.kind != "start":
            return cache
        return dataclasses.replace(cache, topk_logp=_off(_given(cache.topk_logp), self.where))

    def student(self, logp: StudentLogProbs, cache: TeacherScoreCache | None = None) -> StudentLogProbs:
        """A :class:`StudentLogProbs` as the estimator reads it (``cache``: the teacher's,
        whose unmapped top-K entries the student's support leaves out)."""
        if self.span_end is None or self.where is None:
            return logp
        if self.kind == "sum":
            return dataclasses.replace(logp, token=self.sums(logp.token))
        mapped = est.spans.mask_unmapped(_given(logp.teacher_topk), _given(_given(cache).topk_logp))
        return dataclasses.replace(logp, teacher_topk=_off(mapped, self.where))

    def values(self, values: Array, kind: Literal["sum", "start"] | None = None) -> Array:
        """``values`` ``[B, T]`` kept where they live (0 elsewhere); ``kind="sum"``: at the span ends."""
        where = self.span_end if kind == "sum" else self.where
        return values if where is None else jnp.where(where, values, jnp.zeros((), values.dtype))

    def actions(self, mask: Array) -> Array:
        """``[B, T]`` the positions of one sampled action each: tokens, or span ends."""
        return mask if self.span_end is None else self.span_end


def _off(x: Array, where: Array) -> Array:
    """``x`` ``[B, T, K]`` with 0 off ``where`` ``[B, T]`` (finite, and no gradient there)."""
    return jnp.where(where[..., None], x, jnp.zeros((), x.dtype))
