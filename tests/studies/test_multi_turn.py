"""The multi-turn study: every arm's settings load as the run it names, its readings of the
runs (steps a second, the speed-up, calls per teacher), and the quick study end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from asyncopd_jax.config import load_config
from asyncopd_jax.studies import multi_turn
from asyncopd_jax.studies.multi_turn import arm_sets, arms, calls_by_teacher, speed_up, steps_per_second

MODELS = {name: Path(f"/models/{name}") for name in ("teacher_steps", "teacher_none", "student_none")}


def test_each_arm_is_the_run_it_names():
    loaded = {arm: load_config(multi_turn.DEMO_TOOLS, arm_sets(arm, 1, multi_turn.FULL, MODELS)) for arm in arms()}
    for arm, cfg in loaded.items():
        assert cfg.seed == 1 and cfg.learner.batch_size == 64
        assert cfg.train.steps == (100 if "sync" in arm else 200), arm
    assert loaded["multi_turn_opd"].student.path == "builtin:student_tools"
    no_tools = loaded["single_turn_no_tools"]
    assert not no_tools.task.tools and no_tools.teacher.path == "/models/teacher_none"
    assert no_tools.student.path == "/models/student_none"
    assert [(t.name, t.path) for t in loaded["two_teachers"].teachers] == [
        ("whole", "builtin:teacher_tools"),
        ("steps", "/models/teacher_steps"),
    ]
    for latency in ("fast", "long_tailed"):
        sync, fully = loaded[f"sync-{latency}"], loaded[f"fully_async-{latency}"]
        assert (sync.schedule.mode, fully.schedule.mode) == ("sync", "fully_async")
        assert sync.environment == fully.environment and sync.environment.latency_s > 0
        assert sync.train.eval_every == 100  # one evaluation, at the end: steps a second are the training's
    assert loaded["sync-long_tailed"].environment.latency_law == "lognormal"


def _run(times: list[float], **extra) -> dict:
    return {"records": [{"step": i + 1, "time": t, **extra} for i, t in enumerate(times)], "summary": {}}


def test_steps_a_second_leave_the_first_step_out_and_the_speed_up_is_a_ratio_of_means():
    assert steps_per_second(_run([30.0, 31.0, 32.0, 33.0])) == pytest.approx(1.0)
    assert np.isnan(steps_per_second(_run([5.0])))
    results = {
        ("sync-fast", 0): _run([10, 12, 14]),
        ("sync-fast", 1): _run([10, 14, 18]),
        ("fully_async-fast", 0): _run([10, 11, 12]),
        ("fully_async-fast", 1): _run([10, 11, 12]),
    }
    ratio, sync, fully = speed_up(results, "fast", 2)
    np.testing.assert_allclose(sync, [0.5, 0.25])
    np.testing.assert_allclose(fully, [1.0, 1.0])
    assert ratio == pytest.approx(1.0 / 0.375)


def test_calls_by_teacher_read_each_teachers_rows_first_and_last():
    records = [
        {"step": i, "teacher/whole/tool_calls_per_answer": 1.0 + i / 100, "teacher/steps/tool_calls_per_answer": 2.0}
        for i in range(40)
    ]
    results = {("two_teachers", 0): {"records": records}}
    first, last = calls_by_teacher(results, 1, True), calls_by_teacher(results, 1, False)
    assert first == {"whole": pytest.approx(1.045), "steps": 2.0}
    assert last == {"whole": pytest.approx(1.345), "steps": 2.0}


@pytest.mark.slow  # ~5 minutes: three asyncopd sft models and eight short runs
def test_the_quick_study_writes_its_report(tmp_path):
    path = multi_turn.run(tmp_path / "docs", tmp_path / "work", quick=True, seeds=1, command="asyncopd study x")
    text = path.read_text()
    for part in ("| multi_turn_opd |", "| sft_teacher_trajectories |", "| single_turn_no_tools |", "| long_tailed |"):
        assert part in text, part
    assert "| whole | 1.00 |" in text and "| steps |" in text and "| teacher_none | no tool |" in text
    assert "Runs that failed" not in text
    assert (path.parent / "multi_turn" / "accuracy.png").is_file() and (
        path.parent / "multi_turn" / "calls.png"
    ).is_file()


@pytest.mark.extended  # the teacher's rollouts and two SFT steps, ~45 s beside another worker: CI's second step
def test_the_sft_arm_trains_on_the_teachers_trajectories_and_records_its_evaluations(tmp_path):
    settings = multi_turn.Settings(
        steps=2, batch_size=4, eval_every=2, eval_prompts=8, timed_steps=2, teacher_sft_steps=1, student_sft_steps=1
    )
    sets = multi_turn.sft_sets(0, settings)
    line, seconds = multi_turn.train_sft_arm(tmp_path, "sft", sets)
    assert line["name"] == "sft" and line["sets"] == sets and line["error"] is None and seconds > 0
    assert line["columns"]["step"] == [1, 2] and all(np.isfinite(line["columns"]["loss"]))
    assert line["columns"]["eval_accuracy"] == {"at": [1], "values": [line["summary"]["student_after"]]}
    assert line["summary"]["teacher_accuracy"] == 1.0 and len(line["columns"]["time"]) == 2
