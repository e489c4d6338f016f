"""Study diagnostics: exact full-vocabulary KLs on a fixed probe set (never trained on).

Every ``train.diagnostics_every`` steps the learner samples fresh responses from the
current student π_t on the same ``train.diagnostic_prompts`` prompts (same sampling key
each time) and measures, per response token, averaged over the probe's tokens:

- ``probe_reverse_kl``: KL(π_t ‖ q), the quantity reverse-KL estimators estimate;
- ``probe_forward_kl``: KL(q ‖ π_t);
- ``probe_drift_kl``: KL(π_t ‖ π_b) against the behaviour policy π_b of the batch the
  learner is about to train on (its oldest version, ``probe_behaviour_version``): how far
  the learner has moved from the policy that sampled its data. 0 without staleness.

All three over the whole vocabulary, computed ``chunk`` positions at a time so that only
``[chunk, V]`` logits exist at once. Distributions are at the sampling temperature
(student, behaviour) and the scoring temperature (teacher), as the estimators see them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncopd_jax.alignment import response_hidden
from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.estimators import forward_kl_dense, reverse_kl_dense, token_mean
from asyncopd_jax.models.decoder import Decoder
from asyncopd_jax.sampling import Sampler, SamplingParams

Array = jax.Array


def exact_kls(
    student: Array,
    teacher: Array,
    behaviour: Array,
    student_head: Array,
    teacher_head: Array,
    mask: Array,
    *,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    chunk: int = 256,
) -> dict[str, Array]:
    """Token means of the exact reverse, forward and drift KLs from hidden states.

    Args:
      student, behaviour: ``[B, T, H]`` target-aligned hidden states of π_t and π_b
        (both with ``student_head``).
      teacher: ``[B, T, H']`` target-aligned teacher hidden states.
      student_head: ``[H, V]``; teacher_head: ``[H', V]``.
      mask: ``[B, T]`` response mask.
      chunk: positions per block of ``[chunk, V]`` logits.

    Returns:
      ``{"reverse": KL(π_t‖q), "forward": KL(q‖π_t), "drift": KL(π_t‖π_b)}``, fp32 scalars.
    """
    b, t = mask.shape
    n = b * t
    blocks = -(-n // chunk)

    def rows(h: Array) -> Array:  # [B, T, H] → [blocks, chunk, H]
        h = h.reshape(n, h.shape[-1])
        return jnp.pad(h, [(0, blocks * chunk - n), (0, 0)]).reshape(blocks, chunk, h.shape[-1])

    def one_block(xs):
        s, q, old = xs
        # a block of chunk positions as one [1, chunk, V] row: the estimators' [B, T, V]
        s_logits = (s @ student_head).astype(jnp.float32)[None] / student_temperature
        q_logits = (q @ teacher_head).astype(jnp.float32)[None] / teacher_temperature
        old_logits = (old @ student_head).astype(jnp.float32)[None] / student_temperature
        return (
            reverse_kl_dense(s_logits, q_logits)[0],
            forward_kl_dense(s_logits, q_logits)[0],
            reverse_kl_dense(s_logits, old_logits)[0],
        )

    per_position = jax.lax.map(one_block, (rows(student), rows(teacher), rows(behaviour)))
    reverse, forward, drift = (x.reshape(-1)[:n].reshape(b, t) for x in per_position)
    return {
        "reverse": token_mean(reverse, mask),
        "forward": token_mean(forward, mask),
        "drift": token_mean(drift, mask),
    }


class ProbeDiagnostics:
    """The fixed probe set and the jitted measurement on it.

    Args:
      graphdef: the student's graph definition.
      teacher: the teacher model.
      prompts: the probe prompts (token id lists), fixed for the run.
      sampling: the run's sampling parameters (temperature, length, stop tokens); no
        candidates or top-K are drawn for the probe.
      teacher_temperature: the scoring temperature.
      pad_id, prompt_slots: as for rollouts.
      seed: the probe's sampling key.
    """

    def __init__(
        self,
        *,
        graphdef: nnx.GraphDef,
        teacher: Decoder,
        prompts: list[list[int]],
        sampling: SamplingParams,
        teacher_temperature: float,
        pad_id: int,
        prompt_slots: int,
        seed: int,
        chunk: int = 256,
    ):
        self.graphdef = graphdef
        self.teacher_graphdef, self.teacher_state = nnx.split(teacher)
        self.prompts, self.prompt_slots, self.seed = prompts, prompt_slots, seed
        probe = SamplingParams(
            temperature=sampling.temperature,
            max_new_tokens=sampling.max_new_tokens,
            stop_token_ids=sampling.stop_token_ids,
            chunk_steps=sampling.max_new_tokens,
        )
        self.sampler = Sampler(graphdef, probe, pad_id=pad_id)
        self._measure = jax.jit(
            functools.partial(
                self._measure_fn,
                student_temperature=sampling.temperature,
                teacher_temperature=teacher_temperature,
                chunk=chunk,
            )
        )

    def _measure_fn(self, params, behaviour_params, teacher_state, batch: RolloutBatch, **kw) -> dict[str, Array]:
        student: Decoder = nnx.merge(self.graphdef, params)
        behaviour: Decoder = nnx.merge(self.graphdef, behaviour_params)
        teacher: Decoder = nnx.merge(self.teacher_graphdef, teacher_state)
        return exact_kls(
            response_hidden(student, batch),
            response_hidden(teacher, batch),
            response_hidden(behaviour, batch),
            student.lm_head_weight(),
            teacher.lm_head_weight(),
            batch.response_mask,
            **kw,
        )

    def measure(self, params: nnx.State, behaviour_params: nnx.State) -> dict[str, float]:
        """Sample the probe from ``params`` (π_t) and measure the three KLs."""
        batch = self.sampler.generate(params, self.prompts, jax.random.key(self.seed), prompt_slots=self.prompt_slots)
        kls = jax.device_get(self._measure(params, behaviour_params, self.teacher_state, batch))
        return {f"probe_{name}_kl": float(np.asarray(value)) for name, value in kls.items()}
