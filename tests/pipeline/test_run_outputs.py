"""What a run writes: metrics survive a process killed mid-append."""

from __future__ import annotations

import pytest

from asyncopd_jax.pipeline.run_outputs import RunDir


def test_a_torn_last_metrics_line_is_skipped_and_dropped_on_resume(tmp_path):
    run = RunDir(tmp_path / "run")
    for step in (1, 2, 3):
        run.append_metrics({"step": step, "loss": 0.5})
    with run.metrics_file.open("a") as f:
        f.write('{"step": 4, "lo')  # SIGKILL in the middle of an append
    assert [r["step"] for r in run.read_metrics()] == [1, 2, 3]
    run.truncate_metrics(2)
    assert run.metrics_file.read_text().count("\n") == 2 and [r["step"] for r in run.read_metrics()] == [1, 2]


def test_a_torn_line_before_the_end_is_an_error_naming_the_line(tmp_path):
    run = RunDir(tmp_path / "run")
    run.metrics_file.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl: line 2 is not a JSON record"):
        run.read_metrics()
