"""Per-token regularisers added to a loss: KL to a reference policy, and an entropy bonus.

In RL fine-tuning the policy is often held near a reference π_ref (the starting model) by a
per-token KL term, and kept exploring by an entropy bonus. Both are per-token values
``[B, T]`` to be added to an estimator's values (``loss + β · kl − c · entropy``) before
the aggregation.

The KL terms are Schulman's estimators of ``KL(π_θ ‖ π_ref)`` on tokens sampled from π_θ
(http://joschu.net/blog/kl-approx.html), with ``d = log π_θ(y) − log π_ref(y)``:

    k1 = d                      (unbiased, can be negative)
    k2 = d² / 2                 (biased, ≥ 0; its gradient d ∇log π_θ is the KL's)
    k3 = e^{−d} − 1 + d         (unbiased, ≥ 0, low variance: verl's "low_var_kl")

As a loss with a gradient in ``log π_θ`` (verl's ``use_kl_loss``), only k2's gradient is an
unbiased estimate of ∇KL on tokens from π_θ; k1 differentiates to ``∇log π_θ`` (0 in
expectation) and k3 to ``(1 − e^{−d}) ∇log π_θ``. ``d`` is clamped to ±20 and k3 to
at most 10, as verl does.

Like the estimators, :func:`reference_kl` takes the valid tokens as an optional ``mask``
(positions it leaves out are replaced by 0 before any arithmetic and return 0, so that
NaN padding reaches neither values nor gradients) and checks its log-prob arguments with
``check_inputs=True`` (:mod:`asyncopd_jax.estimators.checks`).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from asyncopd_jax.estimators.checks import as_mask, check_logprobs, check_mask, check_same_shape, keep
from asyncopd_jax.estimators.logspace import LOG_RATIO_CLIP

Array = jax.Array

ReferenceKL = Literal["k1", "k2", "k3"]


def reference_kl(
    logp: Array,
    reference_logp: Array,
    kind: ReferenceKL = "k3",
    *,
    mask: ArrayLike | None = None,
    check_inputs: bool = False,
) -> Array:
    """Per-token estimate of ``KL(π_θ ‖ π_ref)`` on the sampled tokens (see the module).

    Args:
      logp: ``[B, T]`` log π_θ of the sampled tokens (differentiated).
      reference_logp: ``[B, T]`` log π_ref of the same tokens (stop-gradient).
      kind: ``"k1"``, ``"k2"`` or ``"k3"``.
      mask: the valid tokens (``logp``'s shape, or ``[B, T]`` for a ``[B, T, N]`` one), or
        None; see the module.
      check_inputs: check that the log-prob arguments are log-probs
        (:mod:`asyncopd_jax.estimators.checks`: eagerly, under ``jit`` and under ``checkify``).

    Returns:
      ``[B, T]`` fp32 (0 where ``mask`` is 0).
    """
    if kind not in ("k1", "k2", "k3"):
        raise ValueError(f"reference_kl: kind = {kind!r} is invalid; allowed: k1, k2, k3")
    mask = as_mask(mask)
    check_same_shape("reference_kl", {"logp": logp, "reference_logp": reference_logp}, ranks=(1, 2, 3))
    check_mask("reference_kl", mask, "logp", jnp.shape(logp))
    if check_inputs:
        check_logprobs("reference_kl", {"logp": logp, "reference_logp": reference_logp}, mask=mask)
    logp, reference_logp = keep(logp, mask), keep(reference_logp, mask)
    d = logp.astype(jnp.float32) - jax.lax.stop_gradient(reference_logp).astype(jnp.float32)
    if kind == "k1":
        return keep(d, mask)
    if kind == "k2":
        return keep(0.5 * d * d, mask)
    d = jnp.clip(d, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    return keep(jnp.clip(jnp.exp(-d) - 1.0 + d, -10.0, 10.0), mask)
