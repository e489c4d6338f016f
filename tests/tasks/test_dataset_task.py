"""A user's JSONL dataset as the task of a distillation run, with and without answers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from asyncopd_jax.cli import DEMO_CONFIG
from asyncopd_jax.config import ConfigError, load_config
from asyncopd_jax.models import load_tokenizer
from asyncopd_jax.pipeline.trainer import Trainer
from asyncopd_jax.tasks.arith import sample_problems
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.tasks.dataset import DatasetError
from asyncopd_jax.tasks.dataset_task import DatasetTask
from tests.waits import SHORT_WAITS


def _arith_jsonl(path, n=400, answers=True):
    """The built-in task's problems written as a user dataset (nested prompt field)."""
    problems = sample_problems(np.random.default_rng(0), n, 3, 99, held_out=False)
    rows = [{"input": {"text": p.prompt}, **({"gold": p.answer} if answers else {})} for p in problems]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _config(tmp_path, data, **sets):
    overrides = {
        "name": "d",
        "output_dir": str(tmp_path),
        "task.name": "dataset",
        "task.path": str(data),
        "task.prompt_field": "input.text",
        "task.answer_field": "gold",
        "task.eval_fraction": 0.1,
        "task.eval_prompts": 32,
        "sampling.max_new_tokens": 28,
        "learner.batch_size": 8,
        "schedule.mode": "sync",
        "train.steps": 3,
        "train.eval_every": 100,
        "train.checkpoint_every": 100,
        **SHORT_WAITS,
        **sets,
    }
    return load_config(DEMO_CONFIG, [f"{k}={v}" for k, v in overrides.items()])


@pytest.mark.e2e  # a whole run: the end-to-end step (-m e2e)
def test_a_dataset_run_grades_the_answers_of_its_own_examples(tmp_path):
    data = _arith_jsonl(tmp_path / "arith.jsonl")
    summary = Trainer(_config(tmp_path, data), progress=False).run()
    # the shipped teacher solves the built-in task: graded through the dataset path it must too
    assert summary["teacher_accuracy"] >= 0.9 and summary["student_before"] < 0.5, summary
    records = [json.loads(line) for line in (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(0.0 <= r["rollout_accuracy"] <= 1.0 for r in records)


@pytest.mark.e2e  # a whole run: the end-to-end step (-m e2e)
def test_without_answers_a_dataset_distils_and_reports_no_accuracy(tmp_path):
    data = _arith_jsonl(tmp_path / "prompts.jsonl", answers=False)
    summary = Trainer(_config(tmp_path, data, **{"task.answer_field": "gold"}), progress=False).run()
    assert np.isnan(summary["teacher_accuracy"]) and np.isnan(summary["student_after"])
    records = [json.loads(line) for line in (tmp_path / "d" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all("rollout_accuracy" not in r and np.isfinite(r["loss"]) for r in records)


def test_a_prompt_too_long_for_the_model_names_its_rows(tmp_path):
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": "Q:1+2="}) + "\n" + json.dumps({"prompt": "Q:" + "1+" * 60 + "1="}) + "\n")
    cfg = _config(tmp_path, data, **{"task.prompt_field": "prompt"})
    tokenizer = load_tokenizer(resolve_model_path("builtin:student"))
    with pytest.raises(
        DatasetError,
        match=r"long.jsonl: rows 2: prompt \+ sampling.max_new_tokens \(28\) is longer "
        r"than the models' context \(128 positions; longest prompt 124 tokens\)",
    ):
        DatasetTask(cfg.task, tokenizer, max_new_tokens=28, max_positions=128)


def test_a_dataset_task_needs_a_path():
    with pytest.raises(ConfigError, match="task.path = '' is invalid with task.name = dataset"):
        load_config(None, ["task.name=dataset"])
