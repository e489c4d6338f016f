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
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from asyncopd_jax.estimators.checks import check_same_shape
from asyncopd_jax.estimators.logspace import LOG_RATIO_CLIP

Array = jax.Array

ReferenceKL = Literal["k1", "k2", "k3"]


def reference_kl(logp: Array, reference_logp: Array, kind: ReferenceKL = "k3") -> Array:
    """Per-token estimate of ``KL(π_θ ‖ π_ref)`` on the sampled tokens (see the module).

    Args:
      logp: ``[B, T]`` log π_θ of the sampled tokens (differentiated).
      reference_logp: ``[B, T]`` log π_ref of the same tokens (stop-gradient).
      kind: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
      ``[B, T]`` fp32.
    """
    if kind not in ("k1", "k2", "k3"):
        raise ValueError(f"reference_kl: kind = {kind!r} is invalid; allowed: k1, k2, k3")
    check_same_shape("reference_kl", {"logp": logp, "reference_logp": reference_logp}, ranks=(1, 2, 3))
    d = logp.astype(jnp.float32) - jax.lax.stop_gradient(reference_logp).astype(jnp.float32)
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    d = jnp.clip(d, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)
    return jnp.clip(jnp.exp(-d) - 1.0 + d, -10.0, 10.0)
