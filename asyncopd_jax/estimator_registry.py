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
from typing import Literal, TypeVar

import jax
import jax.numpy as jnp

from asyncopd_jax import estimators as est
from asyncopd_jax.cache import RolloutBatch, StudentLogProbs, TeacherScoreCache
from asyncopd_jax.config_checks import check_fields
from asyncopd_jax.estimators.stabilisers import ClipEps, clip_bounds

Array = jax.Array
_T = TypeVar("_T")


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
class EstimatorConfig:
    """The estimator and its knobs: the ``estimator`` section of a run's config (hashable,
    so it can be a static jit argument). Each field is checked on construction.

    Attributes:
      name: one of :data:`ESTIMATORS`.
      mc_clip_eps: PPO-style clip of the MC importance ratio (``reverse_kl_mc*``,
        ``reverse_kl_pg*``): ``ε`` or ``(ε_low, ε_high)``; None: no clip.
      mc_importance_sampling: weight MC candidates by ``π_θ / μ`` (``reverse_kl_mc``,
        ``reverse_kl_mc_stale``, ``reverse_kl_pg*``); False treats μ's draws as if from
        π_θ (biased under staleness: for the studies).
      topk_tail: add the tail bucket to the top-K estimators.
      control_variate: use the k3 form of ``forward_kl_mc``.
      ppo_clip_eps: clip range of ``ppo_clip``, ``decoupled_ppo``: ``ε`` or ``(ε_low, ε_high)``.
      dual_clip: dual-clip constant ``c > 1`` of the PPO-style losses, or None.
      behavior_weight_cap: decoupled PPO's cap on ``π_prox / μ``.
      behavior_weight_mode: what that cap does: mask the token (``"mask"``) or clamp the
        weight (``"truncate"``).
      behavior_weight_floor: decoupled PPO masks tokens whose ``π_prox / μ`` is below it.
      gspo_clip_low, gspo_clip_high: GSPO's clip range ``(ε_low, ε_high)`` of the sequence ratio.
      tis_cap: truncated IS cap.
      m2po_budget: M2PO's second-moment budget τ_M2 (``m2po``).
      second_moment_clip_budget, second_moment_clip_min_low, second_moment_clip_min_high:
        the budget and the range floors of ``second_moment_clip``.
      stabiliser_signal: the teacher reward the stabilisers use as advantage in
        distillation: ``"stale"`` = ``log q − log μ`` fixed at rollout time (the async-RL
        practice), ``"recompute"`` = ``log q − log π_θ`` at learner time.
      aggregation: how per-token losses become the loss (verl's ``loss_agg_mode`` names;
        see :mod:`asyncopd_jax.estimators.reductions`).
      entropy_coef: weight c of the entropy bonus ``−c · H(π_θ)`` added to every token's
        loss (0: none; the entropy is a metric either way).
      reference_kl_coef, reference_kl: weight and estimator (k1 / k2 / k3) of a
        KL(π_θ ‖ π_ref) term added to every token's loss, on
        ``RolloutBatch.reference_logp`` (0: none; π_ref: the run's ``reference`` model).
      check_inputs: add ``checkify`` checks that every log-prob the estimator is given is a
        log-prob (:mod:`asyncopd_jax.estimators.checks`; a debug mode: the learner then
        checks each step's error on the host).

    The RL weight β of the teacher's signal (``rl.distill_coef``) is not a knob of the
    estimator but of the run: the loss takes it beside this config (:func:`evaluate_estimator`).
    """

    name: str = "reverse_kl_mc"
    mc_clip_eps: ClipEps | None = None
    mc_importance_sampling: bool = True
    topk_tail: bool = True
    control_variate: bool = False
    ppo_clip_eps: ClipEps = 0.2
    dual_clip: float | None = None
    behavior_weight_cap: float | None = 5.0
    behavior_weight_mode: Literal["mask", "truncate"] = "mask"
    behavior_weight_floor: float | None = None
    gspo_clip_low: float = 3e-4
    gspo_clip_high: float = 4e-4
    tis_cap: float = 2.0
    m2po_budget: float = 0.04
    second_moment_clip_budget: float = 0.04
    second_moment_clip_min_low: float = 0.3
    second_moment_clip_min_high: float = 0.5
    stabiliser_signal: Literal["stale", "recompute"] = "stale"
    aggregation: est.Aggregation = "token-mean"
    entropy_coef: float = 0.0
    reference_kl_coef: float = 0.0
    reference_kl: est.ReferenceKL = "k3"
    check_inputs: bool = False

    def __post_init__(self) -> None:
        floor, cap = self.behavior_weight_floor, self.behavior_weight_cap
        check_fields(
            "estimator",
            [
                ("name", self.name, self.name in ESTIMATORS, ", ".join(sorted(ESTIMATORS))),
                ("mc_clip_eps", self.mc_clip_eps, _clip_range_ok(self.mc_clip_eps), f"null, {_CLIP_RANGE}"),
                ("ppo_clip_eps", self.ppo_clip_eps, _clip_range_ok(self.ppo_clip_eps), _CLIP_RANGE),
                ("gspo_clip_low", self.gspo_clip_low, 0 <= self.gspo_clip_low < 1, "0 <= ε_low < 1"),
                ("gspo_clip_high", self.gspo_clip_high, self.gspo_clip_high >= 0, ">= 0"),
                (
                    "reference_kl_coef",
                    self.reference_kl_coef,
                    self.reference_kl_coef >= 0,
                    ">= 0 (0: no KL-to-reference term)",
                ),
                ("m2po_budget", self.m2po_budget, self.m2po_budget >= 0, ">= 0"),
                (
                    "behavior_weight_floor",
                    floor,
                    floor is None or 0 <= floor < (cap or float("inf")),
                    "null, or >= 0 and below estimator.behavior_weight_cap",
                ),
            ],
        )

    @property
    def spec(self) -> EstimatorSpec:
        """The named estimator's spec."""
        return ESTIMATORS[self.name]

    @property
    def needs_reference_logp(self) -> bool:
        """Whether the loss has a KL-to-reference term, read on ``RolloutBatch.reference_logp``."""
        return self.reference_kl_coef != 0


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


