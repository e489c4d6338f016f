"""Configs are validated up front: errors name the field and the allowed values."""

from __future__ import annotations

import pytest

from asyncopd_jax.config import ConfigError, load_config
from asyncopd_jax.cli import DEMO_CONFIG


def test_demo_config_loads_and_overrides_apply():
    cfg = load_config(DEMO_CONFIG, ["learner.batch_size=32", "schedule.mode=sync", "estimator.mc_clip_eps=0.2"])
    assert cfg.learner.batch_size == 32 and cfg.schedule.mode == "sync" and cfg.estimator.mc_clip_eps == 0.2
    assert cfg.schedule.eta(cfg.learner.mini_batches) == 0


@pytest.mark.parametrize("override,message", [
    ("learner.batchsize=3", r"unknown config field learner.batchsize; allowed in learner: batch_size, mini_batches"),
    ("nonsense=1", r"unknown config field nonsense; allowed in the top level: name, output_dir"),
    ("estimator.name=kl", r"estimator.name = 'kl' is invalid; allowed: decoupled_ppo, forward_kl_mc"),
    ("schedule.mode=async", r"schedule.mode = 'async' is invalid; allowed: sync, n_step_off, fully_async"),
    ("learner.batch_size=lots", r"learner.batch_size = 'lots' is invalid; allowed: an integer"),
    ("learner.mini_batches=3", r"learner.mini_batches = 3 is invalid; allowed: a divisor of learner.batch_size"),
    ("estimator.name=reverse_kl_topk", r"estimator.name = 'reverse_kl_topk' needs sampling.student_topk >= 1"),
])
def test_bad_fields_name_themselves(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO_CONFIG, [override])


def test_the_hybrid_estimator_needs_candidates_and_a_student_top_k():
    with pytest.raises(ConfigError, match=r"'reverse_kl_hybrid' needs sampling.num_candidates >= 1"):
        load_config(DEMO_CONFIG, ["estimator.name=reverse_kl_hybrid", "sampling.student_topk=4"])
    with pytest.raises(ConfigError, match=r"'reverse_kl_hybrid' needs sampling.student_topk >= 1"):
        load_config(DEMO_CONFIG, ["estimator.name=reverse_kl_hybrid", "sampling.num_candidates=4"])
    load_config(DEMO_CONFIG, ["estimator.name=reverse_kl_hybrid", "sampling.num_candidates=4", "sampling.student_topk=4"])


MC = ["estimator.name=reverse_kl_mc", "sampling.num_candidates=4"]


def test_truncated_sampling_with_mc_needs_an_explicit_opt_in():
    with pytest.raises(ConfigError, match=r"sampling.top_p=0.9 .*truncate the sampling distribution.*allow_truncated_mc"):
        load_config(DEMO_CONFIG, [*MC, "sampling.top_p=0.9"])
    cfg = load_config(DEMO_CONFIG, [*MC, "sampling.top_p=0.9", "sampling.allow_truncated_mc=true"])
    assert cfg.sampling.allow_truncated_mc
    load_config(DEMO_CONFIG, ["sampling.top_p=0.9"])  # no MC candidates: truncation is allowed


def test_mc_estimators_need_candidates():
    with pytest.raises(ConfigError, match=r"estimator.name = 'reverse_kl_mc' needs sampling.num_candidates >= 1"):
        load_config(DEMO_CONFIG, ["estimator.name=reverse_kl_mc", "sampling.num_candidates=0"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
