"""Reverse KL, KL(student ‖ teacher): student-weighted, sensitive to stale rollouts.

Per response position t with prefix s, student π_θ, teacher q, behaviour policy μ (the
student snapshot that sampled the rollout):

    ℓ_R(θ; s) = Σ_v π_θ(v|s) [log π_θ(v|s) − log q(v|s)]
    ∇ℓ_R      = Σ_v π_θ(v) ∇log π_θ(v) [log π_θ(v) − log q(v)]
              = E_{v∼π_θ}[∇log π_θ(v) (log π_θ(v) − log q(v))]      (the "+1" term vanishes)

i.e. REINFORCE with per-token reward ``log q − log π_θ``. All inputs are response-local
and target-aligned, computed in fp32, and the teacher never receives a gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from asyncopd_jax.estimators.logspace import LOG_RATIO_CLIP, dense_logprobs, expectation, importance_ratio, with_tail
from asyncopd_jax.estimators.stabilisers import ClipEps, clip_bounds, clipped_surrogate

Array = jax.Array


def reverse_kl_dense(student_logits: Array, teacher_logits: Array) -> Array:
    """Exact per-token reverse KL from full-vocabulary logits.

    ``KL(π_θ ‖ q) = Σ_v π_θ(v) [log π_θ(v) − log q(v)]``, with ``π_θ = softmax(student_logits)``
    and ``q = softmax(teacher_logits)``; autodiff gives the exact ∇ℓ_R.

    Args:
      student_logits: ``[B, T, V]``.
      teacher_logits: ``[B, T, V]`` (stop-gradient).

    Returns:
      ``[B, T]`` fp32, ≥ 0.
    """
    student_logp, teacher_logp = dense_logprobs(student_logits, teacher_logits)
    return expectation(student_logp, student_logp - teacher_logp)


def reverse_kl_topk(student_logp: Array, teacher_logp: Array, *, tail: bool = True) -> Array:
    """Reverse KL on a student support ``S`` (the rollout student's top-K), plus a tail bucket.

    ``tail=False`` is the plain truncation ``Σ_{v∈S} π_θ(v) [log π_θ(v) − log q(v)]``,
    differentiated exactly; its gradient carries the "+1" term ``∇π_θ(S)``, which
    vanishes only when ``S`` is the whole vocabulary, so it is not stationary at
    π_θ = q. ``tail=True`` (default) adds ``π̄ [log π̄ − log q̄]`` with ``π̄ = 1 − π_θ(S)``,
    ``q̄ = 1 − q(S)``: the exact KL of the distributions coarse-grained to ``S`` +
    "other", ≥ 0 and 0 with 0 gradient at π_θ = q.

    Either way the student's mass outside ``S`` is not resolved: under staleness ``S``
    was chosen by μ, not π_θ, and tail tokens have zero inclusion probability, so no
    importance weight can correct this bias. With ``K = V`` both forms equal
    :func:`reverse_kl_dense` in value and gradient.

    Args:
      student_logp: ``[B, T, K]`` current student log-probs (full-vocabulary normalised)
        on the support ids (distinct).
      teacher_logp: ``[B, T, K]`` teacher log-probs on the same ids (stop-gradient).
      tail: add the tail bucket.

    Returns:
      ``[B, T]`` fp32.
    """
    student_logp = student_logp.astype(jnp.float32)
    teacher_logp = jax.lax.stop_gradient(teacher_logp).astype(jnp.float32)
    if tail:
        student_logp, teacher_logp = with_tail(student_logp), with_tail(teacher_logp)
    return expectation(student_logp, student_logp - teacher_logp)


def reverse_kl_mc(
    student_logp: Array,
    behavior_logp: Array,
    teacher_logp: Array,
    *,
    recompute: bool = True,
    importance_sampling: bool = True,
    clip_eps: ClipEps | None = None,
) -> Array:
    """Multi-sample Monte-Carlo reverse-KL surrogate over candidates drawn from μ.

    At rollout time ``v_1..v_N ~ μ(·|s)`` i.i.d. with replacement (the emitted token may
    be one of them; ``N = 1`` on the emitted token is 1-sample policy-gradient OPD).
    Per position:

        L = (1/N) Σ_n − sg[log q(v_n) − log π_θ(v_n)] · ρ_n,
        ρ_n = exp(clip(log π_θ(v_n) − log μ(v_n), −20, 20))

    Gradient: ``(1/N) Σ_n ρ_n ∇log π_θ(v_n) [log π_θ(v_n) − log q(v_n)]``, an unbiased
    estimate of ∇ℓ_R at the *current* θ for any staleness, because μ is known for every
    candidate. The value ``(1/N) Σ_n ρ_n [log π_θ(v_n) − log q(v_n)]`` is the
    importance-sampled estimate of ``KL(π_θ ‖ q)`` itself. Variance falls like 1/N,
    inflated as the weights ρ spread.

    Switches (the studies compare them; the defaults are the unbiased estimator):

    * ``recompute=False``: the *stale* signal ``log μ(v_n) − log q(v_n)`` replaces
      ``log π_θ(v_n) − log q(v_n)``; its bias grows with ``log π_θ − log μ``.
    * ``importance_sampling=False``: ``ρ_n`` is 1 in value (gradient still
      ``∇log π_θ``), i.e. candidates from μ are treated as if drawn from π_θ.
    * ``clip_eps``: PPO-style pessimistic clip of ``ρ_n`` to ``[1 − ε_low, 1 + ε_high]``
      with advantage ``A_n = sg[log q − log π_θ]`` (or the stale signal).

    Args:
      student_logp: ``[B, T, N]`` current student log-probs on the candidates.
      behavior_logp: ``[B, T, N]`` log μ of the candidates, recorded at sampling time
        (under the distribution actually sampled from).
      teacher_logp: ``[B, T, N]`` teacher log-probs on the candidates (stop-gradient).
      recompute: use the learner-time signal (True) or the stale one (False).
      importance_sampling: weight by ``π_θ / μ``.
      clip_eps: ``None``, ``ε`` or ``(ε_low, ε_high)``.

    Returns:
      ``[B, T]`` fp32: the surrogate, averaged over the candidate axis first.
    """
    student_logp = student_logp.astype(jnp.float32)
    behavior_logp = jax.lax.stop_gradient(behavior_logp).astype(jnp.float32)
    teacher_logp = jax.lax.stop_gradient(teacher_logp).astype(jnp.float32)
    signal_logp = jax.lax.stop_gradient(student_logp) if recompute else behavior_logp
    advantage = teacher_logp - signal_logp  # per-candidate reward, detached
    base_logp = behavior_logp if importance_sampling else jax.lax.stop_gradient(student_logp)
    ratio = importance_ratio(student_logp, base_logp, LOG_RATIO_CLIP)
    if clip_eps is None:
        per_candidate = -advantage * ratio
    else:
        per_candidate = clipped_surrogate(ratio, advantage, *clip_bounds(clip_eps))
    return jnp.mean(per_candidate, axis=-1)
