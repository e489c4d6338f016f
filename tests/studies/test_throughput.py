"""E4: the simulation against closed forms, the calibration read from a real trace file,
and the quick study end to end."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.studies import throughput
from asyncopd_jax.studies.throughput import (
    FULL,
    QUICK,
    _calibration,
    _verdict,
    best_async_over_sync,
    load_measurements,
    measured_rate,
    save_measurements,
    stage_costs,
)
from asyncopd_jax.studies.throughput_simulation import Lengths, StageCosts, fit_lengths, simulate_split, simulate_sync

B, L = 8, 10
EVEN = Lengths(mean=L, sigma=0.0, cap=100)  # every answer exactly L tokens


def _costs(decode=0.01, score=1e-3, learn=2e-3, publish=0.005) -> StageCosts:
    return StageCosts(
        decode_step_s=decode,
        score_token_s=score,
        learn_token_s=learn,
        publish_s=publish,
        rows=B,
        mean_length=L,
        longest_over_mean=1.0,
    )


def test_sync_is_generate_then_score_and_learn_on_every_device():
    c = _costs()
    for devices in (1, 4):
        step = c.decode_step_s * L + (c.score_token_s + c.learn_token_s) * B * L + c.publish_s
        assert simulate_sync(c, EVEN, devices, steps=5) == pytest.approx(devices * B / step)


@pytest.mark.parametrize("learn", [1e-4, 5e-3])  # rollout-bound, learner-bound
def test_fully_async_runs_at_its_slower_side(learn):
    c = _costs(learn=learn)
    devices, rollout_devices = 4, 2
    # a rollout device finishes its B rows every L decode steps, then scores them
    rollout_rate = rollout_devices * B / (c.decode_step_s * L + c.score_token_s * B * L)
    learn_rate = devices * B / (c.learn_token_s * devices * B * L / (devices - rollout_devices) + c.publish_s)
    rate = simulate_split(c, EVEN, devices, rollout_devices, steps=40, continuous=True, eta=2)
    assert rate == pytest.approx(min(rollout_rate, learn_rate), rel=0.02)


def test_no_staleness_allowed_means_no_overlap():
    # η = 0 (AReaL's capacity rule): the next batch may not start before the learner has
    # updated, so generation and learning alternate
    c = _costs()
    devices, rollout_devices = 2, 1
    generate = (devices * B / (rollout_devices * B)) * (c.decode_step_s * L + c.score_token_s * B * L)
    learn = c.learn_token_s * devices * B * L / (devices - rollout_devices) + c.publish_s
    rate = simulate_split(c, EVEN, devices, rollout_devices, steps=20, continuous=True, eta=0)
    assert rate == pytest.approx(devices * B / (generate + learn), rel=0.02)


def test_long_tails_hurt_whole_batch_generation_more_than_continuous():
    c = _costs(learn=1e-4)
    tail = Lengths(mean=L, sigma=1.0, cap=16 * L)
    batchwise = simulate_split(c, tail, 4, 3, steps=30, continuous=False, eta=1)
    continuous = simulate_split(c, tail, 4, 3, steps=30, continuous=True, eta=1)
    assert continuous > 1.5 * batchwise
    assert simulate_sync(c, tail, 4, steps=30) < simulate_sync(c, EVEN, 4, steps=30) / 1.5


def test_fit_lengths_recovers_the_spread():
    rng = np.random.default_rng(1)
    x = Lengths(mean=20.0, sigma=0.4, cap=1e9).draw(rng, 4000 * 16).reshape(4000, 16).astype(float)
    costs = StageCosts(
        0.0, 0.0, 0.0, 0.0, rows=16, mean_length=20.0, longest_over_mean=float(np.mean(x.max(1) / x.mean(1)))
    )
    assert fit_lengths(costs, cap=1e9).sigma == pytest.approx(0.4, abs=0.03)


def test_stage_costs_and_rate_from_a_trace_and_metrics(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("asyncopd_jax.pipeline.trace.time.time", lambda: now[0])
    tracer = Tracer(origin=1000.0)

    def span(name, seconds, **args):
        with tracer.span(name) as info:
            info.update(args)
            now[0] += seconds

    span("rollout", 9.0, rows=4, tokens=20, longest=6)  # before the window: left out
    span("rollout", 1.2, rows=4, tokens=20, longest=6)
    span("score", 0.4)
    span("learn", 0.6)
    span("publish", 0.1)
    span("rollout", 0.8, rows=4, tokens=12, longest=4)
    span("score", 0.2)
    span("learn", 0.3)
    span("proximal", 0.1)
    tracer.write(tmp_path / "trace.json")
    c = stage_costs(tmp_path / "trace.json", (5.0, 100.0))
    assert c.decode_step_s == pytest.approx((1.2 / 6 + 0.8 / 4) / 2)
    assert c.score_token_s == pytest.approx(0.6 / 32)
    assert c.learn_token_s == pytest.approx(1.0 / 32)
    assert c.publish_s == pytest.approx(0.1)
    assert (c.rows, c.mean_length) == (4, 4.0)
    assert c.longest_over_mean == pytest.approx((6 / 5 + 4 / 3) / 2)
    records = [
        {"samples_per_s": 10.0, "time": 1.0, "trace_s": 5.0},
        {"samples_per_s": 10.0, "time": 2.0, "trace_s": 6.0},
        {"samples_per_s": 12.0, "time": 4.0, "trace_s": 7.0},
    ]
    assert measured_rate(records, skip=2) == pytest.approx((48 - 20) / 1.0)


def _measured(rates: dict[str, list[float]], balance="small batch (B = 16)"):
    """QUICK's modes at one balance with per-round ``rates``; sync's costs differ per round."""
    return {
        (balance, mode, placement): {
            "rates": rates[mode],
            "sets": [f"schedule.mode={mode}"],
            "costs": [_costs(decode=0.01 * (r + 1)) for r in range(len(rates[mode]))] if mode == "sync" else [],
            "date": "2026-11-24",
        }
        for mode, placement in QUICK.modes
    }


def test_ratios_are_taken_within_a_round_and_the_calibration_is_the_median_round():
    measured = _measured({"sync": [100.0, 50.0, 80.0], "fully_async": [150.0, 100.0, 80.0]})
    assert best_async_over_sync(measured, "small batch (B = 16)", QUICK) == [1.5, 2.0, 1.0]
    assert _calibration(measured, "small batch (B = 16)").decode_step_s == pytest.approx(0.03)  # 80: round 2


@pytest.mark.parametrize(
    "async_rate,builtin,tail,verdict",
    [
        (200.0, 2.0, 3.0, "reproduced: every measured and simulated case is in AsyncOPD's range"),
        (110.0, 1.0, 1.2, "not reproduced: no measured or simulated case reaches AsyncOPD's range"),
        (
            110.0,
            1.0,
            3.0,
            "partly reproduced: in AsyncOPD's range only 2 of 5 cases (simulated long-tailed answers, "
            "D = 2; simulated long-tailed answers, D = 4)",
        ),
    ],
)
def test_the_speed_up_verdict_names_the_cases_in_the_published_range(async_rate, builtin, tail, verdict):
    measured = _measured({"sync": [100.0], "fully_async": [async_rate]})
    simulated = {
        (shape, d): (1.0, 1.0, speedup)
        for d in QUICK.devices
        for shape, speedup in (("builtin", builtin), ("long_tail", tail))
    }
    text = _verdict(measured, simulated, QUICK)
    assert text.endswith(f"Verdict on AsyncOPD's speed-up: {verdict}."), text


def test_saved_measurements_read_back_only_for_the_same_settings(tmp_path):
    measured = _measured({"sync": [100.0, 90.0], "fully_async": [150.0, 140.0]})
    path = tmp_path / "measured.json"
    save_measurements(path, measured, QUICK)
    assert load_measurements(path, QUICK) == measured
    assert load_measurements(path, FULL) is None and load_measurements(tmp_path / "none.json", QUICK) is None


def test_a_balance_measured_before_with_the_same_overrides_is_not_run_again(tmp_path, monkeypatch):
    """Another balance added to the settings: the saved one is taken (with its date), only
    the new one is trained."""
    balance = "small batch (B = 16)"
    measured = _measured({"sync": [100.0], "fully_async": [150.0]})
    for (b, mode, placement), entry in measured.items():
        entry["sets"] = throughput._sets(mode, placement, b, QUICK)
    path = tmp_path / "measured.json"
    save_measurements(path, measured, QUICK)
    more = dataclasses.replace(QUICK, balances=(balance, "demo (B = 64)"))
    trained = []

    def fake_training(work, name, sets, base):
        trained.append((name, base.name))
        records = [{"trace_s": float(i), "time": float(i), "samples_per_s": 16.0} for i in range(1, 9)]
        return {"error": None, "records": records, "sets": sets}

    monkeypatch.setattr(throughput, "run_training", fake_training)
    monkeypatch.setattr(throughput, "stage_costs", lambda trace, window: _costs())
    earlier = throughput.earlier_measurements(path, more)
    got = throughput._measure(tmp_path / "work", more, earlier=earlier)
    assert {name.split("-")[0] for name, _ in trained} == {"demo"} and len(trained) == 2
    assert {key: got[key] for key in measured} == measured
    assert got["demo (B = 64)", "sync", "threads"]["date"] == time.strftime("%Y-%m-%d")
    assert throughput.earlier_measurements(path, dataclasses.replace(more, steps=9)) == {}


@pytest.mark.slow
def test_the_quick_study_writes_its_report(tmp_path):
    path = throughput.run(tmp_path / "docs", tmp_path / "work", quick=True, command="asyncopd study x")
    text = path.read_text()
    assert "## Measured on this machine" in text and "### Answer lengths: long_tail" in text
    assert (tmp_path / "docs" / "throughput" / "speedup.png").is_file() and "Verdict on AsyncOPD's speed-up" in text
    # the measurements are saved: the report is rebuilt from them without measuring again
    again = throughput.run(tmp_path / "docs", tmp_path / "nowhere", quick=True, command="asyncopd study x")
    assert again.read_text() == text and not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("async_rate,tail,says", [(250.0, 2.3, "reaches it (within"), (130.0, 2.3, "does not reach")])
def test_the_long_tailed_task_is_set_against_the_simulated_long_tail(async_rate, tail, says):
    measured = _measured({"sync": [100.0], "fully_async": [async_rate]}, balance=throughput.LONG_TAILED)
    s = dataclasses.replace(QUICK, balances=(throughput.LONG_TAILED,))
    simulated = {(shape, d): (1.0, 1.0, tail) for d in QUICK.devices for shape in ("builtin", "long_tail")}
    text = _verdict(measured, simulated, s)
    assert f"schedule is {async_rate / 100:.3g}× sync; the simulation predicts {tail:.2f}×" in text
    assert f"D = 2 separate devices: the measurement {says}" in text
    sampling, scoring, learning = measured[throughput.LONG_TAILED, "sync", "threads"]["costs"][0].batch_seconds()
    best = (sampling + scoring + learning) / max(sampling + scoring, learning)
    assert (
        f"{learning:.2f} s learning (the stage spans): overlapped on separate hardware that is at best {best:.2f}×"
        in text
    )
