"""What a sampler records per answer token, as one pytree both engines carry and write, and
the :class:`~asyncopd_jax.cache.RolloutBatch` it becomes.

Shapes: B rows, P prompt slots, T = ``max_new_tokens``, N = ``num_candidates``, K =
``student_topk``. A record that is not configured (N or K = 0) is carried as one unused
column, so that every engine's loop has one shape of carry, and is left out of the batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.sampling.distribution import SamplingParams

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Records:
    """Per row, its answer so far: token ``t`` of row ``b`` is at column ``t``, and columns
    from ``length[b]`` on hold the fill of :meth:`empty` (the pad id, zeros).

    The leaves are JAX arrays inside the engines' compiled loops and NumPy arrays where the
    continuous engine's host keeps them (:class:`~asyncopd_jax.sampling.stream.ContinuousStream`).
    """

    length: Any  # [B] int32 answer tokens sampled so far
    tokens: Any  # [B, T] int32
    logp: Any  # [B, T] fp32 behaviour log-probs of the tokens (of the distribution sampled from)
    versions: Any  # [B, T] int32 policy version that sampled each token
    candidate_ids: Any  # [B, T, N] int32 Monte-Carlo candidates, drawn with the token
    candidate_logp: Any  # [B, T, N] fp32 their behaviour log-probs
    topk_ids: Any  # [B, T, K] int32 the sampling student's top-K ids (of its logits)
    topk_logp: Any  # [B, T, K] fp32 their behaviour log-probs

    @classmethod
    def empty(cls, params: SamplingParams, rows: int, pad_id: int, xp: Any = jnp) -> Records:
        """``rows`` rows with nothing sampled, as ``xp`` arrays (``jnp`` or ``np``)."""
        t, n, k = params.max_new_tokens, max(params.num_candidates, 1), max(params.student_topk, 1)
        return cls(
            length=xp.zeros((rows,), xp.int32),
            tokens=xp.full((rows, t), pad_id, xp.int32),
            logp=xp.zeros((rows, t), xp.float32),
            versions=xp.zeros((rows, t), xp.int32),
            candidate_ids=xp.zeros((rows, t, n), xp.int32),
            candidate_logp=xp.zeros((rows, t, n), xp.float32),
            topk_ids=xp.zeros((rows, t, k), xp.int32),
            topk_logp=xp.zeros((rows, t, k), xp.float32),
        )

    @property
    def columns(self) -> dict[str, Any]:
        """The per-token fields ``[B, T, ...]`` by name (every field but ``length``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "length"}

    def response_mask(self) -> Any:
        """``[B, T]`` bool: True on the answer's tokens (columns ``< length``)."""
        xp = np if isinstance(self.length, np.ndarray) else jnp
        return xp.arange(self.tokens.shape[1])[None] < self.length[:, None]


def rollout_batch(
    prompt_tokens: Any, prompt_mask: Any, records: Records, params: SamplingParams, environment: Any = None
) -> RolloutBatch:
    """The batch of ``B`` answers (``records``, on the device or the host) to the left-padded
    prompts ``prompt_tokens, prompt_mask [B, P]``: the one assembly of both engines.
    ``environment [B, T]`` (multi-turn) marks the columns an environment wrote: they are
    outside the response mask."""
    put = jnp.asarray
    mc, topk = params.num_candidates > 0, params.student_topk > 0
    student = records.response_mask() if environment is None else records.response_mask() & ~environment
    return RolloutBatch(
        prompt_tokens=put(prompt_tokens),
        prompt_mask=put(prompt_mask),
        response_tokens=put(records.tokens),
        response_mask=put(student),
        environment_mask=None if environment is None else put(environment),
        behavior_logp=put(records.logp),
        token_version=put(records.versions),
        candidate_ids=put(records.candidate_ids) if mc else None,
        candidate_behavior_logp=put(records.candidate_logp) if mc else None,
        student_topk_ids=put(records.topk_ids) if topk else None,
        student_topk_behavior_logp=put(records.topk_logp) if topk else None,
    )


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token lists → left-padded ``[B, P]`` ids and mask (P = longest prompt or ``width``):
    the layout of a :class:`RolloutBatch`'s prompts, whichever engine sampled it."""
    longest = max(len(p) for p in prompts)
    width = longest if width is None else width
    if longest > width:
        raise ValueError(f"a prompt has {longest} tokens, more than the {width} prompt slots")
    if min(len(p) for p in prompts) == 0:
        raise ValueError("empty prompt: every prompt needs at least one token")
    ids = np.full((len(prompts), width), pad_id, np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = p
        mask[row, width - len(p) :] = True
    return ids, mask
