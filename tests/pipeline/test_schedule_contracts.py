"""What every placement owes the schedule: a synchronous run never drops a group, every
version a rollout needs is published (or the run stops saying which one is missing),
and the teacher scores at ``scoring.temperature``, not at the student's."""

from __future__ import annotations

import json
import threading
import time

import jax
import numpy as np
import pytest

from asyncopd_jax.models import from_pretrained
from asyncopd_jax.pipeline import snapshots as snapshots_module
from asyncopd_jax.pipeline.staleness import PipelineStopped
from asyncopd_jax.pipeline.trainer import Trainer
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.teacher import ScoringParams, TeacherScorer
from tests.pipeline.test_trainer import _config, models  # noqa: F401 - fixture

pytestmark = pytest.mark.e2e  # whole runs in every placement: the end-to-end step (-m e2e)

PLACEMENTS = {"threads": {}, "processes": {"stages.placement": "processes"}}


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_sync_with_stage_processes_never_drops_a_group_while_a_snapshot_is_written(models, tmp_path, monkeypatch):  # noqa: F811
    """Each snapshot takes 0.3 s to commit (after the learner moved on): a rollout admitted
    meanwhile must wait for it, not sample the previous version and be dropped as stale."""
    real_save = snapshots_module.save_file
    monkeypatch.setattr(snapshots_module, "save_file", lambda *a, **k: (time.sleep(0.3), real_save(*a, **k))[1])
    cfg = _config(
        models,
        tmp_path,
        **{"schedule.mode": "sync", "train.steps": 6, "train.checkpoint_every": 100, **PLACEMENTS["processes"]},
    )
    summary = Trainer(cfg, progress=False).run()
    records = _records(tmp_path / "t")
    assert summary["dropped_stale"] == 0 and [r["staleness_max"] for r in records] == [0] * 6, [
        (r["dropped_stale"], r["staleness_max"]) for r in records
    ]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_learner_that_skips_a_version_stops_the_run_naming_it(models, tmp_path, placement):  # noqa: F811
    """A learner that (wrongly) publishes only every second version would leave a sync run
    waiting forever for version 1; the rollout's wait is bounded and its error names it."""
    cfg = _config(
        models,
        tmp_path,
        **{"schedule.mode": "sync", "train.steps": 6, "stages.startup_timeout": 15, **PLACEMENTS[placement]},
    )
    trainer = Trainer(cfg, progress=False)
    store = trainer.snapshots
    real_publish = store.publish
    store.publish = lambda version, params: real_publish(version, params) if version % 2 == 0 else None
    # A livelock (rollouts from the old version, dropped, again and again) fails instead of hanging.
    watchdog = threading.Timer(
        150, lambda: trainer.stages.buffer.fail(AssertionError("livelock: no error, no progress"))
    )
    watchdog.start()
    start = time.monotonic()
    try:
        with pytest.raises((PipelineStopped, RuntimeError)) as caught:
            trainer.run()
    finally:
        watchdog.cancel()
    text = f"{caught.value} {caught.value.__cause__}"
    assert "policy snapshot 1 was not" in text, text
    assert time.monotonic() - start < 120


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_teacher_scores_at_the_scoring_temperature_in_every_placement(models, tmp_path, placement):  # noqa: F811
    """Sampling at 0.7 and scoring at 1.6: the cache of the first batch equals the
    teacher's own scores at 1.6 (and not at 0.7, so the comparison can fail)."""
    cfg = _config(
        models,
        tmp_path,
        **{
            "schedule.mode": "sync",
            "train.steps": 1,
            "sampling.temperature": 0.7,
            "scoring.temperature": 1.6,
            **PLACEMENTS[placement],
        },
    )
    trainer = Trainer(cfg, progress=False)
    taken = []
    real_start = trainer._start_stages

    def recording_start(buffer):
        stages = real_start(buffer)
        real_take = stages.take
        stages.take = lambda version: taken.extend(real_take(version)) or taken
        return stages

    trainer._start_stages = recording_start
    trainer.run()
    teacher = from_pretrained(resolve_model_path("builtin:teacher"))
    teacher.vocab_limit = trainer.vocab_limit
    for group in taken:
        batch = jax.tree_util.tree_map(np.asarray, group.batch)
        for temperature, equal in ((1.6, True), (0.7, False)):
            expected = TeacherScorer(teacher, ScoringParams(topk=8, temperature=temperature, chunk_size=64)).score(
                batch
            )
            mask = batch.response_mask
            close = np.allclose(
                np.asarray(group.cache.topk_logp)[mask], np.asarray(expected.topk_logp)[mask], atol=1e-4
            ) and np.allclose(
                np.asarray(group.cache.token_logp)[mask], np.asarray(expected.token_logp)[mask], atol=1e-4
            )
            assert close == equal, (placement, temperature)
