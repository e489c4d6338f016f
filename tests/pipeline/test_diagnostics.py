"""Study diagnostics: exact KLs against NumPy, and logged by a run at the right steps."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax.pipeline.diagnostics import exact_kls
from asyncopd_jax.pipeline.trainer import Trainer
from tests.estimators import oracle
from tests.pipeline.test_trainer import _config, models  # noqa: F401 - fixture


def test_exact_kls_match_numpy_over_masked_positions_in_uneven_chunks():
    rng = np.random.default_rng(0)
    B, T, H, H2, V = 3, 5, 4, 6, 11
    s, old = rng.normal(size=(B, T, H)), rng.normal(size=(B, T, H))
    q = rng.normal(size=(B, T, H2))
    w, w2 = rng.normal(size=(H, V)), rng.normal(size=(H2, V))
    mask = rng.uniform(size=(B, T)) > 0.3
    got = exact_kls(
        *(jnp.asarray(x, jnp.float32) for x in (s, q, old, w, w2)),
        jnp.asarray(mask),
        student_temperature=0.7,
        teacher_temperature=1.3,
        chunk=4,
    )  # 15 positions: 4 chunks
    ls, lq, lo = oracle.log_softmax(s @ w / 0.7), oracle.log_softmax(q @ w2 / 1.3), oracle.log_softmax(old @ w / 0.7)
    want = {"reverse": oracle.kl(ls, lq), "forward": oracle.kl(lq, ls), "drift": oracle.kl(ls, lo)}
    for name, per_token in want.items():
        np.testing.assert_allclose(got[name], per_token[mask].mean(), rtol=1e-4, err_msg=name)


@pytest.mark.slow  # CI time (~40 s): the exact-KL test above runs in CI
def test_a_run_logs_the_probe_kls_every_few_steps(models, tmp_path):  # noqa: F811
    cfg = _config(
        models,
        tmp_path,
        **{
            "schedule.mode": "fixed_lag",
            "schedule.lag": 2,
            "train.steps": 8,
            "train.diagnostics_every": 4,
            "train.diagnostic_prompts": 16,
        },
    )
    Trainer(cfg, progress=False).run()
    records = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    probed = {r["step"]: r for r in records if "probe_reverse_kl" in r}
    assert sorted(probed) == [1, 5]  # measured before the steps taken at versions 0 and 4
    first, later = probed[1], probed[5]
    assert first["probe_behaviour_version"] == 0 and later["probe_behaviour_version"] == 2
    assert first["probe_drift_kl"] < 1e-6 < later["probe_drift_kl"]  # π_0 against itself; π_4 against π_2
    assert later["probe_forward_kl"] < first["probe_forward_kl"]  # training on forward KL brings it down
    assert 0 < later["probe_reverse_kl"] and 0 < later["probe_forward_kl"]
