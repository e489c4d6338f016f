"""Estimators by name: which cached ids each one needs, and how to evaluate it.

The learner, the config and the studies refer to an estimator by its name (e.g.
``"reverse_kl_mc"``). Each :class:`EstimatorSpec` says which student log-prob sets the
estimator needs besides the sampled tokens (:func:`required_ids`), and evaluates the pure
function of :mod:`asyncopd_jax.estimators` on the data contracts of
:mod:`asyncopd_jax.cache` (:func:`evaluate_estimator`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Literal

import jax
import jax.numpy as jnp

from asyncopd_jax import estimators as est
from asyncopd_jax.cache import RolloutBatch, StudentLogProbs, TeacherScoreCache

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class EstimatorOptions:
    """Knobs of the named estimators (hashable, so it can be a static jit argument).

    Attributes:
      mc_clip_eps: PPO-style clip of the MC importance ratio (``reverse_kl_mc*``).
      mc_importance_sampling: weight MC candidates by ``π_θ / μ`` (``reverse_kl_mc``,
        ``reverse_kl_mc_stale``, ``reverse_kl_pg*``); False treats μ's draws as if from
        π_θ (biased under staleness: for the studies).
      topk_tail: add the tail bucket to the top-K estimators.
      control_variate: use the k3 form of ``forward_kl_mc``.
      ppo_clip_eps: clip range of ``ppo_clip``, ``decoupled_ppo``.
      dual_clip: dual-clip constant ``c > 1`` of the PPO-style losses, or None.
      behavior_weight_cap: decoupled PPO's cap on ``π_prox / μ``.
      behavior_weight_mode: what that cap does: mask the token (``"mask"``) or clamp the
        weight (``"truncate"``).
      behavior_weight_floor: decoupled PPO masks tokens whose ``π_prox / μ`` is below it.
      gspo_clip_eps: GSPO's clip range of the sequence ratio, ``(ε_low, ε_high)``.
      tis_cap: truncated IS cap.
      m2po_budget: M2PO's second-moment budget τ_M2 (``m2po``).
      second_moment_clip_budget, second_moment_clip_min_low, second_moment_clip_min_high:
        the budget and the range floors of ``second_moment_clip``.
      stabiliser_signal: the reward the stabilisers use as advantage: ``"stale"`` =
        ``log q − log μ`` fixed at rollout time (the async-RL practice), ``"recompute"``
        = ``log q − log π_θ`` at learner time.
      distill_coef: reward-driven RL (``RolloutBatch.advantages`` present) only: β, the
        weight of that teacher signal added to the reward advantage (0: pure RL, no
        teacher scores needed).
      entropy_coef: weight c of the entropy bonus ``−c · H(π_θ)`` added to every token's
        loss (0: none; the entropy is a metric either way).
      reference_kl_coef, reference_kl: weight and estimator (k1 / k2 / k3) of a
        KL(π_θ ‖ π_ref) term added to every token's loss, on
        ``RolloutBatch.reference_logp`` (0: none).
      check_inputs: add ``checkify`` checks that every log-prob the estimator is given is a
        log-prob (:mod:`asyncopd_jax.estimators.checks`; a debug mode: the learner then
        checks each step's error on the host).
    """

    mc_clip_eps: float | tuple[float, float] | None = None
    mc_importance_sampling: bool = True
    topk_tail: bool = True
    control_variate: bool = False
    ppo_clip_eps: float | tuple[float, float] = 0.2
    dual_clip: float | None = None
    behavior_weight_cap: float | None = 5.0
    behavior_weight_mode: Literal["mask", "truncate"] = "mask"
    behavior_weight_floor: float | None = None
    gspo_clip_eps: tuple[float, float] = (3e-4, 4e-4)
    tis_cap: float = 2.0
    m2po_budget: float = 0.04
    second_moment_clip_budget: float = 0.04
    second_moment_clip_min_low: float = 0.3
    second_moment_clip_min_high: float = 0.5
    stabiliser_signal: Literal["stale", "recompute"] = "stale"
    distill_coef: float = 0.0
    entropy_coef: float = 0.0
    reference_kl_coef: float = 0.0
    reference_kl: est.ReferenceKL = "k3"
    check_inputs: bool = False


EstimatorFn = Callable[
    [RolloutBatch, TeacherScoreCache, StudentLogProbs, "StudentLogProbs | None", EstimatorOptions], Array
]


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
    """A named estimator: which student log-prob sets it needs, and how to evaluate it."""

    name: str
    needs: tuple[str, ...]  # fields of StudentLogProbs besides `token`
    fn: EstimatorFn
    needs_proximal: bool = False
    description: str = ""


def _stabiliser_advantage(batch, cache, student, options) -> Array:
    """``[B, T]`` the (detached) advantage the stabilisers weight.

    Distillation: the teacher's reverse-KL reward ``log q − log base`` (base: μ for the
    stale signal, π_θ recomputed). Reward-driven RL (``batch.advantages`` set): the
    reward advantage, plus ``distill_coef`` times that teacher reward when β > 0.
    """
    base = batch.behavior_logp if options.stabiliser_signal == "stale" else student.token
    if batch.advantages is None:
        return jax.lax.stop_gradient(cache.token_logp - base)
    if options.distill_coef == 0:
        return jax.lax.stop_gradient(batch.advantages)
    if cache is None:
        raise ValueError(f"distill_coef = {options.distill_coef} needs the teacher's scores (a TeacherScoreCache)")
    return est.with_distillation(batch.advantages, cache.token_logp, base, options.distill_coef)


def _mc(recompute: bool) -> EstimatorFn:
    def run(batch, cache, student, proximal, options):
        return est.reverse_kl_mc(
            student.candidates, batch.candidate_behavior_logp, cache.candidate_logp,
            recompute=recompute, importance_sampling=options.mc_importance_sampling, clip_eps=options.mc_clip_eps,
        )

    return run


def _pg(recompute: bool) -> EstimatorFn:
    def run(batch, cache, student, proximal, options):
        return est.reverse_kl_mc(
            student.token[..., None], batch.behavior_logp[..., None], cache.token_logp[..., None],
            recompute=recompute, importance_sampling=options.mc_importance_sampling, clip_eps=options.mc_clip_eps,
        )

    return run


def _gspo(level: Literal["sequence", "token"]) -> EstimatorFn:
    def run(batch, cache, student, proximal, options):
        return est.gspo_loss(student.token, batch.behavior_logp, _stabiliser_advantage(batch, cache, student, options),
                             batch.response_mask, clip_eps=options.gspo_clip_eps, level=level)

    return run


ESTIMATORS: dict[str, EstimatorSpec] = {
    spec.name: spec
    for spec in [
        EstimatorSpec(
            "forward_kl_topk", ("teacher_topk",),
            lambda b, c, s, p, o: est.forward_kl_topk(s.teacher_topk, c.topk_logp, tail=o.topk_tail),
            description="KL(teacher‖student) on the teacher's top-K ids",
        ),
        EstimatorSpec(
            "forward_kl_topk_renormalized", ("teacher_topk",),
            lambda b, c, s, p, o: est.forward_kl_topk_renormalized(s.teacher_topk, c.topk_logp),
            description="KL(teacher‖student), both renormalised over the teacher's top-K ids (Tunix's distill_top_k)",
        ),
        EstimatorSpec(
            "forward_kl_mc", ("teacher_samples",),
            lambda b, c, s, p, o: est.forward_kl_mc(s.teacher_samples, c.sample_logp, control_variate=o.control_variate),
            description="KL(teacher‖student), Monte Carlo over teacher samples",
        ),
        EstimatorSpec(
            "reverse_kl_topk", ("student_topk",),
            lambda b, c, s, p, o: est.reverse_kl_topk(s.student_topk, c.student_topk_logp, tail=o.topk_tail),
            description="KL(student‖teacher) on the rollout student's top-K ids",
        ),
        EstimatorSpec(
            "reverse_kl_mc", ("candidates",), _mc(recompute=True),
            description="KL(student‖teacher), N-sample MC, recompute + importance sampling (unbiased)",
        ),
        EstimatorSpec(
            "reverse_kl_mc_loo", ("candidates",),
            lambda b, c, s, p, o: est.reverse_kl_mc_loo(s.candidates, b.candidate_behavior_logp, c.candidate_logp),
            description="as reverse_kl_mc with a leave-one-out baseline over the N candidates (unbiased)",
        ),
        EstimatorSpec(
            "reverse_kl_hybrid", ("student_topk", "candidates"),
            lambda b, c, s, p, o: est.reverse_kl_hybrid(
                s.student_topk, c.student_topk_logp, b.student_topk_ids,
                s.candidates, b.candidate_behavior_logp, c.candidate_logp, b.candidate_ids,
            ),
            description="KL(student‖teacher): exact on the rollout student's top-K, MC + IS outside it (unbiased)",
        ),
        EstimatorSpec(
            "reverse_kl_mc_stale", ("candidates",), _mc(recompute=False),
            description="as reverse_kl_mc with the stale signal log μ − log q",
        ),
        EstimatorSpec(
            "reverse_kl_pg", (), _pg(recompute=True),
            description="KL(student‖teacher), 1 sample (the emitted token), recompute + IS",
        ),
        EstimatorSpec(
            "reverse_kl_pg_stale", (), _pg(recompute=False),
            description="as reverse_kl_pg with the stale signal log μ − log q",
        ),
        EstimatorSpec(
            "ppo_clip", (),
            lambda b, c, s, p, o: est.ppo_clip_loss(
                s.token, b.behavior_logp, _stabiliser_advantage(b, c, s, o),
                clip_eps=o.ppo_clip_eps, dual_clip=o.dual_clip,
            ),
            description="PPO clip on the emitted token, reward log q − log μ",
        ),
        EstimatorSpec(
            "decoupled_ppo", (),
            lambda b, c, s, p, o: est.decoupled_ppo_loss(
                s.token, p.token, b.behavior_logp, _stabiliser_advantage(b, c, s, o),
                clip_eps=o.ppo_clip_eps, dual_clip=o.dual_clip, behavior_weight_cap=o.behavior_weight_cap,
                behavior_weight_mode=o.behavior_weight_mode, behavior_weight_floor=o.behavior_weight_floor,
            ),
            needs_proximal=True,
            description="AReaL decoupled PPO (needs proximal log-probs)",
        ),
        EstimatorSpec(
            "gspo", (), _gspo("sequence"),
            description="GSPO: PPO clip on the response's geometric-mean ratio (aggregate with seq-mean-token-mean)",
        ),
        EstimatorSpec(
            "gspo_token", (), _gspo("token"),
            description="GSPO-token: GSPO's sequence ratio with per-token advantages",
        ),
        EstimatorSpec(
            "truncated_is", (),
            lambda b, c, s, p, o: est.truncated_is_loss(
                s.token, b.behavior_logp, _stabiliser_advantage(b, c, s, o), cap=o.tis_cap
            ),
            description="policy gradient with truncated importance weights",
        ),
        EstimatorSpec(
            "m2po", (),
            lambda b, c, s, p, o: est.m2po_loss(
                s.token, b.behavior_logp, _stabiliser_advantage(b, c, s, o), b.response_mask,
                second_moment_budget=o.m2po_budget,
            ),
            description="M2PO: mask the largest squared log-ratios until the batch's second moment is in budget",
        ),
        EstimatorSpec(
            "second_moment_clip", (),
            lambda b, c, s, p, o: est.second_moment_clip_loss(
                s.token, b.behavior_logp, _stabiliser_advantage(b, c, s, o), b.response_mask,
                second_moment_budget=o.second_moment_clip_budget, min_low_margin=o.second_moment_clip_min_low,
                min_high_margin=o.second_moment_clip_min_high, dual_clip=o.dual_clip,
            ),
            description="PPO surrogate with a clip range set by a second-moment budget (not M2PO; E2's earlier arm)",
        ),
    ]
}


def get_estimator(name: str) -> EstimatorSpec:
    """The spec of a named estimator, or a ValueError listing the allowed names."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown estimator {name!r}; allowed: {', '.join(sorted(ESTIMATORS))}") from None


