"""Advantages for reward-driven RL: group-relative (GRPO-style) and with a distillation term.

Every prompt is answered ``G`` times (a *group*); the rows of a batch are laid out group by
group (rows ``g·G … g·G + G − 1`` answer prompt ``g``). A response's advantage is its
reward relative to its group's:

    A_i = r_i − mean_group(r)                        (normalize_std=False: Dr. GRPO)
    A_i = (r_i − mean_group(r)) / (std_group(r) + ε)  (normalize_std=True: GRPO)

``std="unbiased"`` (the default) divides the sum of squares by ``G − 1``, as verl, AReaL
and Tunix do; ``std="population"`` by ``G`` (advantages larger by ``√(G / (G − 1))``). A
group whose rewards are all equal carries no learning signal: its advantages are 0 either
way. A group of one (``G = 1``) has no group to compare with: its mean is taken as 0 and
its std as 1, so the advantage is the raw reward (``r / (1 + ε)`` with the std), as in
verl; there is then no baseline. The sequence-level advantage is given to every token of
the response (``[B] → [B, T]`` by broadcasting).

Distillation and reward combine in :func:`with_distillation`: per token, the teacher's
reverse-KL signal ``log q − log π`` (a stale or recomputed one, stop-gradient) is added to
the sequence advantage with a coefficient β, so one policy-gradient loss both reinforces
and distils.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from asyncopd_jax.estimators.checks import check_shapes

Array = jax.Array

StdKind = Literal["unbiased", "population"]


def group_advantages(
    rewards: ArrayLike,
    group_size: int,
    *,
    normalize_std: bool = True,
    std: StdKind = "unbiased",
    eps: float = 1e-6,
    axis_name: str | None = None,
) -> Array:
    """Group-relative advantages of ``rewards`` ``[B]`` (B = groups × ``group_size``) → ``[B]`` fp32.

    Args:
      rewards: ``[B]`` one reward per response, laid out group by group.
      group_size: ``G``, answers per prompt.
      normalize_std: divide the centred rewards by the group's std + ``eps`` (GRPO).
      std: ``"unbiased"`` (divide by G − 1: verl, AReaL, Tunix) or ``"population"`` (by G).
      eps: added to the std.
      axis_name: inside ``shard_map`` / ``vmap`` over a batch split along a named axis:
        the rewards of all devices on that axis are gathered (in axis order) first, so a
        group that straddles devices is normalised over all its members. Each device gets
        its own rows' advantages back.

    Returns:
      ``[B]`` fp32 (this device's rows with ``axis_name``).
    """
    if std not in ("unbiased", "population"):
        raise ValueError(f"group_advantages: std = {std!r} is invalid; allowed: unbiased, population")
    values = jnp.asarray(rewards, jnp.float32)
    local = values.shape[0] if values.ndim == 1 else 0  # any other rank is refused below
    if axis_name is not None and values.ndim == 1:
        values = jax.lax.all_gather(values, axis_name, tiled=True)
    if values.ndim != 1 or group_size < 1 or values.shape[0] % group_size:
        raise ValueError(
            f"group_advantages: rewards must be [B] with B a multiple of group_size = {group_size} "
            f"(got shape {values.shape})"
        )
    groups = values.reshape(-1, group_size)
    if group_size == 1:  # no group statistics: mean 0, std 1 (the raw reward, as verl)
        mean, spread = jnp.zeros_like(groups), jnp.ones_like(groups)
    else:
        mean = jnp.mean(groups, axis=1, keepdims=True)
        spread = jnp.std(groups, axis=1, keepdims=True, ddof=1 if std == "unbiased" else 0)
    centred = groups - mean
    if normalize_std:
        centred = centred / (spread + eps)
    advantages = centred.reshape(-1)
    if axis_name is not None:
        advantages = jax.lax.dynamic_slice_in_dim(advantages, jax.lax.axis_index(axis_name) * local, local)
    return advantages


def with_distillation(sequence_advantage: Array, teacher_logp: Array, student_logp: Array, beta: float) -> Array:
    """Per-token advantages ``[B, T]``: ``A_seq[b] + β · sg(log q − log π)[b, t]``.

    ``sequence_advantage``: ``[B]``, or ``[B, T]`` already broadcast over the tokens.

    ``teacher_logp``, ``student_logp``: ``[B, T]`` log-probs of the emitted tokens under the
    teacher and the student (the behaviour policy for the stale signal, the learner's for
    the recomputed one). β = 0 gives pure RL; the reward-free limit is the reverse-KL
    policy gradient.
    """
    check_shapes("with_distillation", {"teacher_logp": (teacher_logp, "B T"), "student_logp": (student_logp, "B T")})
    signal = jax.lax.stop_gradient(jnp.asarray(teacher_logp, jnp.float32) - jnp.asarray(student_logp, jnp.float32))
    advantage = jnp.asarray(sequence_advantage, jnp.float32)
    if advantage.ndim == 1:
        advantage = advantage[:, None]
    return jax.lax.stop_gradient(advantage) + beta * signal


__all__ = ["group_advantages", "with_distillation"]
