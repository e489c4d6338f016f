"""Reward-driven RL end to end: from the distilled warm start, the verifier's reward rises
under the synchronous and the fully asynchronous schedule."""

from __future__ import annotations

import json

import numpy as np
import pytest

from asyncopd_jax import configs
from asyncopd_jax.config import load_config
from asyncopd_jax.pipeline.trainer import Trainer

RL_CONFIG = configs.RL


@pytest.mark.parametrize("mode", ["sync", pytest.param("fully_async", marks=pytest.mark.slow)])  # CI time
def test_rl_raises_the_verifier_reward_from_the_warm_start(tmp_path, mode):
    steps = 40
    cfg = load_config(RL_CONFIG, [
        f"output_dir={tmp_path}", "name=rl", f"schedule.mode={mode}", f"train.steps={steps}",
        "train.eval_every=1000", "train.checkpoint_every=1000", "teacher.path=''", "learner.batch_size=64",
        "rl.samples_per_prompt=8", "optim.learning_rate=0.0003", "task.eval_prompts=128",
    ])
    summary = Trainer(cfg, progress=False).run()
    records = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert "teacher_accuracy" not in summary and "reverse_kl_signal" not in records[0]  # no teacher at all
    reward = np.array([r["rollout_accuracy"] for r in records])
    first, last = reward[:10].mean(), reward[-10:].mean()
    assert last > first + 0.05, (mode, first, last)
    assert summary["student_after"] > summary["student_before"] + 0.03, summary
    if mode == "fully_async":
        assert max(r["staleness_max"] for r in records) <= cfg.schedule.max_staleness
