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


@pytest.mark.parametrize("name,field", [
    ("forward_kl_topk", "scoring.topk"), ("forward_kl_topk_renormalized", "scoring.topk"),
    ("forward_kl_mc", "scoring.num_samples"), ("reverse_kl_mc_loo", "sampling.num_candidates"),
])
def test_every_estimator_asks_for_the_ids_its_spec_needs(name, field):
    """The config asks the estimator's spec what it needs (no list of names to keep in step)."""
    with pytest.raises(ConfigError, match=rf"estimator.name = '{name}' needs {field} >= 1"):
        load_config(DEMO_CONFIG, [f"estimator.name={name}", f"{field}=0"])


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


def test_numbers_in_exponent_form_are_numbers():
    # YAML 1.1 (PyYAML) reads "1e-3" (no dot) as a string; a float field takes it as 0.001.
    assert load_config(DEMO_CONFIG, ["optim.learning_rate=1e-3"]).optim.learning_rate == 1e-3
    assert load_config(DEMO_CONFIG, ["optim.learning_rate=2E+1"]).optim.learning_rate == 20.0
    with pytest.raises(ConfigError, match=r"optim.learning_rate = '1e-3x' is invalid; allowed: a number"):
        load_config(DEMO_CONFIG, ["optim.learning_rate=1e-3x"])


RL = ["algorithm=rl", "estimator.name=decoupled_ppo", "rl.samples_per_prompt=8"]


def test_rl_config_and_what_it_needs():
    cfg = load_config(DEMO_CONFIG, [*RL, "teacher.path=''"])
    assert cfg.samples_per_prompt == 8 and not cfg.needs_teacher_scores
    assert cfg.estimator_options().distill_coef == 0.0
    cfg = load_config(DEMO_CONFIG, [*RL, "rl.distill_coef=0.3"])
    assert cfg.needs_teacher_scores and cfg.estimator_options().distill_coef == 0.3
    assert load_config(DEMO_CONFIG, []).samples_per_prompt == 1  # distillation: one answer per prompt


@pytest.mark.parametrize("overrides,message", [
    (["algorithm=rl"], r"estimator.name = 'forward_kl_topk' is invalid with algorithm = rl; allowed: ppo_clip, "
                       r"decoupled_ppo, truncated_is, m2po"),
    ([*RL, "rl.samples_per_prompt=6"], r"rl.samples_per_prompt = 6 is invalid; allowed: a divisor of the 64 samples"),
    ([*RL, "schedule.rollout_workers=2", "rl.samples_per_prompt=64"],
     r"rl.samples_per_prompt = 64 is invalid; allowed: a divisor of the 32 samples"),
    ([*RL, "rl.distill_coef=-1"], r"rl.distill_coef = -1.0 is invalid; allowed: >= 0"),
    ([*RL, "rl.distill_coef=0.5", "teacher.path=''"], r"teacher.path = '' is invalid with rl.distill_coef = 0.5"),
    ([*RL, "stages.scoring_processes=1"], r"stages.scoring_processes = 1 is invalid with algorithm = rl, "
                                          r"rl.distill_coef = 0 and estimator.reference_kl_coef = 0 \(nothing to "
                                          r"score\)"),
    (["estimator.reference_kl_coef=-0.1"], r"estimator.reference_kl_coef = -0.1 is invalid; allowed: >= 0"),
    (["estimator.behavior_weight_floor=6"], r"estimator.behavior_weight_floor = 6.0 is invalid; allowed: null, or "
                                            r">= 0 and below estimator.behavior_weight_cap"),
    (["estimator.aggregation=seq-mean"], r"estimator.aggregation = 'seq-mean' is invalid; allowed: token-mean, "
                                         r"seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm"),
    (["estimator.reference_kl=k4"], r"estimator.reference_kl = 'k4' is invalid; allowed: k1, k2, k3"),
    ([*RL, "task.name=dataset", "task.path=x.jsonl", "task.answer_field=''"],
     r"task.answer_field = '' is invalid with algorithm = rl"),
    (["algorithm=ppo"], r"algorithm = 'ppo' is invalid; allowed: opd, rl"),
])
def test_rl_config_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO_CONFIG, overrides)


def test_every_estimator_setting_reaches_the_estimator_options():
    """Each knob of ``estimator`` set to a non-default value arrives in EstimatorOptions."""
    import dataclasses

    from asyncopd_jax.config import EstimatorConfig
    from asyncopd_jax.estimator_registry import EstimatorOptions

    others = {"mc_clip_eps": 0.3, "mc_importance_sampling": False, "topk_tail": False, "control_variate": True,
              "ppo_clip_eps": 0.1, "dual_clip": 3.0, "behavior_weight_cap": 4.0, "behavior_weight_mode": "truncate",
              "behavior_weight_floor": 0.5, "tis_cap": 1.5, "m2po_budget": 0.1, "second_moment_clip_budget": 0.2,
              "stabiliser_signal": "recompute", "entropy_coef": 0.01, "reference_kl_coef": 0.1, "reference_kl": "k2",
              "check_inputs": True}
    shared = {f.name for f in dataclasses.fields(EstimatorOptions)} & {f.name for f in dataclasses.fields(EstimatorConfig)}
    assert shared == set(others)  # a new knob must be added here
    defaults = EstimatorConfig().options()
    options = EstimatorConfig(gspo_clip_low=0.01, gspo_clip_high=0.02, **others).options()
    for name, value in others.items():
        assert getattr(options, name) == value != getattr(defaults, name), name
    assert options.gspo_clip_eps == (0.01, 0.02) != defaults.gspo_clip_eps
