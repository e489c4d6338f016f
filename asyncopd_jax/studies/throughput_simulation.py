"""E4's discrete-event simulation: the samples/s of ``sync``, ``n_step_off`` and ``fully_async``
on D devices, calibrated on the stage costs measured on this machine. The model (what a
device does in each schedule, the answer lengths) is set out in
:mod:`asyncopd_jax.studies.throughput`, the study that measures the costs and reports."""

from __future__ import annotations

import dataclasses
import heapq
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Per-unit costs of the stages on this machine, from a sync run's trace (in sync the
    stages run one after another, so each span is its stage's cost alone).

    Attributes:
      decode_step_s: seconds per decode step of a batch (``rollout`` span / its longest row).
      score_token_s: teacher-scoring seconds per response token.
      learn_token_s: learning seconds (learn + proximal) per response token.
      publish_s: seconds to publish one policy version.
      rows: rows per batch (B).
      mean_length: response tokens per row.
      longest_over_mean: mean over batches of (longest row / mean row).
    """

    decode_step_s: float
    score_token_s: float
    learn_token_s: float
    publish_s: float
    rows: int
    mean_length: float
    longest_over_mean: float

    def batch_seconds(self) -> tuple[float, float, float]:
        """Seconds per batch of sampling (until its longest row ends), scoring and learning
        (with the publish)."""
        tokens = self.rows * self.mean_length
        sampling = self.decode_step_s * self.longest_over_mean * self.mean_length
        return sampling, self.score_token_s * tokens, self.learn_token_s * tokens + self.publish_s

    @property
    def rollout_over_learn(self) -> float:
        """ρ: seconds to sample and score a batch over seconds to learn from it."""
        sampling, scoring, learning = self.batch_seconds()
        return (sampling + scoring) / learning


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Response lengths: a log-normal with mean ``mean`` and log-spread ``sigma``, capped."""

    mean: float
    sigma: float
    cap: float

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        mu = np.log(self.mean) - self.sigma**2 / 2  # E = mean before the cap
        return np.clip(np.round(rng.lognormal(mu, self.sigma, n)), 1, self.cap).astype(np.int64)


def fit_lengths(costs: StageCosts, cap: float) -> Lengths:
    """The log-normal whose longest-of-B over mean matches the measured one."""
    rng = np.random.default_rng(0)
    z = rng.standard_normal((400, costs.rows))

    def ratio(sigma):
        x = np.minimum(np.exp(sigma * z - sigma**2 / 2), cap / costs.mean_length)
        return float(np.mean(x.max(axis=1) / x.mean(axis=1)))

    lo, hi = 0.0, 3.0
    for _ in range(40):  # ratio grows with sigma
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) < costs.longest_over_mean else (lo, mid)
    return Lengths(costs.mean_length, (lo + hi) / 2, cap)


def simulate_sync(costs: StageCosts, lengths: Lengths, devices: int, steps: int, seed: int = 0) -> float:
    """Samples/s of synchronous OPD on ``devices`` devices (global batch devices·B)."""
    rng = np.random.default_rng(seed)
    total = 0.0
    for _ in range(steps):
        rows = lengths.draw(rng, devices * costs.rows).reshape(devices, costs.rows)
        generate = costs.decode_step_s * rows.max()  # every device waits for the slowest
        tokens_per_device = rows.sum(axis=1).max()
        total += generate + (costs.score_token_s + costs.learn_token_s) * tokens_per_device + costs.publish_s
    return steps * devices * costs.rows / total


def simulate_split(
    costs: StageCosts,
    lengths: Lengths,
    devices: int,
    rollout_devices: int,
    steps: int,
    *,
    continuous: bool,
    eta: int,
    seed: int = 0,
) -> float:
    """Samples/s with ``rollout_devices`` generating and the rest learning (global batch
    devices·B per optimizer step). ``continuous``: a finished row's slot takes the next
    prompt at once (fully async); otherwise a device starts a new batch of B rows only when
    all of its rows are done (n-step-off). Rows start only while AReaL's capacity rule
    allows: started ≤ devices·B·(version + eta + 1).
    """
    rng = np.random.default_rng(seed)
    batch = devices * costs.rows
    learn_devices = devices - rollout_devices
    slots = costs.rows
    started = 0
    version = 0
    ready: list[int] = []  # lengths of finished, scored rows waiting for the learner
    learner_free_at = 0.0
    # per rollout device: remaining tokens of each active row (0: free slot)
    remaining = np.zeros((rollout_devices, slots), np.int64)
    total_len = np.zeros((rollout_devices, slots), np.int64)
    events: list[tuple[float, int, str, int, Any]] = []  # (time, order, kind, device, finished lengths)
    order = iter(range(1 << 62))  # ties keep insertion order
    waiting: set[int] = set()  # rollout devices blocked by the capacity rule
    step_times: list[float] = []

    def push(time: float, kind: str, device: int = -1, payload: Any = None) -> None:
        heapq.heappush(events, (time, next(order), kind, device, payload))

    def fill(d: int) -> None:
        nonlocal started
        free = np.flatnonzero(remaining[d] == 0)
        if not continuous and free.size < slots:
            return  # batch-synchronous: a new batch only when the whole batch is done
        room = batch * (version + eta + 1) - started
        n = int(min(free.size, max(room, 0)))
        if n:
            new = lengths.draw(rng, n)
            remaining[d, free[:n]] = new
            total_len[d, free[:n]] = new
            started += n

    def try_learn(now: float) -> None:
        nonlocal learner_free_at
        if len(ready) >= batch and learner_free_at <= now:
            tokens = sum(ready[:batch])
            del ready[:batch]
            learner_free_at = now + costs.learn_token_s * tokens / learn_devices + costs.publish_s
            push(learner_free_at, "learned")

    for d in range(rollout_devices):
        push(0.0, "decode", d)
    while len(step_times) < steps:
        now, _, kind, d, payload = heapq.heappop(events)
        if kind == "learned":  # a new policy version: blocked devices may start rows again
            version += 1
            step_times.append(now)
            for w in sorted(waiting):
                push(now, "decode", w)
            waiting.clear()
            try_learn(now)
        elif kind == "ready":  # rows finished and scored
            ready.extend(payload)
            try_learn(now)
        else:  # one decode step of device d (and the scoring of the rows it finishes)
            fill(d)
            active = remaining[d] > 0
            if not active.any():
                waiting.add(d)
                continue
            remaining[d, active] -= 1
            finished = total_len[d, active & (remaining[d] == 0)]
            busy = costs.decode_step_s + costs.score_token_s * finished.sum()
            if finished.size:
                push(now + busy, "ready", d, finished.tolist())
            push(now + busy, "decode", d)
    # the rate over the steady part (after a fifth of the steps)
    first = steps // 5
    return (
        (steps - first) * batch / (step_times[-1] - step_times[first - 1]) if first else steps * batch / step_times[-1]
    )


def best_split(
    costs: StageCosts, lengths: Lengths, devices: int, steps: int, *, continuous: bool, eta: int
) -> tuple[float, int]:
    """The highest samples/s over the splits (rollout devices) tried, and that split."""
    candidates = sorted({min(devices - 1, max(1, round(devices * f))) for f in np.linspace(0.1, 0.9, 9)})
    rates = {r: simulate_split(costs, lengths, devices, r, steps, continuous=continuous, eta=eta) for r in candidates}
    best = max(rates, key=rates.__getitem__)
    return rates[best], best