# Where the ids of each StudentLogProbs field live, and what the cache must hold for them.
_ID_SOURCES: dict[str, tuple[str, str, str]] = {
    # field: (object, ids attribute, teacher/behaviour attribute it is compared with)
    "candidates": ("batch", "candidate_ids", "candidate_logp"),
    "student_topk": ("batch", "student_topk_ids", "student_topk_logp"),
    "teacher_topk": ("cache", "topk_ids", "topk_logp"),
    "teacher_samples": ("cache", "sample_ids", "sample_logp"),
}


def required_ids(name: str, batch: RolloutBatch, cache: TeacherScoreCache) -> dict[str, Array]:
    """The id sets the learner must score for estimator ``name``, by StudentLogProbs field.

    Always includes ``"token"`` (the sampled tokens, ``[B, T]``); the others are
    ``[B, T, n]``. Raises a ValueError naming the missing cache or batch field.
    """
    spec = get_estimator(name)
    ids: dict[str, Array] = {"token": batch.response_tokens}
    for field in spec.needs:
        owner, id_attr, score_attr = _ID_SOURCES[field]
        source = batch if owner == "batch" else cache
        value = getattr(source, id_attr)
        if value is None or getattr(cache, score_attr) is None:
            where = f"RolloutBatch.{id_attr}" if owner == "batch" else f"TeacherScoreCache.{id_attr}"
            raise ValueError(
                f"estimator {name!r} needs {where} and TeacherScoreCache.{score_attr}; the rollout or "
                "teacher-scoring stage was not configured to produce them"
            )
        ids[field] = value
    return ids


