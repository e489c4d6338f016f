"""The sampling distribution, exactly: temperature, optional top-k / top-p, log-probs."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the student samples (static: part of the compiled decode loop).

    Attributes:
      temperature: ``τ > 0`` samples from ``softmax(z / τ)``; ``0`` is greedy.
      top_p: nucleus truncation (1.0 = off).
      top_k: keep the k most likely ids (0 = off).
      max_new_tokens: response length limit T.
      stop_token_ids: ids that end a response (the stop token is part of it).
      num_candidates: N Monte-Carlo candidates per position (0 = none).
      student_topk: record the sampling student's top-K ids per position (0 = none).
      chunk_steps: decode steps between checks for new weights (interruptible generation).
      allow_truncated_mc: permit MC candidates with top-p / top-k (the estimators then
        target the truncated distribution, which is rarely what you want).
      compute_dtype: the dtype the sampler computes in, its weights cast to it inside the
        compiled functions (None: the weights' own); "bfloat16" samples an fp32 student in
        bf16 with a bf16 KV cache (half the cache's bytes). The recorded behaviour
        log-probs (fp32) are then those of the bf16 model: of the distribution actually
        sampled, which is what the estimators need.
      kv_dtype: the KV cache's dtype (None: the compute dtype's). "bfloat16" under fp32
        compute halves the cache's bytes, and so a decode step's reads of it, at the cost of
        the keys' and values' rounding: the recorded behaviour log-probs are those of the
        model that read the rounded cache, the distribution actually sampled, which the
        learner's fp32 recompute of the same tokens differs from by that rounding
        (``docs/results.md`` measures the gap).
      recompute_chunk: cache slots per chunk of the prefill and of the KV cache's in-place
        recompute after a weight swap: each chunk's attention holds ``[B, N_q, chunk, P + T]``
        fp32 scores (per device: its rows), and each chunk reads all the weights once.
        Keep it small on TPU: from 32 slots on, XLA:TPU lays the cached values out for the
        chunk's ``probs · values`` with the slots minor and copies every layer's values into
        that layout on entry, a half cache of temporaries (Qwen3-1.7B, 64 rows × 4,096 slots
        on 4 v5e chips: 16 → 1.77 GiB of temporaries, 256 → 8.28 GiB; ``asyncopd plan``).
      engine: ``"static"`` decodes a batch of prompts in lockstep until its longest answer
        ends (:class:`~asyncopd_jax.sampling.Sampler`); ``"continuous"`` keeps ``slots``
        sequences in flight and refills a slot with the next prompt as soon as its answer
        ends, over a paged KV cache (:class:`~asyncopd_jax.sampling.ContinuousSampler`).
      slots: continuous engine: sequences decoded at once (0: one per prompt of a call).
      page_size: continuous engine: tokens per page of the paged KV cache.
      kv_pages: continuous engine: pages in the pool (0: enough for every slot's longest
        sequence, never preempting). Fewer pages hold only the tokens written; a slot that
        finds none free preempts the most recently admitted sequence, which is re-queued
        and re-sampled from its start (with the same key: the same answer, unless the
        weights changed meanwhile).
      tool_call_ids: multi-turn rollouts (continuous engine only): a turn that samples one
        of these ids (a tool call's opening, e.g. Qwen3's ``<tool_call>``) and ends on a stop
        token parks its sequence, its pages kept, until the environment's observation joins
        the context and the next turn starts; a turn without one ends the episode. Empty:
        single-turn.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    num_candidates: int = 0
    student_topk: int = 0
    chunk_steps: int = 32
    allow_truncated_mc: bool = False
    compute_dtype: Literal["float32", "bfloat16"] | None = None
    kv_dtype: Literal["float32", "bfloat16"] | None = None
    recompute_chunk: int = 256
    engine: Literal["static", "continuous"] = "static"
    slots: int = 0
    page_size: int = 16
    kv_pages: int = 0
    tool_call_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, "temperature", self.temperature, ">= 0"),
            (0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]"),
            (self.top_k >= 0, "top_k", self.top_k, ">= 0 (0 = off)"),
            (self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, ">= 1"),
            (self.num_candidates >= 0, "num_candidates", self.num_candidates, ">= 0"),
            (self.student_topk >= 0, "student_topk", self.student_topk, ">= 0"),
            (self.chunk_steps >= 1, "chunk_steps", self.chunk_steps, ">= 1"),
            (self.recompute_chunk >= 1, "recompute_chunk", self.recompute_chunk, ">= 1"),
            (self.engine in ("static", "continuous"), "engine", self.engine, "static or continuous"),
            (self.slots >= 0, "slots", self.slots, ">= 0 (0 = one per prompt)"),
            (self.page_size >= 1, "page_size", self.page_size, ">= 1"),
            (self.kv_pages >= 0, "kv_pages", self.kv_pages, ">= 0 (0 = every slot's longest sequence)"),
            (
                self.compute_dtype in (None, "float32", "bfloat16"),
                "compute_dtype",
                self.compute_dtype,
                "null, float32 or bfloat16",
            ),
            (self.kv_dtype in (None, "float32", "bfloat16"), "kv_dtype", self.kv_dtype, "null, float32 or bfloat16"),
        ]
        for ok, field, value, allowed in checks:
            if not ok:
                raise ValueError(f"sampling.{field} = {value!r} is invalid; allowed: {allowed}")
        if self.tool_call_ids and self.engine != "continuous":
            raise ValueError(
                "sampling.tool_call_ids: multi-turn rollouts park a sequence between turns, which only the continuous "
                "engine does; set sampling.engine = continuous"
            )
        if self.num_candidates and self.temperature == 0:
            raise ValueError(
                "sampling.num_candidates > 0 needs temperature > 0: greedy decoding has no distribution to draw from"
            )
        if self.num_candidates and self.truncated and not self.allow_truncated_mc:
            raise ValueError(
                f"sampling.top_p={self.top_p} / top_k={self.top_k} truncate the sampling distribution, so Monte-Carlo "
                "candidates and behaviour log-probs no longer describe the untruncated student the estimators "
                "assume; set top_p=1.0 and top_k=0, or sampling.allow_truncated_mc=true to opt in"
            )

    @property
    def truncated(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0


def sampling_logprobs(logits: Array, params: SamplingParams) -> Array:
    """Log-probs of the distribution the sampler actually draws from: ``[..., V]`` fp32.

    ``log softmax(z / τ)``, then (if configured) ids outside the top-k and outside the
    smallest set whose probability reaches top-p are set to −inf and the rest
    renormalised. Greedy (``τ = 0``) is the point mass on the argmax (log-prob 0).
    """
    logits = logits.astype(jnp.float32)
    if params.temperature == 0:
        best = jnp.argmax(logits, axis=-1)
        return jnp.where(jnp.arange(logits.shape[-1]) == best[..., None], 0.0, -jnp.inf)
    logp = jax.nn.log_softmax(logits / params.temperature, axis=-1)
    if params.top_k:
        kth = jax.lax.top_k(logp, params.top_k)[0][..., -1:]
        logp = jnp.where(logp >= kth, logp, -jnp.inf)
    if params.top_p < 1.0:
        sorted_logp = jnp.sort(logp, axis=-1)[..., ::-1]
        mass_before = jnp.cumsum(jnp.exp(sorted_logp), axis=-1) - jnp.exp(sorted_logp)
        # The smallest kept log-prob: the last id whose preceding mass is still < top_p.
        n_keep = jnp.sum(mass_before < params.top_p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(sorted_logp, n_keep - 1, axis=-1)
        logp = jnp.where(logp >= threshold, logp, -jnp.inf)
    if params.truncated:
        logp = jax.nn.log_softmax(logp, axis=-1)
    return logp
