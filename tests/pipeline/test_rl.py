"""Reward-driven RL end to end: from the distilled warm start, the verifier's reward rises
under the synchronous and the fully asynchronous schedule."""

from __future__ import annotations

import json

import numpy as np
import pytest

from asyncopd_jax import configs
from asyncopd_jax.config import load_config
from asyncopd_jax.pipeline.trainer import Trainer
from tests.waits import SHORT_WAIT_SETS

pytestmark = pytest.mark.e2e  # whole RL runs: the end-to-end step (-m e2e)

RL_CONFIG = configs.RL


@pytest.mark.parametrize("mode", ["sync", pytest.param("fully_async", marks=pytest.mark.slow)])  # CI time
def test_rl_raises_the_verifier_reward_from_the_warm_start(tmp_path, mode):
    steps = 40
    cfg = load_config(
        RL_CONFIG,
        [
            f"output_dir={tmp_path}",
            "name=rl",
            f"schedule.mode={mode}",
            f"train.steps={steps}",
            "train.eval_every=1000",
            "train.checkpoint_every=1000",
            "teacher.path=''",
            *SHORT_WAIT_SETS,
            "learner.batch_size=64",
            "rl.samples_per_prompt=8",
            "optim.learning_rate=0.0003",
            "task.eval_prompts=128",
        ],
    )
    summary = Trainer(cfg, progress=False).run()
    records = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert "teacher_accuracy" not in summary and "reverse_kl_signal" not in records[0]  # no teacher at all
    reward = np.array([r["rollout_accuracy"] for r in records])
    first, last = reward[:10].mean(), reward[-10:].mean()
    assert last > first + 0.05, (mode, first, last)
    # Held out (greedy, 128 prompts) the student must not get worse. 40 steps do not raise it
    # by a fixed margin reliably: on 512 held-out prompts three seeds gained +0.008, +0.064 and
    # +0.014 (2026-11-26, this config with seed=0/1/2); the rise of the rollout reward above, over
    # 640 samples per window, is the learning signal this test checks.
    assert summary["student_after"] >= summary["student_before"], summary
    if mode == "fully_async":
        assert max(r["staleness_max"] for r in records) <= cfg.schedule.max_staleness


def _rl_records(tmp_path, name, *sets):
    cfg = load_config(
        RL_CONFIG,
        [
            f"output_dir={tmp_path}",
            f"name={name}",
            "train.eval_every=1000",
            "train.checkpoint_every=1000",
            "teacher.path=''",
            *SHORT_WAIT_SETS,
            "learner.batch_size=16",
            "rl.samples_per_prompt=4",
            "task.eval_prompts=16",
            *sets,
        ],
    )
    Trainer(cfg, progress=False).run()
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_the_entropy_bonus_and_the_kl_to_the_reference_reach_the_loss(tmp_path):
    """With exact lag 0 the runs see the same rollouts: the step-1 loss differs from the
    plain one by −c · (the entropy metric); the reference (the starting student, scored by
    the scoring stage although there is no teacher) matches π_θ at step 1 — KL 0, and k3's
    gradient 0 there, so step 2 starts from the same weights — and at step 2 the loss
    differs by β · (the KL metric)."""
    lag0 = ["schedule.mode=fixed_lag", "schedule.lag=0", "train.steps=2"]
    base = _rl_records(tmp_path, "base", *lag0)
    bonus = _rl_records(tmp_path, "bonus", *lag0, "estimator.regularisers.entropy_coef=0.1")
    kl = _rl_records(tmp_path, "kl", *lag0, "estimator.regularisers.reference_kl_coef=0.5")
    assert bonus[0]["entropy"] == pytest.approx(base[0]["entropy"], rel=1e-6) and base[0]["entropy"] > 0.05
    assert bonus[0]["loss"] - base[0]["loss"] == pytest.approx(-0.1 * base[0]["entropy"], rel=1e-4)
    assert "reference_kl" not in base[0] and abs(kl[0]["reference_kl"]) < 1e-6
    assert kl[0]["loss"] == pytest.approx(base[0]["loss"], rel=1e-5)
    assert kl[1]["reference_kl"] > 1e-4
    assert kl[1]["loss"] - base[1]["loss"] == pytest.approx(0.5 * kl[1]["reference_kl"], rel=1e-3)


def test_the_reference_is_scored_in_a_scoring_process(tmp_path):
    """processes placement, RL without a teacher: the scoring process loads the reference
    and scores every group; the learner's KL to it starts at 0 and grows."""
    records = _rl_records(
        tmp_path,
        "p",
        "stages.placement=processes",
        "schedule.mode=fully_async",
        "stages.rollouts=1",
        "stages.scoring_processes=1",
        "train.steps=6",
        "optim.learning_rate=0.003",
        "estimator.regularisers.reference_kl_coef=0.5",
        "estimator.regularisers.reference_kl=k2",
    )
    assert abs(records[0]["reference_kl"]) < 1e-6
    assert max(r["reference_kl"] for r in records[1:]) > 1e-4
