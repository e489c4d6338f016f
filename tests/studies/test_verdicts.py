"""The rules the studies' verdicts apply: trains, beats, exact staleness."""

from __future__ import annotations

import math

from asyncopd_jax.studies.verdicts import TRAINS_ABOVE, beats, exact_staleness_note, student_before, trains


def test_a_setting_trains_when_its_mean_ends_ten_points_above_the_start():
    assert trains([0.15, 0.14], before=0.04)
    assert not trains([0.13, 0.14], before=0.04)  # 9.5 points above
    assert not trains([0.26, 0.0], before=0.04)  # one good seed that leaves the mean under 14 %...
    assert trains([0.30, 0.0], before=0.04)  # ...or one that lifts it over: the mean decides
    assert TRAINS_ABOVE == 0.10


def test_beating_needs_more_than_either_seed_spread():
    assert beats([0.80, 0.82], [0.70, 0.72])
    assert not beats([0.80, 0.82], [0.70, 0.90])  # b's half-range (10 points) swallows the 1-point gap
    assert not beats([0.70, 0.90], [0.70, 0.72])  # so does a's
    assert not beats([0.805, 0.805], [0.80, 0.80])  # inside the least difference (1 point)
    assert beats([0.805, 0.805], [0.80, 0.80], least=0.001)
    assert not beats([0.70, 0.72], [0.80, 0.82])  # not symmetric


def test_the_starting_point_is_read_off_the_first_run_that_measured_it():
    results = {"failed": {"summary": {}}, "a": {"summary": {"teacher_accuracy": 0.99, "student_before": 0.04}}}
    assert student_before(results) == (0.99, 0.04)
    assert all(math.isnan(x) for x in student_before({"failed": {"summary": {}}}))


def _lagged(lag: int, steps: int, off_at: int | None = None) -> dict:
    records = [
        {"step": t, "staleness_mean": float(min(t - 1, lag)), "staleness_max": min(t - 1, lag)}
        for t in range(1, steps + 1)
    ]
    if off_at is not None:
        records[off_at - 1]["staleness_mean"] = lag - 0.5  # one token a version fresher than k
    return {"records": records}


def test_the_staleness_note_checks_every_step_after_k():
    good = {("e", 0): _lagged(0, 5), ("e", 3): _lagged(3, 6)}
    assert exact_staleness_note(good, lambda key: key[1]).startswith("Staleness: in all 2 runs")
    bad = {**good, ("e", 2): _lagged(2, 6, off_at=5)}
    assert (
        exact_staleness_note(bad, lambda key: key[1]) == "Staleness was NOT exactly k after step k in 1 runs: ('e', 2)."
    )
    # a run that never got past step k proves nothing
    assert "NOT" in exact_staleness_note({("e", 4): _lagged(4, 4)}, lambda key: key[1])
