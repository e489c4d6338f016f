"""Forward KL, KL(teacher ‖ student): teacher-weighted, robust to stale rollouts.

Per response position t with prefix s, teacher q, student π_θ:

    ℓ_F(θ; s) = Σ_v q(v|s) [log q(v|s) − log π_θ(v|s)]
    ∇ℓ_F      = −Σ_v q(v|s) ∇log π_θ(v|s)

The weights q depend on neither θ nor the behaviour policy μ, so staleness only changes
which prefixes are visited. All inputs are response-local and target-aligned: index t
describes the distribution of response token t given the tokens before it. Everything is
computed in fp32 whatever the input dtype, and the teacher never receives a gradient.

``mask`` (``[B, T]``, optional, any array-like of bool or weights): the positions to
compute. Pass the mask you give the reduction: positions it leaves out are replaced by 0
*before* any arithmetic and return 0, so that whatever they hold (NaN, ±inf padding)
reaches neither the values nor the gradients. Without it, the reduction still drops their
values but a NaN input there makes every gradient NaN (``0 · ∂f(NaN) = NaN`` in the
backward pass). An optional argument rather than something the reduction can fix: the
NaN arises in the estimator's own backward pass, which only the estimator can keep
clean (the "double where" of the JAX FAQ; optax's losses take ``where`` for the same
reason).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from asyncopd_jax.estimators.checks import as_mask, check_logprobs, check_shapes, keep
from asyncopd_jax.estimators.logspace import dense_logprobs, expectation, importance_ratio, with_tail

Array = jax.Array


def forward_kl_dense(student_logits: Array, teacher_logits: Array, *, mask: ArrayLike | None = None) -> Array:
    """Exact per-token forward KL from full-vocabulary logits.

    ``KL(q ‖ π_θ) = Σ_v q(v) [log q(v) − log π_θ(v)]``, with ``q = softmax(teacher_logits)``
    and ``π_θ = softmax(student_logits)``.

    Args:
      student_logits: ``[B, T, V]``.
      teacher_logits: ``[B, T, V]`` (stop-gradient).
      mask: ``[B, T]`` positions to compute, or None (see the module).

    Returns:
      ``[B, T]`` fp32, ≥ 0 (0 where ``mask`` is 0).
    """
    mask = as_mask(mask)
    check_shapes(
        "forward_kl_dense",
        {
            "student_logits": (student_logits, "B T V"),
            "teacher_logits": (teacher_logits, "B T V"),
            "mask": (mask, "B T"),
        },
    )
    student_logp, teacher_logp = dense_logprobs(keep(student_logits, mask), keep(teacher_logits, mask))
    return keep(expectation(teacher_logp, teacher_logp - student_logp), mask)


def forward_kl_topk(
    student_logp: Array,
    teacher_logp: Array,
    *,
    tail: bool = True,
    mask: ArrayLike | None = None,
    check_inputs: bool = False,
) -> Array:
    """Forward KL on the teacher's top-K support ``S_q`` (plus, by default, one tail bucket).

    ``tail=False`` is the plain truncation of ``estimators.md``:

        Σ_{v∈S_q} q(v) [log q(v) − log π_θ(v)]

    It drops the teacher's tail, and its gradient ``−Σ_{v∈S_q} q(v) ∇log π_θ(v)`` does
    not vanish at π_θ = q: it keeps pushing the student's mass into ``S_q``.
    ``tail=True`` (default) adds the tail bucket, ``q̄ = 1 − q(S_q)``, ``π̄ = 1 − π_θ(S_q)``:

        Σ_{v∈S_q} q(v) [log q(v) − log π_θ(v)] + q̄ [log q̄ − log π̄]

    the exact KL between the two distributions coarse-grained to ``S_q`` + "other": ≥ 0,
    0 with 0 gradient at π_θ = q, and still ≤ the full KL (biased low). With ``K = V``
    both forms equal :func:`forward_kl_dense` in value and gradient.

    Args:
      student_logp: ``[B, T, K]`` student log-probs (full-vocabulary normalised) on the
        teacher's top-K ids (distinct).
      teacher_logp: ``[B, T, K]`` teacher log-probs on the same ids (stop-gradient).
      tail: add the tail bucket.
      mask: ``[B, T]`` positions to compute, or None (see the module).
      check_inputs: check that the log-prob arguments are log-probs
        (:mod:`asyncopd_jax.estimators.checks`: eagerly, under ``jit`` and under ``checkify``).

    Returns:
      ``[B, T]`` fp32 (0 where ``mask`` is 0).
    """
    mask = as_mask(mask)
    check_shapes(
        "forward_kl_topk",
        {"student_logp": (student_logp, "B T K"), "teacher_logp": (teacher_logp, "B T K"), "mask": (mask, "B T")},
    )
    if check_inputs:
        check_logprobs(
            "forward_kl_topk",
            {"student_logp": student_logp, "teacher_logp": teacher_logp},
            supports=("student_logp", "teacher_logp"),
            mask=mask,
        )
    teacher_logp = jax.lax.stop_gradient(keep(teacher_logp, mask)).astype(jnp.float32)
    student_logp = keep(student_logp, mask).astype(jnp.float32)
    if tail:
        teacher_logp, student_logp = with_tail(teacher_logp), with_tail(student_logp)
    return keep(expectation(teacher_logp, teacher_logp - student_logp), mask)


def forward_kl_topk_renormalized(student_logp: Array, teacher_logp: Array, *, mask: ArrayLike | None = None) -> Array:
    """Forward KL between teacher and student both renormalised over the teacher's top-K.

    With ``q_K = q / q(S_q)`` and ``π_K = π_θ / π_θ(S_q)`` on the support:

        Σ_{v∈S_q} q_K(v) [log q_K(v) − log π_K(v)]

    Tunix's logit distillation with ``distill_top_k`` computes this (there from the top-K
    logits, ``log_softmax`` over the K of them, which is the same renormalisation; it also
    softens both by a temperature T and multiplies the KL by T²: pass log-probs at that
    temperature and scale the result). It is 0 with 0 gradient whenever π_θ and q agree
    *up to a factor on S_q*: unlike :func:`forward_kl_topk` it does not ask the student to
    put the teacher's mass on S_q, only to share it out as the teacher does. Invariant to
    whether the inputs are full-vocabulary log-probs or raw logits on the support.

    Args:
      student_logp: ``[B, T, K]`` student log-probs (or logits) on the teacher's top-K ids.
      teacher_logp: ``[B, T, K]`` teacher log-probs (or logits) on the same ids (stop-gradient).
      mask: ``[B, T]`` positions to compute, or None (see the module).

    Returns:
      ``[B, T]`` fp32, ≥ 0 (0 where ``mask`` is 0).
    """
    mask = as_mask(mask)
    check_shapes(
        "forward_kl_topk_renormalized",
        {"student_logp": (student_logp, "B T K"), "teacher_logp": (teacher_logp, "B T K"), "mask": (mask, "B T")},
    )
    teacher_logp = jax.nn.log_softmax(jax.lax.stop_gradient(keep(teacher_logp, mask)).astype(jnp.float32), axis=-1)
    student_logp = jax.nn.log_softmax(keep(student_logp, mask).astype(jnp.float32), axis=-1)
    return keep(expectation(teacher_logp, teacher_logp - student_logp), mask)


def forward_kl_mc(
    student_logp: Array,
    teacher_logp: Array,
    *,
    control_variate: bool = False,
    mask: ArrayLike | None = None,
    check_inputs: bool = False,
) -> Array:
    """Monte-Carlo forward KL over N samples drawn from the teacher.

    With ``v_1..v_N ~ q`` i.i.d. and ``r_n = π_θ(v_n) / q(v_n)``:

    * default: ``(1/N) Σ_n [log q(v_n) − log π_θ(v_n)]`` = ``(1/N) Σ_n −log r_n``, an
      unbiased estimate of ``KL(q ‖ π_θ)`` whose gradient ``−(1/N) Σ_n ∇log π_θ(v_n)``
      is unbiased for ``∇ℓ_F``. At π_θ = q the value is 0 but a single draw's gradient
      is not (it is 0 only in expectation).
    * ``control_variate=True``: ``(1/N) Σ_n [(r_n − 1) − log r_n]`` (the "k3" form,
      adding ``r − 1``, whose mean under q is 0). Still unbiased in value and gradient
      (``−(1/N) Σ_n (1 − r_n) ∇log π_θ(v_n)``) when q has full support, ≥ 0 per sample,
      and exactly 0 with 0 gradient at π_θ = q; but its variance grows with
      ``Σ_v π_θ(v)² / q(v)``, i.e. when the student puts mass where the teacher has
      little.

    No importance weight on the samples is needed: they come from q itself.

    Args:
      student_logp: ``[B, T, N]`` student log-probs on the teacher's samples.
      teacher_logp: ``[B, T, N]`` teacher log-probs on the same samples (stop-gradient).
      control_variate: use the k3 form.
      mask: ``[B, T]`` positions to compute, or None (see the module).
      check_inputs: check that the log-prob arguments are log-probs
        (:mod:`asyncopd_jax.estimators.checks`: eagerly, under ``jit`` and under ``checkify``).

    Returns:
      ``[B, T]`` fp32 (averaged over the sample axis; 0 where ``mask`` is 0).
    """
    mask = as_mask(mask)
    check_shapes(
        "forward_kl_mc",
        {"student_logp": (student_logp, "B T N"), "teacher_logp": (teacher_logp, "B T N"), "mask": (mask, "B T")},
    )
    if check_inputs:
        check_logprobs("forward_kl_mc", {"student_logp": student_logp, "teacher_logp": teacher_logp}, mask=mask)
    teacher_logp = jax.lax.stop_gradient(keep(teacher_logp, mask)).astype(jnp.float32)
    student_logp = keep(student_logp, mask).astype(jnp.float32)
    log_ratio = student_logp - teacher_logp
    per_sample = -log_ratio
    if control_variate:
        per_sample = per_sample + importance_ratio(student_logp, teacher_logp) - 1.0
    return keep(jnp.mean(per_sample, axis=-1), mask)