def student_logprobs(ids: Mapping[str, Array],
                     gather: Callable[[Array], Array | tuple[Array, Array]]) -> StudentLogProbs:
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
_LOGPROB_FIELDS: dict[str, tuple[tuple[str, bool], ...]] = {
    "RolloutBatch": (("behavior_logp", False), ("candidate_behavior_logp", False), ("reference_logp", False)),
    "TeacherScoreCache": (("token_logp", False), ("candidate_logp", False), ("student_topk_logp", True),
                          ("topk_logp", True), ("sample_logp", False)),
    "StudentLogProbs": (("token", False), ("candidates", False), ("student_topk", True), ("teacher_topk", True),
                        ("teacher_samples", False)),
}


def _check_logprobs(name: str, inputs: Mapping[str, object]) -> None:
    """``checkify`` checks that every log-prob field of the estimator's inputs (label → a
    RolloutBatch, TeacherScoreCache or StudentLogProbs, or None) holds log-probs."""
    for label, obj in inputs.items():
        if obj is None:
            continue
        fields = _LOGPROB_FIELDS[type(obj).__name__]
        est.checks.check_logprobs(name, {f"{label}.{f}": getattr(obj, f) for f, _ in fields},
                                  supports=tuple(f"{label}.{f}" for f, support in fields if support))


