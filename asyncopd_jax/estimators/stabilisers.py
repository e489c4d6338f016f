"""Stabilisers from asynchronous RL, as pure per-token losses.

The functions take per-token (``[B, T]``) or per-candidate (``[B, T, N]``) arrays and
return a loss of the same shape, to be reduced with
:func:`asyncopd_jax.estimators.aggregate` (after a mean over ``N`` where present). PPO
clip, decoupled PPO and truncated IS are elementwise; M2PO (:func:`m2po_loss`) and the
second-moment clip choose from a statistic of the whole batch (``axis_name`` for data
parallelism), GSPO (:func:`gspo_loss`) from one of each response (row).
Notation: π_θ the current policy (``logp``, the only input with a gradient), μ the
behaviour policy that sampled the token, ``A`` a detached advantage. For on-policy
distillation the per-token advantage is the reward ``log q − log μ`` (stale signal) or
``log q − log π_θ`` (recomputed); see :mod:`asyncopd_jax.estimators.reverse_kl`.
Every importance ratio is ``exp`` of a log-ratio clamped to ±20
(:data:`~asyncopd_jax.estimators.LOG_RATIO_CLIP`: finite in fp32; no gradient past it).

Masks: every loss takes the valid tokens as ``mask`` (required where a statistic pools
tokens: GSPO, M2PO, the second-moment clip; optional, keyword, for the elementwise ones).
Positions it leaves out are replaced by 0 in every input *before* any arithmetic and
return loss 0, so that whatever they hold (NaN, ±inf padding) reaches neither the values
nor the gradients (without a mask a NaN input at a padded position makes every gradient
NaN, though the reduction drops its value: see :mod:`asyncopd_jax.estimators.forward_kl`).
The second-moment clip's loss is defined on every token (its mask only chooses the tokens
of τ): there only non-finite inputs outside the mask are replaced by 0.
A mask is any array-like of bool or weights; for the elementwise losses it has the shape
of ``logp`` or, for a ``[B, T, N]`` one, ``[B, T]`` (broadcast over ``N``).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from asyncopd_jax.estimators.checks import as_mask, check_logprobs, check_mask, check_same_shape, check_shapes, keep
from asyncopd_jax.estimators.logspace import LOG_RATIO_CLIP, importance_ratio

Array = jax.Array

ClipEps = float | tuple[float, float]


def clip_bounds(clip_eps: ClipEps) -> tuple[float, float]:
    """``ε`` or ``(ε_low, ε_high)`` → ratio bounds ``(1 − ε_low, 1 + ε_high)``."""
    low, high = (clip_eps, clip_eps) if isinstance(clip_eps, (int, float)) else clip_eps
    if not (0.0 <= low < 1.0 and high >= 0.0):
        raise ValueError(f"clip_eps must satisfy 0 <= eps_low < 1 and eps_high >= 0, got {clip_eps!r}")
    return 1.0 - low, 1.0 + high


def clipped_surrogate(
    ratio: Array,
    advantages: Array,
    ratio_low: Array | float,
    ratio_high: Array | float,
    dual_clip: float | None = None,
) -> Array:
    """The PPO pessimistic surrogate for a given ratio and clip range.

    ``L = max(−A r, −A clip(r, r_low, r_high))``; with dual clip ``c > 1``, where
    ``A < 0``: ``L = min(−c A, L)`` (caps the loss of a token whose ratio exploded).

    Args:
      ratio: ``[B, T]`` or ``[B, T, N]`` importance ratio, carrying the gradient.
      advantages: same shape, detached here.
      ratio_low, ratio_high: clip range (scalars or broadcastable arrays).
      dual_clip: ``c > 1`` or ``None``.

    Returns:
      Per-element loss, fp32, same shape as ``ratio``.
    """
    adv = jax.lax.stop_gradient(advantages).astype(jnp.float32)
    loss = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, ratio_low, ratio_high))
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        loss = jnp.where(adv < 0, jnp.minimum(loss, -dual_clip * adv), loss)
    return loss


def ppo_clip_loss(
    logp: Array,
    behavior_logp: Array,
    advantages: Array,
    *,
    clip_eps: ClipEps = 0.2,
    dual_clip: float | None = None,
    mask: ArrayLike | None = None,
    check_inputs: bool = False,
) -> Array:
    """PPO clipped surrogate with the behaviour policy as base.

    ``r = π_θ / μ``; ``L = max(−A r, −A clip(r, 1 − ε_low, 1 + ε_high))``; optional dual
    clip ``c``: where ``A < 0``, ``L = min(−c A, L)``.

    Args:
      logp: ``[B, T]`` or ``[B, T, N]`` log π_θ (differentiated).
      behavior_logp: same shape, log μ (stop-gradient).
      advantages: same shape (stop-gradient).
      clip_eps: ``ε`` or ``(ε_low, ε_high)``.
      dual_clip: ``c > 1`` or ``None``.
      mask: the valid tokens (``logp``'s shape, or ``[B, T]`` for a ``[B, T, N]`` one), or
        None; see the module.
      check_inputs: check that the log-prob arguments are log-probs
        (:mod:`asyncopd_jax.estimators.checks`: eagerly, under ``jit`` and under ``checkify``).

    Returns:
      Per-element loss, fp32, same shape as ``logp`` (0 where ``mask`` is 0).
    """
    mask = as_mask(mask)
    check_same_shape("ppo_clip_loss", {"logp": logp, "behavior_logp": behavior_logp, "advantages": advantages})
    check_mask("ppo_clip_loss", mask, "logp", jnp.shape(logp))
    if check_inputs:
        check_logprobs("ppo_clip_loss", {"logp": logp, "behavior_logp": behavior_logp}, mask=mask)
    logp, behavior_logp, advantages = (keep(x, mask) for x in (logp, behavior_logp, advantages))
    ratio = importance_ratio(logp, jax.lax.stop_gradient(behavior_logp))
    return keep(clipped_surrogate(ratio, advantages, *clip_bounds(clip_eps), dual_clip), mask)


def decoupled_ppo_loss(
    logp: Array,
    proximal_logp: Array,
    behavior_logp: Array,
    advantages: Array,
    *,
    clip_eps: ClipEps = 0.2,
    dual_clip: float | None = None,
    behavior_weight_cap: float | None = 5.0,
    behavior_weight_mode: Literal["mask", "truncate"] = "mask",
    behavior_weight_floor: float | None = None,
    mask: ArrayLike | None = None,
    check_inputs: bool = False,
) -> Array:
    """AReaL's decoupled PPO: trust region around π_prox, off-policy weight π_prox / μ.

    ``r = π_θ / π_prox`` is clipped around 1 (PPO surrogate ``L_clip``); the loss is
    weighted by ``w = π_prox / μ``: ``L = w · L_clip``. Above the cap ``c``:

    * ``behavior_weight_mode="mask"`` (AReaL's ``token_mask``, its default): tokens with
      ``w > c`` are masked out (loss 0, no gradient);
    * ``"truncate"`` (AReaL's ``token_truncate``): ``w`` is clamped to ``c``, so the token
      still trains, with a bounded weight (biased towards μ where ``w > c``).

    Tokens with ``w`` below ``behavior_weight_floor`` (if set) are masked out in either
    mode: tokens π_prox finds far less likely than μ did (raising their weight would add
    bias, and their weight is already small). Masked tokens stay in the token count of
    the mean. π_prox is the policy at the start of this learner step (a no-grad forward
    before the first optimizer step).

    Args:
      logp: ``[B, T]`` or ``[B, T, N]`` log π_θ (differentiated).
      proximal_logp: same shape, log π_prox (stop-gradient).
      behavior_logp: same shape, log μ (stop-gradient).
      advantages: same shape (stop-gradient).
      clip_eps: ``ε`` or ``(ε_low, ε_high)``.
      dual_clip: ``c > 1`` or ``None``.
      behavior_weight_cap: the cap ``c`` on ``w``; ``None``: no cap.
      behavior_weight_mode: what the cap does: ``"mask"`` or ``"truncate"``.
      behavior_weight_floor: mask out tokens with ``w`` below it; ``None``: no floor.
      mask: the valid tokens (``logp``'s shape, or ``[B, T]`` for a ``[B, T, N]`` one), or
        None; see the module.
      check_inputs: check that the log-prob arguments are log-probs
        (:mod:`asyncopd_jax.estimators.checks`: eagerly, under ``jit`` and under ``checkify``).

    Returns:
      Per-element loss, fp32, same shape as ``logp`` (0 where ``mask`` is 0).
    """
    mask = as_mask(mask)
    check_same_shape(
        "decoupled_ppo_loss",
        {"logp": logp, "proximal_logp": proximal_logp, "behavior_logp": behavior_logp, "advantages": advantages},
    )
    check_mask("decoupled_ppo_loss", mask, "logp", jnp.shape(logp))
    if check_inputs:
        check_logprobs(
            "decoupled_ppo_loss",
            {"logp": logp, "proximal_logp": proximal_logp, "behavior_logp": behavior_logp},
            mask=mask,
        )
    if behavior_weight_mode not in ("mask", "truncate"):
        raise ValueError(f"behavior_weight_mode = {behavior_weight_mode!r} is invalid; allowed: mask, truncate")
    if (
        behavior_weight_floor is not None
        and behavior_weight_cap is not None
        and not 0 <= behavior_weight_floor < behavior_weight_cap
    ):
        raise ValueError(
            f"behavior_weight_floor = {behavior_weight_floor} is invalid; allowed: "
            f"0 <= floor < behavior_weight_cap = {behavior_weight_cap}"
        )
    logp, proximal_logp, behavior_logp, advantages = (
        keep(x, mask) for x in (logp, proximal_logp, behavior_logp, advantages)
    )
    proximal_logp = jax.lax.stop_gradient(proximal_logp)
    ratio = importance_ratio(logp, proximal_logp)
    loss = clipped_surrogate(ratio, advantages, *clip_bounds(clip_eps), dual_clip)
    weight = importance_ratio(proximal_logp, jax.lax.stop_gradient(behavior_logp))
    kept = jnp.ones(weight.shape, bool)
    if behavior_weight_cap is not None:
        if behavior_weight_mode == "truncate":
            weight = jnp.minimum(weight, behavior_weight_cap)
        else:
            kept = weight <= behavior_weight_cap
    if behavior_weight_floor is not None:
        kept = kept & (weight >= behavior_weight_floor)
    return keep(jnp.where(kept, weight * loss, 0.0), mask)


def gspo_loss(
    logp: Array,
    behavior_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    clip_eps: ClipEps = (3e-4, 4e-4),
    level: Literal["sequence", "token"] = "sequence",
    check_inputs: bool = False,
) -> Array:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): PPO clip on a sequence-level ratio.

    The ratio of response i is the geometric mean of its tokens' ratios,
    ``s_i = exp((1/|y_i|) Σ_t m_t (log π_θ − log μ))``, and every token of the response
    gets ``L_t = max(−A_t s, −A_t clip(s, 1 − ε_low, 1 + ε_high))`` with

    * ``level="sequence"``: ``s = s_i`` (its gradient ``s_i · (1/|y_i|) Σ_t ∇log π_θ``
      flows through the mean: the paper's GSPO);
    * ``level="token"``: ``s = sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)]`` (GSPO-token: the same
      value, and with a sequence-level advantage the same gradient; it lets the advantage
      differ per token, as the teacher's per-token reward does in distillation).

    The paper's objective averages each response's tokens, then the responses: aggregate
    with ``seq-mean-token-mean`` (verl forces that mode for GSPO; here it is the caller's
    choice). The clip range is the paper's ``(3e-4, 4e-4)`` by default: a sequence ratio
    moves far less than a token's. The log-ratio is clamped to ±20 (verl: at most 10).
    A row's statistic uses its own tokens only: rows must be whole on a device (as under
    data parallelism), so there is no ``axis_name``.

    Args:
      logp: ``[B, T]`` log π_θ of the response tokens (differentiated).
      behavior_logp: ``[B, T]`` log μ (stop-gradient).
      advantages: ``[B, T]`` (stop-gradient); GSPO's is the response's, on all its tokens.
      mask: ``[B, T]`` valid tokens (bool or weights; see the module).
      clip_eps: ``ε`` or ``(ε_low, ε_high)``.
      level: ``"sequence"`` or ``"token"``.
      check_inputs: check that the log-prob arguments are log-probs
        (:mod:`asyncopd_jax.estimators.checks`: eagerly, under ``jit`` and under ``checkify``).

    Returns:
      ``[B, T]`` fp32 per-token loss (0 where ``mask`` is 0).
    """
    check_shapes(
        "gspo_loss",
        {
            "logp": (logp, "B T"),
            "behavior_logp": (behavior_logp, "B T"),
            "advantages": (advantages, "B T"),
            "mask": (mask, "B T"),
        },
    )
    if check_inputs:
        check_logprobs("gspo_loss", {"logp": logp, "behavior_logp": behavior_logp}, mask=as_mask(mask))
    if level not in ("sequence", "token"):
        raise ValueError(f"gspo_loss: level = {level!r} is invalid; allowed: sequence, token")
    valid = as_mask(mask)
    logp, behavior_logp, advantages = (keep(x, valid) for x in (logp, behavior_logp, advantages))
    logp = logp.astype(jnp.float32)
    weights = jnp.asarray(mask).astype(jnp.float32)
    log_ratio = jnp.where(weights != 0, logp - jax.lax.stop_gradient(behavior_logp).astype(jnp.float32), 0.0)
    sequence = jnp.sum(log_ratio * weights, axis=-1, keepdims=True) / jnp.maximum(
        jnp.sum(weights, axis=-1, keepdims=True), 1.0
    )  # [B, 1] mean log-ratio of each response
    if level == "token":
        sequence = jax.lax.stop_gradient(sequence) + logp - jax.lax.stop_gradient(logp)
    ratio = jnp.exp(jnp.clip(sequence, -LOG_RATIO_CLIP, LOG_RATIO_CLIP))
    ratio = jnp.broadcast_to(ratio, logp.shape)
    return jnp.where(weights != 0, clipped_surrogate(ratio, advantages, *clip_bounds(clip_eps)), 0.0)


def truncated_is_loss(
    logp: Array,
    behavior_logp: Array,
    advantages: Array,
    *,
    cap: float = 2.0,
    mask: ArrayLike | None = None,
    check_inputs: bool = False,
) -> Array:
    """Policy gradient with a truncated importance weight ``min(π_θ / μ, c)``.

    Gradient: ``−min(π_θ/μ, c) · A · ∇log π_θ``. Surrogate: ``L = −sg[min(ρ, c)] · A ·
    exp(log π_θ − sg[log π_θ])`` (value ``−min(ρ, c) · A``). Truncation bounds the
    variance at the price of a bias towards μ on tokens with ``ρ > c``.

    Args:
      logp: ``[B, T]`` or ``[B, T, N]`` log π_θ (differentiated).
      behavior_logp: same shape, log μ (stop-gradient).
      advantages: same shape (stop-gradient).
      cap: ``c > 0``.
      mask: the valid tokens (``logp``'s shape, or ``[B, T]`` for a ``[B, T, N]`` one), or
        None; see the module.
      check_inputs: check that the log-prob arguments are log-probs
        (:mod:`asyncopd_jax.estimators.checks`: eagerly, under ``jit`` and under ``checkify``).

    Returns:
      Per-element loss, fp32, same shape as ``logp`` (0 where ``mask`` is 0).
    """
    mask = as_mask(mask)
    check_same_shape("truncated_is_loss", {"logp": logp, "behavior_logp": behavior_logp, "advantages": advantages})
    check_mask("truncated_is_loss", mask, "logp", jnp.shape(logp))
    if check_inputs:
        check_logprobs("truncated_is_loss", {"logp": logp, "behavior_logp": behavior_logp}, mask=mask)
    if cap <= 0:
        raise ValueError(f"truncated_is_loss: cap must be > 0, got {cap}")
    logp, behavior_logp, advantages = (keep(x, mask) for x in (logp, behavior_logp, advantages))
    logp = logp.astype(jnp.float32)
    detached = jax.lax.stop_gradient(logp)
    weight = jnp.minimum(importance_ratio(detached, jax.lax.stop_gradient(behavior_logp)), cap)
    score = importance_ratio(logp, detached)  # value 1, gradient ∇log π_θ
    return keep(-jax.lax.stop_gradient(advantages).astype(jnp.float32) * weight * score, mask)


def m2po_mask(
    logp: Array,
    behavior_logp: Array,
    mask: Array,
    *,
    second_moment_budget: float = 0.04,
    axis_name: str | None = None,
    check_inputs: bool = False,
) -> Array:
    """M2PO's token mask (Zheng et al. 2025, "Prosperity before Collapse", arXiv 2510.01161).

    The paper's rule: "a masking strategy that selectively excludes tokens until the
    batch-level M2 of the remaining tokens falls below a predefined threshold τ_M2".

    With ``δ = log π_θ − log μ`` on the valid tokens of the whole batch, remove the token
    with the largest ``δ²``, then the next largest, …, until the second moment of the
    tokens kept, ``M₂ = mean_kept(δ²)``, is at most the budget ``τ_M2`` (0.04 in the
    paper). Because the mean of the k smallest ``δ²`` grows with k, this keeps exactly the
    ``k*`` tokens of smallest ``δ²``, with ``k*`` the largest k whose prefix mean is within
    budget (0 when even the smallest is over it; every token when the whole batch is).
    Ties at the boundary are broken by position (row-major, then device order).

    How the peers differ: AReaL (``_apply_m2po_masking``) takes ``δ`` against the proximal
    policy (π_θ at the start of the step: the same here on a batch's first optimizer
    step), stops at a strict ``<``, always keeps at least one token, and masks each
    micro-batch on each rank on its own; the M2PO authors' code clips instead of masking
    (:func:`second_moment_clip_loss`). verl has no M2PO.

    The statistic is batch-global: inside ``shard_map`` pass the data-parallel
    ``axis_name`` and every device sorts the ``δ²`` of all devices (an all-gather of one
    float per token), so that each keeps the same tokens it would keep in one batch.
    (Within this project's learner the statistic is that of the arrays the loss sees: the
    whole mini-batch under ``jit`` over a mesh, but each micro-batch's own with
    ``learner.micro_batches > 1`` or a token budget, as in AReaL.)

    Args:
      logp: ``[B, T]`` or ``[B, T, N]`` log π_θ (no gradient flows through the mask).
      behavior_logp: same shape, log μ.
      mask: same shape; valid tokens (the others are never kept and do not count).
      second_moment_budget: ``τ_M2 ≥ 0``.
      axis_name: the mesh axis the batch is split over, or None.
      check_inputs: check that the log-prob arguments are log-probs
        (:mod:`asyncopd_jax.estimators.checks`: eagerly, under ``jit`` and under ``checkify``).

    Returns:
      bool, the shape of ``logp``: True on the tokens kept.
    """
    check_same_shape("m2po_mask", {"logp": logp, "behavior_logp": behavior_logp, "mask": mask})
    mask = as_mask(mask)
    if check_inputs:
        check_logprobs("m2po_mask", {"logp": logp, "behavior_logp": behavior_logp}, mask=mask)
    if isinstance(second_moment_budget, (int, float)) and second_moment_budget < 0:
        raise ValueError(f"m2po_mask: second_moment_budget must be >= 0, got {second_moment_budget}")
    logp, behavior_logp = jnp.where(mask, logp, 0.0), jnp.where(mask, behavior_logp, 0.0)  # [B, T(, N)], like mask
    delta = jax.lax.stop_gradient(logp).astype(jnp.float32) - jax.lax.stop_gradient(behavior_logp).astype(jnp.float32)
    square = jnp.where(mask, delta * delta, jnp.inf).ravel()  # invalid tokens sort last
    local = square.shape[0]
    if axis_name is not None:
        square = jax.lax.all_gather(square, axis_name, tiled=True)
    order = jnp.argsort(square, stable=True)
    ranked = square[order]
    finite = jnp.isfinite(ranked)
    prefix = jnp.cumsum(jnp.where(finite, ranked, 0.0))
    kept = jnp.arange(1, ranked.shape[0] + 1, dtype=jnp.float32)
    within = finite & (prefix <= kept * second_moment_budget)  # mean of the k smallest ≤ budget
    keep_count = jnp.max(jnp.where(within, kept, 0.0))
    keep = jnp.zeros(ranked.shape, bool).at[order].set(kept <= keep_count)
    if axis_name is not None:
        keep = jax.lax.dynamic_slice_in_dim(keep, jax.lax.axis_index(axis_name) * local, local)
    return keep.reshape(logp.shape)


def m2po_loss(
    logp: Array,
    behavior_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    second_moment_budget: float = 0.04,
    axis_name: str | None = None,
    check_inputs: bool = False,
) -> Array:
    """M2PO: the importance-weighted policy gradient on the tokens :func:`m2po_mask` keeps.

    ``L = −M · A · π_θ / μ`` with ``M`` the mask (no ratio clipping on the kept tokens;
    the removed ones give loss 0 and no gradient, and stay in the token count of a token
    mean, as they do in a PPO-clipped loss).

    Args:
      logp: ``[B, T]`` or ``[B, T, N]`` log π_θ (differentiated).
      behavior_logp: same shape, log μ (stop-gradient).
      advantages: same shape (stop-gradient).
      mask: same shape; the valid tokens.
      second_moment_budget: ``τ_M2``, see :func:`m2po_mask`.
      axis_name: the data-parallel mesh axis, see :func:`m2po_mask`.
      check_inputs: check that the log-prob arguments are log-probs
        (:mod:`asyncopd_jax.estimators.checks`: eagerly, under ``jit`` and under ``checkify``).

    Returns:
      Per-element loss, fp32, same shape as ``logp`` (0 where ``mask`` is 0).
    """
    check_same_shape(
        "m2po_loss", {"logp": logp, "behavior_logp": behavior_logp, "advantages": advantages, "mask": mask}
    )
    valid = as_mask(mask)
    if check_inputs:  # here, so that a bad input is named as the caller's: m2po_loss
        check_logprobs("m2po_loss", {"logp": logp, "behavior_logp": behavior_logp}, mask=valid)
    kept = m2po_mask(logp, behavior_logp, mask, second_moment_budget=second_moment_budget, axis_name=axis_name)
    logp, behavior_logp, advantages = (keep(x, valid) for x in (logp, behavior_logp, advantages))
    ratio = importance_ratio(logp, jax.lax.stop_gradient(behavior_logp))
    return jnp.where(kept, -jax.lax.stop_gradient(advantages).astype(jnp.float32) * ratio, 0.0)


def second_moment_clip_range(
    logp: Array,
    behavior_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    second_moment_budget: float = 0.04,
    axis_name: str | None = None,
) -> Array:
    """The adaptive log-ratio bound τ of :func:`second_moment_clip_loss` (sort + prefix sums).

    With ``δ = log μ − log π_θ``, select the valid tokens whose ratio moves against the
    sign of the advantage, i.e. ``A · δ > 0`` (``A > 0`` and ``π_θ < μ``, or ``A < 0``
    and ``π_θ > μ``). Return the largest ``τ`` with

        mean_selected(min(δ², τ²)) ≤ budget,

    or ``+inf`` when the selected tokens are already within budget (or none is
    selected). ``f(τ) = mean(min(δ², τ²))`` is continuous and increasing in τ, so with
    the selected ``δ²`` sorted ascending as ``s_1 ≤ … ≤ s_M`` the solution is
    ``τ² = (M · budget − Σ_{i≤k} s_i) / (M − k)`` for the unique k whose interval
    ``[s_k, s_{k+1}]`` contains it.

    Args:
      logp: ``[B, T]`` or ``[B, T, N]`` log π_θ.
      behavior_logp: same shape, log μ.
      advantages: same shape.
      mask: same shape; valid tokens.
      second_moment_budget: the budget on the second moment of the clipped log-ratio.
      axis_name: the data-parallel mesh axis (inside ``shard_map``): τ from the tokens of
        every device on it.

    Returns:
      fp32 scalar τ ≥ 0 (or ``+inf``); no gradient.
    """
    check_same_shape(
        "second_moment_clip_range",
        {"logp": logp, "behavior_logp": behavior_logp, "advantages": advantages, "mask": mask},
    )
    mask = as_mask(mask)
    logp, behavior_logp, advantages = (keep(x, mask) for x in (logp, behavior_logp, advantages))
    logp = jax.lax.stop_gradient(logp).astype(jnp.float32)
    delta = jax.lax.stop_gradient(behavior_logp).astype(jnp.float32) - logp
    adv = jax.lax.stop_gradient(advantages).astype(jnp.float32)
    selected = mask & (adv * delta > 0)
    count = jnp.sum(selected).astype(jnp.float32)
    sq = jnp.where(selected, delta * delta, jnp.inf).ravel()
    if axis_name is not None:  # batch-global: the selected tokens of every device on the axis
        count, sq = jax.lax.psum(count, axis_name), jax.lax.all_gather(sq, axis_name, tiled=True)
    sq = jnp.sort(sq)  # selected first
    size = sq.shape[0]
    k = jnp.arange(size, dtype=jnp.float32)  # number of entries left unclipped
    finite_sq = jnp.where(jnp.isfinite(sq), sq, 0.0)
    prefix = jnp.cumsum(finite_sq) - finite_sq  # Σ_{i<k} s_i
    tau_sq = (count * second_moment_budget - prefix) / jnp.maximum(count - k, 1.0)
    lower = jnp.concatenate([jnp.zeros((1,), jnp.float32), sq[:-1]])
    valid = (k < count) & (tau_sq >= lower) & (tau_sq <= sq)
    solved = jnp.sqrt(jnp.max(jnp.where(valid, tau_sq, 0.0)))
    within_budget = jnp.sum(finite_sq) <= count * second_moment_budget
    return jnp.where(within_budget | (count == 0), jnp.inf, solved)


def second_moment_clip_loss(
    logp: Array,
    behavior_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    second_moment_budget: float = 0.04,
    min_low_margin: float = 0.3,
    min_high_margin: float = 0.5,
    dual_clip: float | None = None,
    axis_name: str | None = None,
) -> Array:
    """PPO surrogate whose clip range is set by a second-moment budget on the log-ratio.

    This is the trust region that the M2PO authors' code (Infini-AI-Lab/M2PO, a verl fork,
    ``compute_m2po_policy_loss``) runs, not the masking rule their paper describes (that is
    :func:`m2po_loss`): the second moment is budgeted over the "harmful" tokens only, by
    capping their ``δ²`` at ``τ²`` (water-filling) instead of removing tokens, and ``τ``
    becomes a PPO clip range, so a harmful token past ``e^±τ`` loses its gradient but every
    other token keeps an unclipped one. An earlier version of this library ran it under
    the name ``m2po`` (E2's first arm, ``docs/study/stabilisers.md``); it is kept, under a
    name that says what it does, so that the authors' code can be compared with their
    paper. (Unlike their code, τ is found on device, without a host round trip.)

    τ from :func:`second_moment_clip_range`; the ratio ``r = π_θ / μ`` is clipped to
    ``[min(e^−τ, 1 − m_low), max(e^τ, 1 + m_high)]``: the range never gets narrower than
    the minimum margins ``m_low, m_high``. Everything runs on device inside jit.

    Args:
      logp: ``[B, T]`` or ``[B, T, N]`` log π_θ (differentiated).
      behavior_logp: same shape, log μ (stop-gradient).
      advantages: same shape (stop-gradient).
      mask: same shape; the tokens over which τ is chosen.
      second_moment_budget: see :func:`second_moment_clip_range`.
      min_low_margin, min_high_margin: ``m_low ∈ [0, 1)``, ``m_high ≥ 0``.
      dual_clip: ``c > 1`` or ``None``.
      axis_name: see :func:`second_moment_clip_range`.

    Returns:
      Per-element loss, fp32, same shape as ``logp``, on every token (the mask only
      chooses τ's); outside the mask non-finite inputs count as 0.
    """
    check_same_shape(
        "second_moment_clip_loss",
        {"logp": logp, "behavior_logp": behavior_logp, "advantages": advantages, "mask": mask},
    )
    ratio_floor, ratio_ceiling = clip_bounds((min_low_margin, min_high_margin))
    tau = second_moment_clip_range(
        logp, behavior_logp, advantages, mask, second_moment_budget=second_moment_budget, axis_name=axis_name
    )
    low = jnp.minimum(jnp.exp(-tau), ratio_floor)
    high = jnp.maximum(jnp.exp(tau), ratio_ceiling)
    # The loss is defined on every token (the mask only chooses τ's tokens), so finite
    # inputs outside the mask are kept as they are; only non-finite ones there are replaced
    # by 0, before the arithmetic (see the module).
    valid = as_mask(mask)
    logp, behavior_logp, advantages = (
        jnp.where(valid | jnp.isfinite(x), x, 0.0) for x in (logp, behavior_logp, advantages)
    )
    ratio = importance_ratio(logp, jax.lax.stop_gradient(behavior_logp))
    return clipped_surrogate(ratio, advantages, low, high, dual_clip)
