"""A latency added to every environment step: a tool that takes time, for the studies and
benchmarks that measure what overlapping tool calls with decoding gives
(``environment.latency_s``; ``docs/multi_turn.md``).

A step's latency is drawn from a :class:`Latency` law: ``median_s`` each time (``fixed``),
or lognormal about it (``lognormal``: ``median_s · exp(σ z)``, z standard normal; with
σ = 1 a tenth of the steps take 3.6× the median and a hundredth 10×). The step sleeps it
on its worker thread before the environment answers, so the decode loop sees it as it
would a slow tool.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from asyncopd_jax.environments.protocol import Environment, Observation

LatencyLaw = Literal["fixed", "lognormal"]


@dataclasses.dataclass(frozen=True)
class Latency:
    """A law of added step latencies (module docstring); ``median_s = 0``: none."""

    median_s: float = 0.0
    law: LatencyLaw = "fixed"
    sigma: float = 1.0

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``[n]`` latencies in seconds."""
        if self.law == "fixed":
            return np.full(n, self.median_s)
        return self.median_s * np.exp(self.sigma * rng.standard_normal(n))


class Delayed:
    """An :class:`~asyncopd_jax.environments.protocol.Environment` whose every step first
    sleeps a latency drawn from ``latency`` with ``rng`` (its own: steps of different
    environments run on different threads)."""

    def __init__(self, inner: Environment, latency: Latency, rng: np.random.Generator):
        self.inner, self.latency, self.rng = inner, latency, rng

    def step(self, turn: str) -> Observation:
        time.sleep(float(self.latency.draw(self.rng, 1)[0]))
        return self.inner.step(turn)


def delayed(make: Callable[[Any], Environment], latency: Latency, seed: int) -> Callable[[Any], Environment]:
    """``make`` (a problem → its environment) with each environment :class:`Delayed` by
    ``latency``, each with a generator of its own drawn from ``seed`` (``make`` itself where
    the latency is 0). Call the result from one thread: the seeds are drawn in call order."""
    if not latency.median_s:
        return make
    seeds = np.random.default_rng(seed)
    return lambda problem: Delayed(make(problem), latency, np.random.default_rng(int(seeds.integers(2**63))))


__all__ = ["Delayed", "Latency", "LatencyLaw", "delayed"]
