"""Evaluation in the background (asyncopd_jax/pipeline/evaluation.py): results in version
order, one running and one waiting, errors raised on the learner's thread; in a run,
each evaluation pinned to the version it names while the learner goes on."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest

from asyncopd_jax.pipeline.evaluation import BackgroundEval
from asyncopd_jax.pipeline.run_outputs import RunDir, optimizer_step_records
from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.pipeline.trainer import Trainer
from tests.pipeline.test_trainer import _config, models  # noqa: F401 - fixture


def test_results_come_in_version_order_with_one_evaluation_waiting_at_most():
    gates = {v: threading.Event() for v in (1, 2, 3)}
    started: list[int] = []

    def evaluate(params):
        started.append(params)
        gates[params].wait(10)
        return params / 10

    worker = BackgroundEval(evaluate, Tracer(origin=time.time()))
    worker.submit(1, 1)
    worker.submit(2, 2)  # waits behind 1
    third = threading.Thread(target=worker.submit, args=(3, 3))
    third.start()
    time.sleep(0.2)
    assert third.is_alive()  # two already: the learner waits until the oldest is done
    gates[2].set()
    assert worker.finished() == []  # 2 cannot be done before 1: one worker, in order
    gates[1].set()
    third.join(10)
    assert not third.is_alive()
    gates[3].set()
    results = worker.drain()
    assert [(r.version, r.accuracy) for r in results] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert started == [1, 2, 3] and worker.drain() == []
    assert results[0].record() == {
        "step": 1,
        "eval_accuracy": 0.1,
        "eval_seconds": results[0].seconds,
        "eval_version": 1,
    }
    worker.close()


def test_an_evaluation_that_raises_raises_on_the_learners_thread():
    def evaluate(params):
        raise ValueError("the held-out set is empty")

    worker = BackgroundEval(evaluate, Tracer(origin=time.time()))
    worker.submit(4, None)
    with pytest.raises(ValueError, match="held-out set is empty"):
        worker.drain()
    worker.close()


def _checksum(params) -> float:
    """A figure of the weights alone (float64): equal for equal weights."""
    return float(sum(np.abs(np.asarray(x, np.float64)).sum() for x in jax.tree_util.tree_leaves(params)))


def _run(models, tmp_path, mode: str, monkeypatch):  # noqa: F811
    """A sync run of 6 steps, evaluated at 2, 4, 6 (checkpoints at 4 and 6), its task's
    accuracy replaced by a checksum of the weights it is given. In the background: the
    worker starts on version 2 only once the learner has written step 3 (the learner must
    not wait for it, and has donated its own buffers of version 2 by then); version 4
    takes a second more (the checkpoint at 4 waits for it)."""
    cfg = _config(
        models,
        tmp_path / mode,
        **{
            "schedule.mode": "sync",
            "train.steps": 6,
            "train.eval_every": 2,
            "train.checkpoint_every": 4,
            "eval.mode": mode,
        },
    )
    trainer = Trainer(cfg, progress=False)
    metrics = trainer.run_dir.metrics_file
    calls: list[float] = []

    def accuracy(task, graphdef, params, **kwargs):
        calls.append(_checksum(params))
        return calls[-1]

    run_evaluation = BackgroundEval._run

    def late(worker, version, params):
        if version == 2:
            deadline = time.monotonic() + 60
            while '"step": 3,' not in metrics.read_text() and time.monotonic() < deadline:
                time.sleep(0.01)
        elif version == 4:
            time.sleep(1.0)
        return run_evaluation(worker, version, params)

    monkeypatch.setattr(type(trainer.data), "accuracy", accuracy)
    monkeypatch.setattr(BackgroundEval, "_run", late)
    summary = trainer.run()
    return RunDir(trainer.run_dir.path).read_metrics(), summary, calls


@pytest.mark.e2e  # two whole runs: the end-to-end step (-m e2e)
def test_background_evaluations_are_pinned_to_their_versions_while_the_learner_goes_on(models, tmp_path, monkeypatch):  # noqa: F811
    inline, inline_summary, inline_calls = _run(models, tmp_path, "inline", monkeypatch)
    background, summary, calls = _run(models, tmp_path, "background", monkeypatch)

    assert [r["step"] for r in optimizer_step_records(inline)] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in optimizer_step_records(background)] == [1, 2, 3, 4, 5, 6]
    inline_evals = {r["step"]: (r["eval_version"], r["eval_accuracy"]) for r in inline if "eval_accuracy" in r}
    evals = {r["step"]: (r["eval_version"], r["eval_accuracy"]) for r in background if "eval_accuracy" in r}
    assert sorted(inline_evals) == [2, 4, 6] and all(v == step for step, (v, _) in inline_evals.items())
    # the same weights at each version: a copy of version v, not the learner's weights when
    # the worker got to it (it was two steps on at version 2)
    assert evals == inline_evals
    assert len(set(evals.values())) == 3  # the weights moved between evaluations
    steps_written = [r["step"] for r in background]
    eval_at = {r["eval_version"]: i for i, r in enumerate(background) if "eval_version" in r}
    assert steps_written.index(3) < eval_at[2]  # the learner went on while version 2 was evaluated
    assert eval_at[4] < steps_written.index(5)  # the checkpoint at 4 waited for its evaluation
    for records in (inline, background):  # in the optimizer steps' records: eval_… only inline
        steps = optimizer_step_records(records)
        assert all(("eval_accuracy" in r) == (records is inline and r["step"] % 2 == 0) for r in steps)
    # the last version's evaluation is the summary's: measured once
    assert summary["student_after"] == inline_summary["student_after"] == evals[6][1]
    assert calls.count(evals[6][1]) == inline_calls.count(evals[6][1]) == 1