@dataclasses.dataclass(frozen=True)
class IdSource:
    """Where the ids of one :class:`StudentLogProbs` field come from.

    Attributes:
      owner: the object holding them: the rollout (``"batch"``) or the teacher's cache.
      ids: its attribute holding the ids ``[B, T, n]``.
      scores: the :class:`TeacherScoreCache` attribute of the teacher's log-probs on them.
      setting: the run config's count (``section.field``) that makes the rollout or
        scoring stage produce them; 0 makes none.
    """

    owner: Literal["batch", "cache"]
    ids: str
    scores: str
    setting: str


ID_SOURCES: dict[str, IdSource] = {
    "candidates": IdSource("batch", "candidate_ids", "candidate_logp", "sampling.num_candidates"),
    "student_topk": IdSource("batch", "student_topk_ids", "student_topk_logp", "sampling.student_topk"),
    "teacher_topk": IdSource("cache", "topk_ids", "topk_logp", "scoring.topk"),
    "teacher_samples": IdSource("cache", "sample_ids", "sample_logp", "scoring.num_samples"),
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
    """

    name: str
    fn: EstimatorFn
    needs: tuple[str, ...] = ()
    needs_proximal: bool = False
    needs_advantage: bool = False
    description: str = ""

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
    return est.forward_kl_topk(_given(x.student.teacher_topk), _given(x.scores.topk_logp), tail=c.topk_tail)


def _forward_kl_topk_renormalized(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.forward_kl_topk_renormalized(_given(x.student.teacher_topk), _given(x.scores.topk_logp))


def _forward_kl_mc(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.forward_kl_mc(
        _given(x.student.teacher_samples), _given(x.scores.sample_logp), control_variate=c.control_variate
    )


def _reverse_kl_topk(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.reverse_kl_topk(_given(x.student.student_topk), _given(x.scores.student_topk_logp), tail=c.topk_tail)


def _mc(student: Array, behavior: Array, teacher: Array, c: EstimatorConfig, *, recompute: bool) -> Array:
    """``reverse_kl_mc`` on ``[B, T, n]`` draws of μ, with the config's IS and clip."""
    return est.reverse_kl_mc(
        student,
        behavior,
        teacher,
        recompute=recompute,
        importance_sampling=c.mc_importance_sampling,
        clip_eps=c.mc_clip_eps,
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
        x.student.token, x.batch.behavior_logp, _given(x.advantage), clip_eps=c.ppo_clip_eps, dual_clip=c.dual_clip
    )


def _decoupled_ppo(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.decoupled_ppo_loss(
        x.student.token,
        _given(x.proximal).token,
        x.batch.behavior_logp,
        _given(x.advantage),
        clip_eps=c.ppo_clip_eps,
        dual_clip=c.dual_clip,
        behavior_weight_cap=c.behavior_weight_cap,
        behavior_weight_mode=c.behavior_weight_mode,
        behavior_weight_floor=c.behavior_weight_floor,
    )


def _gspo_at(level: Literal["sequence", "token"]) -> EstimatorFn:
    """GSPO's adapter with its ratio per sequence (GSPO) or per token (GSPO-token)."""

    def gspo(x: EstimatorInputs, c: EstimatorConfig) -> Array:
        return est.gspo_loss(
            x.student.token,
            x.batch.behavior_logp,
            _given(x.advantage),
            x.batch.response_mask,
            clip_eps=(c.gspo_clip_low, c.gspo_clip_high),
            level=level,
        )

    return gspo


def _truncated_is(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.truncated_is_loss(x.student.token, x.batch.behavior_logp, _given(x.advantage), cap=c.tis_cap)


def _m2po(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.m2po_loss(
        x.student.token,
        x.batch.behavior_logp,
        _given(x.advantage),
        x.batch.response_mask,
        second_moment_budget=c.m2po_budget,
    )


def _second_moment_clip(x: EstimatorInputs, c: EstimatorConfig) -> Array:
    return est.second_moment_clip_loss(
        x.student.token,
        x.batch.behavior_logp,
        _given(x.advantage),
        x.batch.response_mask,
        second_moment_budget=c.second_moment_clip_budget,
        min_low_margin=c.second_moment_clip_min_low,
        min_high_margin=c.second_moment_clip_min_high,
        dual_clip=c.dual_clip,
    )


ESTIMATORS: dict[str, EstimatorSpec] = {
    spec.name: spec
    for spec in [
        EstimatorSpec(
            "forward_kl_topk",
            _forward_kl_topk,
            ("teacher_topk",),
            description="KL(teacher‖student) on the teacher's top-K ids",
        ),
        EstimatorSpec(
            "forward_kl_topk_renormalized",
            _forward_kl_topk_renormalized,
            ("teacher_topk",),
            description="KL(teacher‖student), both renormalised over the teacher's top-K ids (Tunix's distill_top_k)",
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
        ),
        EstimatorSpec(
            "reverse_kl_pg_stale",
            _reverse_kl_pg_stale,
            description="as reverse_kl_pg with the stale signal log μ − log q",
        ),
        EstimatorSpec(
            "ppo_clip",
            _ppo_clip,
            needs_advantage=True,
            description="PPO clip on the emitted token, reward log q − log μ",
        ),
        EstimatorSpec(
            "decoupled_ppo",
            _decoupled_ppo,
            needs_proximal=True,
            needs_advantage=True,
            description="AReaL decoupled PPO (needs proximal log-probs)",
        ),
        EstimatorSpec(
            "gspo",
            _gspo_at("sequence"),
            needs_advantage=True,
            description="GSPO: PPO clip on the response's geometric-mean ratio (aggregate with seq-mean-token-mean)",
        ),
        EstimatorSpec(
            "gspo_token",
            _gspo_at("token"),
            needs_advantage=True,
            description="GSPO-token: GSPO's sequence ratio with per-token advantages",
        ),
        EstimatorSpec(
            "truncated_is",
            _truncated_is,
            needs_advantage=True,
            description="policy gradient with truncated importance weights",
        ),
        EstimatorSpec(
            "m2po",
            _m2po,
            needs_advantage=True,
            description="M2PO: mask the largest squared log-ratios until the batch's second moment is in budget",
        ),
        EstimatorSpec(
            "second_moment_clip",
            _second_moment_clip,
            needs_advantage=True,
            description="PPO surrogate with a clip range set by a second-moment budget (not M2PO; E2's earlier arm)",
        ),
    ]
}

# The estimators reward-driven RL can train with: those weighting an advantage.
RL_ESTIMATORS: tuple[str, ...] = tuple(name for name, spec in ESTIMATORS.items() if spec.needs_advantage)


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
        value = getattr(batch if source.owner == "batch" else cache, source.ids, None)
        if value is None or getattr(cache, source.scores, None) is None:
            where = "RolloutBatch" if source.owner == "batch" else "TeacherScoreCache"
            raise ValueError(
                f"estimator {name!r} needs {where}.{source.ids} and TeacherScoreCache.{source.scores}; the rollout "
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
    if config.needs_reference_logp and batch.reference_logp is None:
        raise ValueError(
            f"reference_kl_coef = {config.reference_kl_coef} needs RolloutBatch.reference_logp "
            "(the scoring stage scores the reference policy)"
        )
    if config.entropy_coef and student.entropy is None:
        raise ValueError(
            f"entropy_coef = {config.entropy_coef} needs StudentLogProbs.entropy "
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
) -> tuple[Array, dict[str, Array]]:
    """Evaluate the configured estimator: per-token losses ``[B, T]`` and scalar metrics.

    The losses include the optional regularisers of ``config`` (entropy bonus, KL to a
    reference). Reduce them with ``aggregate(values, batch.response_mask, mode)``
    (or the numerator/denominator forms across micro-batches). Non-finite inputs at
    padded positions (``batch.response_mask`` 0) are replaced by 0 first, so that they
    reach neither the loss nor its gradient; finite ones are left as they are. Metrics are token means
    over the response mask: the loss, the 1-sample reverse-KL signal ``log π_θ − log q``
    on the sampled tokens, the importance ratio ``π_θ / μ`` of the sampled tokens (mean
    and max), ``zero_grad_fraction``, the share of tokens the estimator gives no gradient
    at all (PPO-style clipped or M2PO-masked), the student's ``entropy`` where
    ``student.entropy`` is given, and ``reference_kl`` (k3) where the batch has
    reference log-probs.

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
      ``(values [B, T] fp32, metrics dict of fp32 scalars)``.
    """
    spec = config.spec
    _require_inputs(config, batch, cache, student, proximal, distill_coef)
    valid = est.checks.as_mask(batch.response_mask)
    if config.check_inputs:
        _check_logprobs(config.name, {"batch": batch, "cache": cache, "student": student, "proximal": proximal}, valid)
    batch, cache = _finite_padding(batch, valid), _finite_padding(cache, valid)
    student, proximal = _finite_padding(student, valid), _finite_padding(proximal, valid)
    adv = None
    if spec.needs_advantage:  # detached: computed once, outside the gradient below
        adv = _advantage(batch, cache, jax.lax.stop_gradient(student.token), config.stabiliser_signal, distill_coef)
    inputs = EstimatorInputs(batch, cache, student, proximal, adv)
    # The estimator once, with its pull-back to the student's log-probs: ∂(Σ_valid values)/∂
    # (student log-probs), elementwise and cheap, says which tokens the update moves at all
    # (zero_grad_fraction) without evaluating the estimator a second time.
    values, pullback = jax.vjp(lambda s: spec.fn(dataclasses.replace(inputs, student=s), config), student)
    mask = batch.response_mask
    (grads,) = pullback(jnp.where(mask, 1.0, 0.0).astype(values.dtype))
    moved = jnp.zeros(mask.shape, bool)
    for g in jax.tree_util.tree_leaves(jax.lax.stop_gradient(grads)):
        moved = moved | ((g != 0) if g.ndim == mask.ndim else jnp.any(g != 0, axis=-1))
    if config.entropy_coef:
        values = values - config.entropy_coef * _given(student.entropy)
    if config.needs_reference_logp:
        values = values + config.reference_kl_coef * est.reference_kl(
            student.token, _given(batch.reference_logp), config.reference_kl
        )
    token_ratio = est.importance_ratio(jax.lax.stop_gradient(student.token), batch.behavior_logp)
    metrics = {
        "loss": est.token_mean(jax.lax.stop_gradient(values), mask),
        "importance_ratio_mean": est.token_mean(token_ratio, mask),
        "importance_ratio_max": jnp.max(jnp.where(mask, token_ratio, 0.0)),
        "zero_grad_fraction": est.token_mean((~moved).astype(jnp.float32), mask),
    }
    if student.entropy is not None:
        metrics["entropy"] = est.token_mean(jax.lax.stop_gradient(student.entropy), mask)
    if batch.reference_logp is not None:
        metrics["reference_kl"] = est.token_mean(
            est.reference_kl(jax.lax.stop_gradient(student.token), batch.reference_logp, "k3"), mask
        )
    if cache is not None:  # reward-driven RL without distillation has no teacher scores
        metrics["reverse_kl_signal"] = est.token_mean(jax.lax.stop_gradient(student.token) - cache.token_logp, mask)
    return values, metrics
