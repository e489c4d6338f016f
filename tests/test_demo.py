"""The acceptance runs: the embedded demo reaches 90 % of the teacher's accuracy with the
stages as threads (~2-3 min) and as separate processes (~5 min); slow."""

from __future__ import annotations

import pytest

from asyncopd_jax.cli import DEMO_CONFIG
from asyncopd_jax.config import load_config
from asyncopd_jax.pipeline.trace import load_spans
from asyncopd_jax.pipeline.trainer import Trainer
from tests.waits import SHORT_WAIT_SETS


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["threads", "processes"])
def test_demo_distils_the_student_to_ninety_percent_of_the_teacher(tmp_path, placement):
    cfg = load_config(DEMO_CONFIG, [f"output_dir={tmp_path}", f"stages.placement={placement}", *SHORT_WAIT_SETS])
    summary = Trainer(cfg, progress=False).run()
    assert summary["student_before"] < 0.5 * summary["teacher_accuracy"]
    assert summary["student_after"] >= 0.9 * summary["teacher_accuracy"], summary
    if placement == "processes":  # the stages really ran in their own process (rollout-0 also scores)
        spans = {(s["process"], s["name"]) for s in load_spans(tmp_path / "demo" / "trace.json")}
        assert {("rollout-0", "rollout"), ("rollout-0", "score"), ("learner", "learn")} <= spans, sorted(spans)
        assert ("learner", "rollout") not in spans and ("learner", "score") not in spans


@pytest.mark.slow
def test_demo_moe_distils_the_student_to_94_percent_of_its_mixture_of_experts_teacher(tmp_path):
    """Issue 39's acceptance: the demo with builtin:teacher_moe (~7 min here)."""
    cfg = load_config("demo_moe", [f"output_dir={tmp_path}", *SHORT_WAIT_SETS])
    assert cfg.teacher.path == "builtin:teacher_moe"
    summary = Trainer(cfg, progress=False).run()
    assert summary["student_after"] >= 0.94 * summary["teacher_accuracy"], summary


@pytest.mark.slow
def test_demo_with_a_student_of_another_tokenizer_distils_it(tmp_path):
    """Issue 40's: ``asyncopd train --config demo --set student.path=builtin:student_bpe``,
    the byte-pair student from the character teacher by spans (~5 min here): at least 70 %
    held-out, from 4.3 % (seed 0 measured 82.0 % and 86.7 % in two runs, the study's other
    seeds 91.4 % and 73.8 %: an asynchronous run is not bit-reproducible)."""
    cfg = load_config(DEMO_CONFIG, [f"output_dir={tmp_path}", "student.path=builtin:student_bpe", *SHORT_WAIT_SETS])
    summary = Trainer(cfg, progress=False).run()
    assert summary["student_before"] < 0.1 and summary["student_after"] >= 0.70, summary