def evaluate_estimator(
    name: str,
    batch: RolloutBatch,
    cache: TeacherScoreCache | None,
    student: StudentLogProbs,
    *,
    proximal: StudentLogProbs | None = None,
    options: EstimatorOptions = EstimatorOptions(),
) -> tuple[Array, dict[str, Array]]:
    """Evaluate the named estimator: per-token losses ``[B, T]`` and scalar metrics.

    The losses include the optional regularisers of ``options`` (entropy bonus,
    KL to a reference). Reduce them with ``aggregate(values, batch.response_mask, mode)``
    (or the numerator/denominator forms across micro-batches). Metrics are token means
    over the response mask: the loss, the 1-sample reverse-KL signal ``log π_θ − log q``
    on the sampled tokens, the importance ratio ``π_θ / μ`` of the sampled tokens (mean
    and max), ``zero_grad_fraction``, the share of tokens the estimator gives no gradient
    at all (PPO-style clipped or M2PO-masked), the student's ``entropy`` where
    ``student.entropy`` is given, and ``reference_kl`` (k3) where the batch has
    reference log-probs.

    Args:
      name: one of :data:`ESTIMATORS`.
      batch, cache: the rollout and its teacher scores (``cache`` None: reward-driven RL
        without distillation, for the stabilisers only).
      student: current student log-probs on the ids of :func:`required_ids`.
      proximal: log-probs of the proximal policy (``decoupled_ppo`` only).
      options: estimator knobs.

    Returns:
      ``(values [B, T] fp32, metrics dict of fp32 scalars)``.
    """
    spec = get_estimator(name)
    ids = required_ids(name, batch, cache)  # clear error for a missing cache field
    missing = [f for f in spec.needs if getattr(student, f) is None]
    if missing:
        raise ValueError(f"estimator {name!r} needs StudentLogProbs.{', '.join(missing)}")
    if spec.needs_proximal and proximal is None:
        raise ValueError(f"estimator {name!r} needs proximal log-probs (a no-grad forward before the update)")
    for field in spec.needs:
        if getattr(student, field).shape != ids[field].shape:
            raise ValueError(
                f"StudentLogProbs.{field} has shape {list(getattr(student, field).shape)}, "
                f"but its ids have shape {list(ids[field].shape)}"
            )
    if options.check_inputs:
        _check_logprobs(name, {"batch": batch, "cache": cache, "student": student, "proximal": proximal})
    values = spec.fn(batch, cache, student, proximal, options)
    if options.entropy_coef:
        if student.entropy is None:
            raise ValueError(f"entropy_coef = {options.entropy_coef} needs StudentLogProbs.entropy "
                             "(gather_logprobs_and_entropy_from_hidden)")
        values = values - options.entropy_coef * student.entropy
    if options.reference_kl_coef:
        if batch.reference_logp is None:
            raise ValueError(f"reference_kl_coef = {options.reference_kl_coef} needs RolloutBatch.reference_logp "
                             "(the scoring stage scores the reference policy)")
        values = values + options.reference_kl_coef * est.reference_kl(student.token, batch.reference_logp,
                                                                       options.reference_kl)
    mask = batch.response_mask
    # ∂(Σ values)/∂(student log-probs), elementwise and cheap: a token whose every entry is
    # 0 contributes nothing to the update.
    grads = jax.grad(lambda s: jnp.sum(jnp.where(mask, spec.fn(batch, cache, s, proximal, options), 0.0)))(
        jax.lax.stop_gradient(student))
    moved = jnp.zeros(mask.shape, bool)
    for g in jax.tree_util.tree_leaves(grads):
        moved = moved | ((g != 0) if g.ndim == mask.ndim else jnp.any(g != 0, axis=-1))
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
            est.reference_kl(jax.lax.stop_gradient(student.token), batch.reference_logp, "k3"), mask)
    if cache is not None:  # reward-driven RL without distillation has no teacher scores
        metrics["reverse_kl_signal"] = est.token_mean(jax.lax.stop_gradient(student.token) - cache.token_logp, mask)
    return values, metrics
