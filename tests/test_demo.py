"""The acceptance run: the embedded demo reaches 90 % of the teacher's accuracy (slow: ~2-3 min)."""

from __future__ import annotations

import pytest

from asyncopd_jax.cli import DEMO_CONFIG
from asyncopd_jax.config import load_config
from asyncopd_jax.pipeline.trainer import Trainer


@pytest.mark.slow
def test_demo_distils_the_student_to_ninety_percent_of_the_teacher(tmp_path):
    cfg = load_config(DEMO_CONFIG, [f"output_dir={tmp_path}"])
    summary = Trainer(cfg, progress=False).run()
    assert summary["student_before"] < 0.5 * summary["teacher_accuracy"]
    assert summary["student_after"] >= 0.9 * summary["teacher_accuracy"], summary
