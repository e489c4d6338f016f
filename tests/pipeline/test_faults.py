"""Faults at run time, end to end on tiny models (issue 11).

* NaN / inf in the teacher's scores or the student's behaviour log-probs of some rows:
  the run goes on without those rows and counts them in metrics.jsonl.
* A step whose loss or update is not finite: the run stops at that step with an error
  naming it and the last good checkpoint; nothing of that step is logged, published or
  checkpointed, and the checkpoint on disk resumes.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import asyncopd_jax.learner.optimizer as optimizer_module
from asyncopd_jax.learner import NonFiniteLoss
from asyncopd_jax.pipeline.run_outputs import RunDir
from asyncopd_jax.pipeline.scoring_stage import ScoringStage
from asyncopd_jax.pipeline.staleness import RolloutGroup
from asyncopd_jax.pipeline.trainer import Trainer
from tests.pipeline.test_trainer import _config, models  # noqa: F401 - `models` is a fixture

pytestmark = pytest.mark.e2e  # whole runs with a faulty stage: the end-to-end step (-m e2e)

# group index (= optimizer step in a sync run: one group per batch) → the faults injected
# into the real scored group: (array, row, value). Rows 1 and 6 of group 2, row 0 of group
# 3 (twice), row 2 of group 4: 4 rows in all.
FAULTS = {
    2: [("topk_logp", 1, np.nan), ("token_logp", 6, np.inf)],
    3: [("topk_logp", 0, -np.inf), ("behavior_logp", 0, np.nan)],
    4: [("behavior_logp", 2, np.nan)],
}


def _fast_trainer(cfg, monkeypatch) -> Trainer:
    """A Trainer whose held-out evaluations and report are skipped: they compile a greedy
    sampler and plot, seconds that test nothing here."""
    trainer = Trainer(cfg, progress=False)
    monkeypatch.setattr(trainer.data, "accuracy", lambda *args, **kwargs: 0.0)
    monkeypatch.setattr(trainer.run_dir, "write_report", lambda title: None)
    return trainer


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _finite_numbers(record: dict) -> bool:
    return all(math.isfinite(v) for v in record.values() if isinstance(v, float))


def test_nonfinite_scores_drop_their_rows_and_the_run_goes_on(models, tmp_path, monkeypatch):  # noqa: F811
    """The real teacher scores of groups 2, 3, 4 get NaN / ±inf on the last real token of
    some rows (``topk_logp`` ``[B, T, K]``, ``token_logp`` / ``behavior_logp`` ``[B, T]``):
    the run completes, each step's ``nonfinite_rows`` and ``tokens`` are those of the rows
    kept, ``nonfinite_rows_total`` adds up, and loss and parameters stay finite."""
    expected_tokens: dict[int, int] = {}
    real_score = ScoringStage.score

    def poisoning_score(scoring, group: RolloutGroup, seed, index, tracer) -> RolloutGroup:
        group = real_score(scoring, group, seed, index, tracer)
        mask = np.asarray(group.batch.response_mask)
        rows = {row for _, row, _ in FAULTS.get(index, [])}
        expected_tokens[index] = int(mask.sum() - mask[sorted(rows)].sum())
        batch, cache = group.batch, group.cache
        for field, row, value in FAULTS.get(index, []):
            owner = batch if field == "behavior_logp" else cache
            array = np.array(getattr(owner, field))
            array[(row, mask[row].sum() - 1) + (0,) * (array.ndim - 2)] = value  # the row's last real token
            owner = dataclasses.replace(owner, **{field: jnp.asarray(array)})
            batch, cache = (owner, cache) if field == "behavior_logp" else (batch, owner)
        return dataclasses.replace(group, batch=batch, cache=cache)

    monkeypatch.setattr(ScoringStage, "score", poisoning_score)
    cfg = _config(models, tmp_path, **{"schedule.mode": "sync", "train.steps": 5, "train.checkpoint_every": 100})
    trainer = _fast_trainer(cfg, monkeypatch)
    summary = trainer.run()

    records = _records(tmp_path / "t")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    dropped = [len({row for _, row, _ in FAULTS.get(r["step"], [])}) for r in records]
    assert [r["nonfinite_rows"] for r in records] == dropped == [0, 2, 1, 1, 0]
    assert [r["nonfinite_rows_total"] for r in records] == list(np.cumsum(dropped))
    assert [int(r["tokens"]) for r in records] == [expected_tokens[s] for s in range(1, 6)]
    assert all(_finite_numbers(r) for r in records)
    assert summary["steps"] == 5 and summary["nonfinite_rows"] == 4
    assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(jax.device_get(trainer.state.params)))
    _, meta = RunDir(tmp_path / "t").restore_checkpoint(trainer.state)  # the final checkpoint:
    assert meta["step"] == 5 and meta["nonfinite_rows_total"] == 4  # a resume keeps the running total


@pytest.mark.parametrize("fault", ["nan_weights", "inf_learning_rate"])
def test_a_nonfinite_step_stops_the_run_at_that_step(models, tmp_path, monkeypatch, fault):  # noqa: F811
    """At step 3 (checkpoints every 2 steps): a NaN weight enters the step (as from a
    silent overflow: the loss is NaN), or the learning rate becomes inf (loss and gradient
    finite, the update is not). The run raises NonFiniteLoss within step 3, naming it and
    checkpoint 2; the step's update was not applied; metrics.jsonl ends at step 2, all
    finite; no policy snapshot after version 2 was published; checkpoint 2 is finite and
    loads."""
    k = 3
    if fault == "inf_learning_rate":  # the schedule the optimizer is built with (count = steps taken)
        real_schedule = optimizer_module.learning_rate_schedule
        monkeypatch.setattr(
            optimizer_module,
            "learning_rate_schedule",
            lambda cfg, total: lambda count: jnp.where(count == k - 1, jnp.inf, real_schedule(cfg, total)(count)),
        )
    cfg = _config(models, tmp_path, **{"schedule.mode": "sync", "train.steps": 4, "train.checkpoint_every": 2})
    trainer = _fast_trainer(cfg, monkeypatch)

    real_step, calls, entering = trainer.learner.train_step, {"n": 0}, {}

    def step_with_fault(state, batch):
        calls["n"] += 1
        if calls["n"] == k and fault == "nan_weights":
            leaves, treedef = jax.tree_util.tree_flatten(state.params)
            leaves[-1] = leaves[-1].at[(0,) * leaves[-1].ndim].set(jnp.nan)
            state = dataclasses.replace(state, params=jax.tree_util.tree_unflatten(treedef, leaves))
        entering[calls["n"]] = jax.device_get(state)  # the step donates its input
        return real_step(state, batch)

    trainer.learner.train_step = step_with_fault
    published: list[tuple[int, bool]] = []  # (version, every weight finite)
    real_publish = trainer.snapshots.publish

    def publish(version, params):
        finite = all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(jax.device_get(params)))
        published.append((version, finite))
        return real_publish(version, params)

    trainer.snapshots.publish = publish
    with pytest.raises(NonFiniteLoss) as caught:
        trainer.run()

    message = str(caught.value)
    checkpoint = tmp_path / "t" / "checkpoints" / str(k - 1)
    assert f"step {k}:" in message and f"{checkpoint} (step {k - 1})" in message, message
    assert "\n" not in message and isinstance(caught.value, ValueError)  # the CLI prints it as one line
    assert checkpoint.is_dir()
    assert calls["n"] == k  # stopped within step k, not after more NaN steps
    # the failing step's update was not applied: the state is the one that entered it
    after = jax.device_get(trainer.state)
    assert int(after.step) == k - 1
    for a, b in zip(jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(entering[k])):
        np.testing.assert_array_equal(a, b)
    records = _records(tmp_path / "t")
    assert [r["step"] for r in records] == list(range(1, k)) and all(_finite_numbers(r) for r in records)
    assert max(v for v, _ in published) == k - 1 and all(finite for _, finite in published)
    run_dir = RunDir(tmp_path / "t")  # what a --resume would load
    assert run_dir.latest_checkpoint() == k - 1
    restored, meta = run_dir.restore_checkpoint(trainer.state)
    assert meta["step"] == k - 1 and int(restored.step) == k - 1
    assert all(np.isfinite(x).all() for x in jax.tree_util.tree_leaves(jax.device_get(restored)))


@pytest.mark.parametrize("mode", ["fully_async", "sync"])
def test_a_scoring_error_stops_the_run_with_that_error(models, tmp_path, monkeypatch, mode):  # noqa: F811
    """The teacher's scoring of every group from 2 on raises: the run stops with that error
    (the learner's, whatever thread scored the group), fully asynchronous or not. The race
    of a delivery failing while the loop waits for capacity: tests/pipeline/test_rollout_loop.py."""
    real_score = ScoringStage.score

    def failing_score(scoring, group: RolloutGroup, seed, index, tracer) -> RolloutGroup:
        if index >= 2:
            raise RuntimeError(f"the teacher failed on group {index}")
        return real_score(scoring, group, seed, index, tracer)

    monkeypatch.setattr(ScoringStage, "score", failing_score)
    cfg = _config(models, tmp_path, **{"schedule.mode": mode, "train.steps": 6, "train.checkpoint_every": 100})
    with pytest.raises(Exception, match="the teacher failed on group"):
        _fast_trainer(cfg, monkeypatch).run()
