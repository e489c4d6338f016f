"""The studies' run ledger: compact lines that read back as the records, runs skipped when
the ledger holds them with the same settings, and side-by-side runs pinned to disjoint cores."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from asyncopd_jax.studies.training_runs import compact, expand, mean_curve, read_ledger, run_trainings

RESULT = {
    "sets": ["seed=0", "schedule.lag=2"],
    "summary": {"student_after": 0.5},
    "error": None,
    "records": [
        {"step": 1, "loss": 1.23456789, "grad_norm": 2.0, "probe_reverse_kl": 0.123456, "time": 3.0},
        {"step": 2, "loss": -0.000123456789, "grad_norm": 0.0, "staleness_hist": [0, 5]},
    ],
}


def test_a_ledger_line_reads_back_as_the_records_it_keeps():
    line = compact("run-a", RESULT)
    assert line["columns"] == {
        "step": [1, 2],
        "loss": [1.235, -0.0001235],
        "grad_norm": [2.0, 0.0],
        "probe_reverse_kl": {"at": [0], "values": [0.1235]},
    }
    back = expand(json.loads(json.dumps(line)))
    assert back["sets"] == RESULT["sets"] and back["summary"] == RESULT["summary"] and back["error"] is None
    # steps without a probe have no probe key (as in metrics.jsonl); keys outside the ledger are gone
    assert back["records"] == [
        {"step": 1, "loss": 1.235, "grad_norm": 2.0, "probe_reverse_kl": 0.1235},
        {"step": 2, "loss": -0.0001235, "grad_norm": 0.0},
    ]


def fake_train(work: Path, name: str, sets: list[str]) -> tuple[dict, float]:
    """Stands in for a training run (module level: the pool's workers import it); records
    the cores its process may use and leaves a file per call. With "barrier" in its
    settings it waits until two processes have started a run, so both workers get one."""
    work.mkdir(parents=True, exist_ok=True)
    (work / f"{name}-{sets[-1]}.{os.getpid()}").touch()
    deadline = time.monotonic() + 60
    while "barrier" in sets and len({p.suffix for p in work.iterdir()}) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    cores = sorted(os.sched_getaffinity(0))
    result = {"sets": sets, "summary": {"cores": cores}, "error": None, "records": [{"step": 1, "loss": 1.0}]}
    return compact(name, result), 0.0


def _runs(tag: str) -> dict:
    return {("a", i): (f"run{i}", [f"seed={i}", tag]) for i in range(3)}


def test_runs_in_the_ledger_are_not_trained_again(tmp_path):
    ledger = tmp_path / "docs" / "runs.jsonl"
    first = run_trainings(tmp_path / "work", ledger, _runs("x"), train=fake_train)
    assert len(list((tmp_path / "work").iterdir())) == 3 and len(read_ledger(ledger)) == 3
    assert first[("a", 1)]["sets"] == ["seed=1", "x"] and first[("a", 1)]["records"] == [{"step": 1, "loss": 1.0}]
    # the same runs again: nothing trained, nothing appended
    again = run_trainings(tmp_path / "work", ledger, _runs("x"), train=fake_train)
    assert again == first and len(list((tmp_path / "work").iterdir())) == 3
    assert len(ledger.read_text().splitlines()) == 3
    # other settings under the same names: trained again, the newer line wins
    changed = run_trainings(tmp_path / "work", ledger, _runs("y"), train=fake_train)
    assert changed[("a", 0)]["sets"] == ["seed=0", "y"] and len(list((tmp_path / "work").iterdir())) == 6


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"jobs = 0 is invalid; allowed: >= 1"):
        run_trainings(tmp_path, tmp_path / "l.jsonl", _runs("x"), jobs=0, train=fake_train)
    with pytest.raises(ValueError, match="run names must be unique"):
        run_trainings(tmp_path, tmp_path / "l.jsonl", {1: ("same", []), 2: ("same", ["x"])}, train=fake_train)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin two workers apart")
def test_side_by_side_runs_are_pinned_to_disjoint_shares_of_the_cores(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    results = run_trainings(tmp_path / "work", tmp_path / "runs.jsonl", _runs("barrier"), jobs=2, train=fake_train)
    pids = {p.suffix for p in (tmp_path / "work").iterdir()}
    assert len(pids) == 2 and str(os.getpid()) not in {p.lstrip(".") for p in pids}  # two worker processes
    shares = {tuple(r["summary"]["cores"]) for r in results.values()}
    assert len(shares) == 2  # both workers ran something, each on its own share
    first, second = shares
    assert not set(first) & set(second) and set(first) | set(second) == set(cores)


def test_a_run_another_study_holds_with_the_same_settings_is_copied_not_trained(tmp_path):
    other = tmp_path / "other.jsonl"
    run_trainings(tmp_path / "w1", other, {1: ("theirs", ["seed=0", "x"])}, train=fake_train)
    ledger = tmp_path / "mine.jsonl"
    results = run_trainings(
        tmp_path / "w2",
        ledger,
        {("m", 0): ("mine0", ["seed=0", "x"]), ("m", 1): ("mine1", ["seed=1", "x"])},
        shared=[other],
        train=fake_train,
    )
    assert [p.name.split(".")[0] for p in (tmp_path / "w2").iterdir()] == ["mine1-x"]  # only the new one trained
    assert set(read_ledger(ledger)) == {"mine0", "mine1"} and results[("m", 0)]["sets"] == ["seed=0", "x"]


def test_a_ledger_line_of_the_first_format_still_reads():
    """The first ledger lines kept every column as a full list, None where a step had no value."""
    old = {
        "name": "r",
        "sets": [],
        "summary": {},
        "error": None,
        "columns": {"step": [1, 2], "probe_reverse_kl": [None, 0.5]},
    }
    assert expand(old)["records"] == [{"step": 1}, {"step": 2, "probe_reverse_kl": 0.5}]


def test_a_mean_curve_averages_the_seeds_that_logged_at_the_same_steps():
    def run(*pairs):
        return {"records": [{"step": 1, "loss": 0.0}] + [{"step": step, "kl": kl} for step, kl in pairs]}

    steps, mean = mean_curve([run((2, 1.0), (4, 3.0)), run((2, 3.0), (4, 5.0)), run((2, 100.0))], "kl")
    assert steps == [2, 4] and mean.tolist() == [2.0, 4.0]  # the third run stopped early: left out
    steps, mean = mean_curve([run(), run()], "kl")
    assert steps == [] and mean.size == 0
