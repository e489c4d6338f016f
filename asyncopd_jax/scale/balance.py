"""The pipeline's balance at the roofline: each stage's time per rollout batch, from the
figures the compiler gives a plan.

Per rollout batch of B sequences (M optimizer steps, then one published version), with k
samplers of S slots (static: groups of G rows), m teachers, answers of R̄ tokens expected
out of T, prompts of P slots:

    learning = M · step + publish
    rollout  = per sampler, its B / k prompts as its engine runs them
               (:meth:`~asyncopd_jax.sampling.Engine.batch_seconds`):
               static      ⌈B / (G · k)⌉ · (prefill + T · decode)
               continuous  B / k · (prefill / S + R̄ / S · step(S, c̄))
               + load + recompute                       (the version's swap)
    scoring  = ⌈B / (G · m)⌉ · scoring of one group

``step(S, c̄)`` is a decode step of S busy slots, each attending over the mean context a
busy slot holds, ``c̄ = P + R̄ / 2``, at the roofline: ``max(FLOPs / peak, (weights + S · c̄ ·
KV bytes per token) / HBM bandwidth)``, the weights and the KV cache per chip as the
sampler's mesh places them (:class:`DecodeBytes`, of the cache the engine names:
:meth:`~asyncopd_jax.sampling.Engine.decode_cache`). The continuous engine's stream outlives
a batch, so its slots stay busy across batches and no tail is counted (measured on CPU:
0.96 of the slot-steps sampled, ``docs/results.md``). Its recompute after a swap rewrites
the live slots' ``S · c̄`` tokens: the compiled worst case (``S · (P + T)``) scaled by
``c̄ / (P + T)``. A ``sync`` schedule swaps while the stream is idle and ``fixed_lag``
never swaps mid-answer: no recompute.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from asyncopd_jax.config import RunConfig
from asyncopd_jax.sampling.engine import BatchFigures, Engine
from asyncopd_jax.scale.chips import Chip
from asyncopd_jax.scale.flops import transformer_flops
from asyncopd_jax.scale.swaps import SwapFigures


@dataclasses.dataclass(frozen=True)
class DecodeBytes:
    """What a continuous decode step reads per chip besides its activations: the weights
    (in the sampler's compute dtype) and its KV cache per token of context."""

    weights: int
    kv_per_token: float


@dataclasses.dataclass(frozen=True)
class Answers:
    """The answers' lengths a balance assumes: ``mean`` tokens expected (R̄) of at most
    ``limit`` (T) after ``prompt`` slots (P)."""

    prompt: int
    limit: int
    mean: float

    def __post_init__(self) -> None:
        if not 0 < self.mean <= self.limit:
            raise ValueError(
                f"--mean-response-tokens {self.mean:g} is invalid; expected 0 < it <= the response tokens {self.limit}"
            )


def decode_step_seconds(config: Any, slots: int, chips: int, context: float, held: DecodeBytes, chip: Chip) -> float:
    """One decode step of ``slots`` busy slots, each over ``context`` tokens, on a sampler of
    ``chips`` chips, at the roofline (module docstring): the textbook FLOPs of one token per
    slot (attention over ``context``) against the weights and context's KV bytes per chip."""
    q = config.num_attention_heads * config.head_dim
    flops = transformer_flops(config, slots, 1, 1, backward=False) + slots * config.num_hidden_layers * 4 * context * q
    read = held.weights + slots * context * held.kv_per_token
    return max(flops / chips / chip.peak_flops, read / chip.hbm_bytes_per_s)


@dataclasses.dataclass(frozen=True)
class RolloutCost:
    """One sampler's share of a batch, split as the module docstring's formula is."""

    prefill: float
    decode: float
    swap: float  # load + recompute

    @property
    def total(self) -> float:
        return self.prefill + self.decode + self.swap


def rollout_seconds(
    cfg: RunConfig,
    engine: Engine,
    config: Any,
    answers: Answers,
    *,
    samplers: int,
    rows: int,
    chips: int,
    prefill: float,
    decode: float,
    recompute: float,
    held: DecodeBytes | None,
    swap: SwapFigures | None,
    chip: Chip,
) -> RolloutCost:
    """One sampler's time per batch (module docstring): its prompts as ``engine`` runs them
    (:meth:`~asyncopd_jax.sampling.Engine.batch_seconds`), then the version's swap.

    Args:
      engine: the rollout stage's, at the answers' limit (T).
      samplers: k, the rollout stages.
      rows: the rows of one prefill / decode call: the group (static) or the slots S.
      chips: the sampler's chips.
      prefill, decode, recompute: the compiled calls' roofline seconds (decode: one step of
        ``rows`` rows over the whole cache).
      held: the weights and KV bytes per chip a modelled decode step reads (None: the
        engine models none, :meth:`~asyncopd_jax.sampling.Engine.decode_cache`).
      swap: the version's cost (None: not counted).
    """

    def step(context: float) -> float:
        if held is None:
            raise ValueError(f"{type(engine).__name__}'s balance models its decode steps: it needs their bytes")
        return decode_step_seconds(config, rows, chips, context, held, chip)

    batch = BatchFigures(cfg.learner.batch_size, samplers, rows, answers.prompt, answers.mean, prefill, decode, step)
    before, during, recompute_share = engine.batch_seconds(batch)
    swaps = 0.0
    if swap is not None:
        swaps = swap.load_seconds
        if cfg.schedule.mode not in ("sync", "fixed_lag"):
            swaps += recompute * recompute_share
    return RolloutCost(before, during, swaps)
