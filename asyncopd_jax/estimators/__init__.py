"""Pure JAX estimators for on-policy distillation.

Every function here is a pure function of arrays (no model, no config), computes in
fp32 whatever the input dtype, and follows one alignment convention: per-position
inputs are response-local and target-aligned (``[B, T]``, ``[B, T, K]`` or
``[B, T, N]``; index t describes the distribution of response token t). Estimators
return per-token values ``[B, T]``; reduce them with :func:`aggregate` (token mean or
verl's sequence-level modes) or, across micro-batches and devices, with
:func:`loss_denominator` / :func:`normalized_loss` (:func:`token_mean` and
:func:`normalized_token_sum` are the token-mean cases).

Names state the KL direction: ``forward_kl_*`` is KL(teacher ‖ student) and
``reverse_kl_*`` is KL(student ‖ teacher).

Give every estimator the ``mask`` you give the reduction: it keeps the positions the mask
leaves out (padding) out of its arithmetic, so that NaN there reaches neither the loss nor
the gradients. ``check_inputs=True`` checks the values of the inputs, eagerly, under
``jax.jit`` and under ``checkify`` (:mod:`asyncopd_jax.estimators.checks`).
"""

from asyncopd_jax.estimators import spans
from asyncopd_jax.estimators.advantages import group_advantages, with_distillation
from asyncopd_jax.estimators.candidates import sample_candidates
from asyncopd_jax.estimators.dense_from_hidden import (
    dense_kls_from_hidden,
    forward_kl_dense_from_hidden,
    reverse_kl_dense_from_hidden,
)
from asyncopd_jax.estimators.forward_kl import (
    forward_kl_dense,
    forward_kl_mc,
    forward_kl_topk,
    forward_kl_topk_renormalized,
)
from asyncopd_jax.estimators.logprobs import (
    gather_logprobs,
    gather_logprobs_and_entropy_from_hidden,
    gather_logprobs_from_hidden,
)
from asyncopd_jax.estimators.logspace import LOG_RATIO_CLIP, expectation, importance_ratio, with_tail
from asyncopd_jax.estimators.reductions import (
    AGGREGATIONS,
    Aggregation,
    aggregate,
    loss_denominator,
    loss_numerator,
    normalized_loss,
    normalized_token_sum,
    token_mean,
    token_sum,
)
from asyncopd_jax.estimators.regularisers import ReferenceKL, reference_kl
from asyncopd_jax.estimators.reverse_kl import (
    reverse_kl_dense,
    reverse_kl_hybrid,
    reverse_kl_mc,
    reverse_kl_mc_loo,
    reverse_kl_topk,
)
from asyncopd_jax.estimators.stabilisers import (
    clipped_surrogate,
    decoupled_ppo_loss,
    gspo_loss,
    m2po_loss,
    m2po_mask,
    ppo_clip_loss,
    second_moment_clip_loss,
    second_moment_clip_range,
    truncated_is_loss,
)

__all__ = [
    "AGGREGATIONS",
    "Aggregation",
    "LOG_RATIO_CLIP",
    "aggregate",
    "clipped_surrogate",
    "decoupled_ppo_loss",
    "dense_kls_from_hidden",
    "expectation",
    "forward_kl_dense",
    "forward_kl_dense_from_hidden",
    "forward_kl_mc",
    "forward_kl_topk",
    "forward_kl_topk_renormalized",
    "gather_logprobs",
    "gather_logprobs_and_entropy_from_hidden",
    "gather_logprobs_from_hidden",
    "group_advantages",
    "gspo_loss",
    "importance_ratio",
    "loss_denominator",
    "loss_numerator",
    "m2po_loss",
    "m2po_mask",
    "normalized_loss",
    "normalized_token_sum",
    "ppo_clip_loss",
    "ReferenceKL",
    "reference_kl",
    "reverse_kl_dense",
    "reverse_kl_dense_from_hidden",
    "reverse_kl_hybrid",
    "reverse_kl_mc",
    "reverse_kl_mc_loo",
    "reverse_kl_topk",
    "sample_candidates",
    "second_moment_clip_loss",
    "spans",
    "second_moment_clip_range",
    "token_mean",
    "token_sum",
    "truncated_is_loss",
    "with_distillation",
    "with_tail",
]
