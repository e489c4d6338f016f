"""Advantages for reward-driven RL: group-relative (GRPO-style) and with a distillation term.

Every prompt is answered ``G`` times (a *group*); the rows of a batch are laid out group by
group (rows ``g·G … g·G + G − 1`` answer prompt ``g``). A response's advantage is its
reward relative to its group's:

    A_i = r_i − mean_group(r)                        (normalize_std=False: Dr. GRPO)
    A_i = (r_i − mean_group(r)) / (std_group(r) + ε)  (normalize_std=True: GRPO)

(population std over the G rewards). A group whose rewards are all equal carries no
learning signal: its advantages are 0 either way. The sequence-level advantage is given to
every token of the response (``[B] → [B, T]`` by broadcasting).

Distillation and reward combine in :func:`with_distillation`: per token, the teacher's
reverse-KL signal ``log q − log π`` (a stale or recomputed one, stop-gradient) is added to
the sequence advantage with a coefficient β, so one policy-gradient loss both reinforces
and distils.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def group_advantages(rewards: Array, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6) -> Array:
    """Group-relative advantages of ``rewards`` ``[B]`` (B = groups × ``group_size``) → ``[B]`` fp32."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1 or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"group_advantages: rewards must be [B] with B a multiple of group_size = {group_size} "
                         f"(got shape {rewards.shape})")
    groups = rewards.reshape(-1, group_size)
    centred = groups - jnp.mean(groups, axis=1, keepdims=True)
    if normalize_std:
        centred = centred / (jnp.std(groups, axis=1, keepdims=True) + eps)
    return centred.reshape(-1)


def with_distillation(sequence_advantage: Array, teacher_logp: Array, student_logp: Array, beta: float) -> Array:
    """Per-token advantages ``[B, T]``: ``A_seq[b] + β · sg(log q − log π)[b, t]``.

    ``sequence_advantage``: ``[B]``, or ``[B, T]`` already broadcast over the tokens.

    ``teacher_logp``, ``student_logp``: ``[B, T]`` log-probs of the emitted tokens under the
    teacher and the student (the behaviour policy for the stale signal, the learner's for
    the recomputed one). β = 0 gives pure RL; the reward-free limit is the reverse-KL
    policy gradient.
    """
    signal = jax.lax.stop_gradient(jnp.asarray(teacher_logp, jnp.float32) - jnp.asarray(student_logp, jnp.float32))
    advantage = jnp.asarray(sequence_advantage, jnp.float32)
    if advantage.ndim == 1:
        advantage = advantage[:, None]
    return jax.lax.stop_gradient(advantage) + beta * signal


__all__ = ["group_advantages", "with_distillation"]
