"""``schedule.mode: fixed_lag``: every step trains on rollouts exactly ``lag`` versions old,
deterministically from the seed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from asyncopd_jax.config import ConfigError
from asyncopd_jax.pipeline.trainer import Trainer
from tests.pipeline.test_trainer import _config, models  # noqa: F401 - fixture


def _run(models, tmp_path, name, **sets):  # noqa: F811
    cfg = _config(models, tmp_path, **{"name": name, "train.steps": 7, "train.checkpoint_every": 100, **sets})
    Trainer(cfg, progress=False).run()
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e  # a whole run: the end-to-end step (-m e2e)
def test_every_token_is_exactly_lag_versions_old_and_the_run_repeats(models, tmp_path):  # noqa: F811
    records = _run(models, tmp_path, "a", **{"schedule.mode": "fixed_lag", "schedule.lag": 3})
    # Step s is taken at version s − 1 on rollouts of version max(0, s − 1 − 3).
    want = [min(s - 1, 3) for s in range(1, 8)]
    assert [r["staleness_max"] for r in records] == want
    assert [r["staleness_mean"] for r in records] == want  # every token, not just the oldest
    assert all(r["dropped_stale"] == r["dropped_future"] == 0 for r in records)
    again = _run(models, tmp_path, "b", **{"schedule.mode": "fixed_lag", "schedule.lag": 3})
    np.testing.assert_allclose([r["loss"] for r in again], [r["loss"] for r in records], rtol=1e-6)
    other = _run(models, tmp_path, "c", **{"schedule.mode": "fixed_lag", "schedule.lag": 1})
    assert [r["staleness_max"] for r in other] == [0] + [1] * 6
    # Same prompts and keys, other behaviour policies: the losses part after step 2.
    assert other[1]["loss"] == pytest.approx(records[1]["loss"], rel=1e-6)
    assert abs(other[-1]["loss"] - records[-1]["loss"]) > 1e-4


@pytest.mark.slow  # CI time: the exact-lag test above runs in CI
def test_lag_zero_is_the_sync_schedule_step_for_step(models, tmp_path):  # noqa: F811
    fixed = _run(models, tmp_path, "fixed", **{"schedule.mode": "fixed_lag", "schedule.lag": 0})
    sync = _run(models, tmp_path, "sync", **{"schedule.mode": "sync"})
    assert [r["staleness_max"] for r in fixed] == [0] * 7
    np.testing.assert_allclose([r["loss"] for r in fixed], [r["loss"] for r in sync], rtol=1e-6)


@pytest.mark.parametrize(
    "sets,message",
    [
        (
            {"learner.mini_batches": 2},
            r"learner.mini_batches = 2 is invalid with schedule.mode = fixed_lag; allowed: 1",
        ),
        (
            {"stages.placement": "processes"},
            r"stages.placement = 'processes' is invalid with schedule.mode = fixed_lag",
        ),
        ({"schedule.lag": -1}, r"schedule.lag = -1 is invalid; allowed: >= 0"),
    ],
)
def test_bad_fixed_lag_settings_name_the_field(models, tmp_path, sets, message):  # noqa: F811
    with pytest.raises(ConfigError, match=message):
        _config(models, tmp_path, **{"schedule.mode": "fixed_lag", **sets})


@pytest.mark.e2e  # a whole run: the end-to-end step (-m e2e)
def test_the_configured_aggregation_reaches_the_learner(models, tmp_path):  # noqa: F811
    """``estimator.aggregation`` is the learner's: the first step (the same rollouts, the same
    per-token losses) is the token sum S over the token count N in the token mean, and over
    (sequences × horizon) with Dr. GRPO's seq-mean-token-sum-norm (horizon: max_new_tokens)."""
    lag0 = {"schedule.mode": "fixed_lag", "schedule.lag": 0, "train.steps": 1}
    token = _run(models, tmp_path, "token", **lag0)[0]
    cfg = _config(
        models,
        tmp_path,
        **{"name": "norm", "train.checkpoint_every": 100, "estimator.aggregation": "seq-mean-token-sum-norm", **lag0},
    )
    Trainer(cfg, progress=False).run()
    norm = json.loads((tmp_path / "norm" / "metrics.jsonl").read_text().splitlines()[0])
    assert norm["tokens"] == token["tokens"] < 8 * 12  # some answers end before the horizon
    np.testing.assert_allclose(norm["loss"] * 8 * 12, token["loss"] * token["tokens"], rtol=1e-5)
