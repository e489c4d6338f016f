"""The latency added to environment steps (``environment.latency_s``): its two laws, the
sleep before each step, and one generator per environment drawn in order from the seed."""

from __future__ import annotations

import numpy as np

from asyncopd_jax.environments import latency as latency_module
from asyncopd_jax.environments.latency import Delayed, Latency, delayed
from asyncopd_jax.environments.protocol import Observation


class Echo:
    def step(self, turn: str) -> Observation:
        return Observation(text=turn.upper())


def test_the_fixed_law_is_its_median_and_the_lognormal_one_is_centred_on_it():
    rng = np.random.default_rng(0)
    assert (Latency(0.2).draw(rng, 5) == 0.2).all()
    draws = Latency(0.1, "lognormal", sigma=1.0).draw(rng, 40_000)
    assert abs(np.median(draws) / 0.1 - 1) < 0.03
    # lognormal with σ = 1: the 90th percentile is e^1.2816 ≈ 3.60× the median, the 99th e^2.3263 ≈ 10.2×
    np.testing.assert_allclose(np.quantile(draws, [0.9, 0.99]) / 0.1, [3.60, 10.24], rtol=0.06)
    wide = Latency(0.1, "lognormal", sigma=2.0).draw(rng, 40_000)
    np.testing.assert_allclose(np.quantile(wide, 0.9) / 0.1, np.exp(2 * 1.2816), rtol=0.08)


def test_each_step_sleeps_a_drawn_latency_before_the_environment_answers(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(latency_module.time, "sleep", slept.append)
    environment = Delayed(Echo(), Latency(0.05, "lognormal"), np.random.default_rng(1))
    assert [environment.step(t).text for t in ("a", "b", "c")] == ["A", "B", "C"]
    want = Latency(0.05, "lognormal").draw(np.random.default_rng(1), 1)[0]
    assert len(slept) == 3 and slept[0] == want and len(set(slept)) == 3


def test_environments_get_their_own_generators_in_call_order_and_none_without_a_latency():
    def make(problem: int) -> Echo:
        return Echo()

    assert delayed(make, Latency(0.0), seed=0) is make
    first, second = delayed(make, Latency(0.1, "lognormal"), seed=3), delayed(make, Latency(0.1, "lognormal"), seed=3)
    a = [first(i) for i in range(3)]
    b = [second(i) for i in range(3)]
    assert all(isinstance(e, Delayed) for e in a)
    draws = [e.latency.draw(e.rng, 2).tolist() for e in a]
    assert draws == [e.latency.draw(e.rng, 2).tolist() for e in b]  # the same seed: the same latencies
    assert len({tuple(d) for d in draws}) == 3  # each environment its own
