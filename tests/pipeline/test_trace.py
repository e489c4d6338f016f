"""The span recorder: a bounded window of recent spans, running totals over all of them,
and one merged trace.json for the learner and every stage process."""

from __future__ import annotations

import json
import threading
import tracemalloc

import pytest

from asyncopd_jax.pipeline.trace import Tracer, load_spans


def _record(tracer: Tracer, names: list[str], monkeypatch, seconds: float = 0.5) -> None:
    """Spans of exactly ``seconds`` each, on a fake clock."""
    clock = iter(range(0, 10 * len(names) + 10))
    monkeypatch.setattr("asyncopd_jax.pipeline.trace.time.time", lambda: next(clock) * seconds)
    for name in names:
        with tracer.span(name, i=len(name)):
            pass


def test_keeps_only_the_newest_spans_but_totals_count_every_one(monkeypatch):
    tracer = Tracer(origin=0.0, keep=3)
    _record(tracer, ["learn", "score", "learn", "learn", "score", "learn"], monkeypatch)
    kept = tracer.events()
    assert [e["name"] for e in kept] == ["learn", "score", "learn"]  # the newest three, in order
    assert tracer.dropped == 3
    assert tracer.totals() == pytest.approx({"learn": 2.0, "score": 1.0})  # all six spans, 0.5 s each
    assert tracer.totals("sc") == pytest.approx({"score": 1.0})


def test_memory_stays_bounded_over_many_spans():
    tracer = Tracer(keep=100)
    for _ in range(5_000):
        with tracer.span("learn"):
            pass
    assert len(tracer.events()) == 100 and tracer.dropped == 4_900


def test_concurrent_spans_are_all_counted():
    tracer = Tracer(keep=50)

    def work() -> None:
        for _ in range(1_000):
            with tracer.span("rollout"):
                pass

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tracer.events()) == 50 and tracer.dropped == 4_000 - 50


def test_write_merges_other_processes_and_names_what_was_dropped(tmp_path, monkeypatch):
    learner, rollout = Tracer(origin=0.0, keep=2), Tracer(origin=0.0, process="rollout0", keep=10)
    _record(learner, ["learn", "learn", "learn"], monkeypatch)
    _record(rollout, ["rollout", "score"], monkeypatch)
    rollout.dump(tmp_path / "rollout0.json")
    (tmp_path / "torn.json").write_text('{"events": [')  # a process killed mid-write is skipped
    learner.write(
        tmp_path / "trace.json", others=[tmp_path / "rollout0.json", tmp_path / "torn.json", tmp_path / "missing.json"]
    )
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace["otherData"]["dropped_spans"] == {"learner": 1, "rollout0": 0}
    spans = load_spans(tmp_path / "trace.json")
    assert sorted((s["process"], s["name"]) for s in spans) == [
        ("learner", "learn"),
        ("learner", "learn"),
        ("rollout0", "rollout"),
        ("rollout0", "score"),
    ]
    assert all(s["seconds"] == pytest.approx(0.5) for s in spans)


def test_write_holds_one_span_at_a_time_not_the_whole_trace(tmp_path):
    """The learner merges trace.json at every checkpoint. Built whole, the merge held every
    process's window at once (in the soak ~460,000 Python objects per checkpoint), and each
    such burst left the learner's resident memory a little higher (docs/reliability.md):
    streamed, its peak of Python allocations is a small fraction of what it writes."""
    tracers = [Tracer(origin=0.0, process=name, keep=3_000) for name in ("learner", "rollout-0", "rollout-1")]
    for tracer in tracers:
        for _ in range(3_000):
            with tracer.span("rollout", rows=4, tokens=48):
                pass
    dumps = [tmp_path / f"{t.process}.json" for t in tracers[1:]]
    for tracer, dump in zip(tracers[1:], dumps):
        tracer.dump(dump)
    tracemalloc.start()
    try:
        tracers[0].write(tmp_path / "trace.json", others=dumps)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    size = (tmp_path / "trace.json").stat().st_size
    assert len(load_spans(tmp_path / "trace.json")) == 9_000
    assert peak < size / 4, f"the merge held {peak / 1e6:.2f} MB at once to write {size / 1e6:.2f} MB"
