"""Configs are validated up front: errors name the field and the allowed values."""

from __future__ import annotations

import dataclasses

import pytest

from asyncopd_jax.cli import DEMO_CONFIG
from asyncopd_jax.config import ConfigError, check_learner_processes, load_config
from asyncopd_jax.estimator_ids import ID_SOURCES
from asyncopd_jax.estimator_registry import ESTIMATORS, RL_ESTIMATORS


def test_demo_config_loads_and_overrides_apply():
    cfg = load_config(DEMO_CONFIG, ["learner.batch_size=32", "schedule.mode=sync", "estimator.mc.clip_eps=0.2"])
    assert cfg.learner.batch_size == 32 and cfg.schedule.mode == "sync" and cfg.estimator.mc.clip_eps == 0.2
    assert cfg.eta == 0


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "learner.batchsize=3",
            r"unknown config field learner.batchsize; allowed in learner: batch_size, mini_batches",
        ),
        ("nonsense=1", r"unknown config field nonsense; allowed in the top level: name, output_dir"),
        (
            "estimator.name=kl",
            r"estimator.name = 'kl' is invalid; allowed: decoupled_ppo, forward_kl_dense, forward_kl_mc",
        ),
        ("schedule.mode=async", r"schedule.mode = 'async' is invalid; allowed: sync, n_step_off, fully_async"),
        ("learner.batch_size=lots", r"learner.batch_size = 'lots' is invalid; allowed: an integer"),
        ("learner.mini_batches=3", r"learner.mini_batches = 3 is invalid; allowed: a divisor of learner.batch_size"),
        ("estimator.name=reverse_kl_topk", r"estimator.name = 'reverse_kl_topk' needs sampling.student_topk >= 1"),
    ],
)
def test_bad_fields_name_themselves(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO_CONFIG, [override])


@pytest.mark.parametrize(
    "name,field",
    [
        ("forward_kl_topk", "scoring.topk"),
        ("forward_kl_topk_renormalized", "scoring.topk"),
        ("forward_kl_mc", "scoring.num_samples"),
        ("reverse_kl_mc_loo", "sampling.num_candidates"),
    ],
)
def test_every_estimator_asks_for_the_ids_its_spec_needs(name, field):
    """The config asks the estimator's spec what it needs (no list of names to keep in step)."""
    with pytest.raises(ConfigError, match=rf"estimator.name = '{name}' needs {field} >= 1"):
        load_config(DEMO_CONFIG, [f"estimator.name={name}", f"{field}=0"])


def test_the_hybrid_estimator_needs_candidates_and_a_student_top_k():
    with pytest.raises(ConfigError, match=r"'reverse_kl_hybrid' needs sampling.num_candidates >= 1"):
        load_config(DEMO_CONFIG, ["estimator.name=reverse_kl_hybrid", "sampling.student_topk=4"])
    with pytest.raises(ConfigError, match=r"'reverse_kl_hybrid' needs sampling.student_topk >= 1"):
        load_config(DEMO_CONFIG, ["estimator.name=reverse_kl_hybrid", "sampling.num_candidates=4"])
    load_config(
        DEMO_CONFIG, ["estimator.name=reverse_kl_hybrid", "sampling.num_candidates=4", "sampling.student_topk=4"]
    )


MC = ["estimator.name=reverse_kl_mc", "sampling.num_candidates=4"]


def test_truncated_sampling_with_mc_needs_an_explicit_opt_in():
    with pytest.raises(
        ConfigError, match=r"sampling.top_p=0.9 .*truncate the sampling distribution.*allow_truncated_mc"
    ):
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
    assert cfg.samples_per_prompt == 8 and not cfg.needs_teacher_scores and not cfg.needs_scoring
    cfg = load_config(DEMO_CONFIG, [*RL, "rl.distill_coef=0.3"])
    assert cfg.needs_teacher_scores and cfg.rl.distill_coef == 0.3
    cfg = load_config(DEMO_CONFIG, [*RL, "teacher.path=''", "estimator.regularisers.reference_kl_coef=0.1"])
    assert cfg.needs_scoring and not cfg.needs_teacher_scores  # the reference policy's log-probs only
    assert load_config(DEMO_CONFIG, []).samples_per_prompt == 1  # distillation: one answer per prompt


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["algorithm=rl"],
            r"estimator.name = 'forward_kl_topk' is invalid with algorithm = rl; allowed: ppo_clip, "
            r"decoupled_ppo, gspo, gspo_token, truncated_is, m2po, second_moment_clip$",
        ),
        (
            [*RL, "rl.samples_per_prompt=6"],
            r"rl.samples_per_prompt = 6 is invalid; allowed: a divisor of the 64 samples",
        ),
        (
            [*RL, "stages.rollouts=2", "rl.samples_per_prompt=64"],
            r"rl.samples_per_prompt = 64 is invalid; allowed: a divisor of the 32 samples",
        ),
        ([*RL, "rl.distill_coef=-1"], r"rl.distill_coef = -1.0 is invalid; allowed: >= 0"),
        ([*RL, "rl.distill_coef=0.5", "teacher.path=''"], r"teacher.path = '' is invalid with rl.distill_coef = 0.5"),
        (
            [*RL, "stages.scoring_processes=1"],
            r"stages.scoring_processes = 1 is invalid with algorithm = rl, "
            r"rl.distill_coef = 0 and estimator.regularisers.reference_kl_coef = 0 \(nothing to "
            r"score\)",
        ),
        (
            ["estimator.regularisers.reference_kl_coef=-0.1"],
            r"estimator.regularisers.reference_kl_coef = -0.1 is invalid; allowed: >= 0",
        ),
        (
            ["estimator.ppo.behavior_weight_floor=6"],
            r"estimator.ppo.behavior_weight_floor = 6.0 is invalid; allowed: null, or "
            r">= 0 and below estimator.ppo.behavior_weight_cap",
        ),
        (
            ["estimator.aggregation=seq-mean"],
            r"estimator.aggregation = 'seq-mean' is invalid; allowed: token-mean, "
            r"seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm",
        ),
        (
            ["estimator.regularisers.reference_kl=k4"],
            r"estimator.regularisers.reference_kl = 'k4' is invalid; allowed: k1, k2, k3",
        ),
        (
            [*RL, "task.name=dataset", "task.path=x.jsonl", "task.answer_field=''"],
            r"task.answer_field = '' is invalid with algorithm = rl",
        ),
        (["algorithm=ppo"], r"algorithm = 'ppo' is invalid; allowed: opd, rl"),
    ],
)
def test_rl_config_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO_CONFIG, overrides)


# --- the estimator's spec drives validation ----------------------------------------

# Every setting that makes an id set, at 0 (none made) and at 4.
NO_IDS = [f"{source.setting.name}=0" for source in ID_SOURCES.values()]
ALL_IDS = [f"{source.setting.name}=4" for source in ID_SOURCES.values()]


@pytest.mark.parametrize("name,need", [(name, need) for name, spec in ESTIMATORS.items() for need in spec.needs])
def test_every_registered_estimator_refuses_a_config_that_does_not_make_what_it_needs(name, need):
    """For every spec in the registry and every id set it declares: the setting that makes
    that set at 0 (all the others made) is refused up front, naming the setting."""
    setting = ID_SOURCES[need].setting.name
    with pytest.raises(ConfigError, match=rf"^estimator.name = '{name}' needs {setting} >= 1$"):
        load_config(DEMO_CONFIG, [f"estimator.name={name}", *ALL_IDS, f"{setting}=0"])


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_every_registered_estimator_loads_with_exactly_what_it_needs(name):
    """Nothing but the spec's own id sets is asked for: every other setting may be 0."""
    made = [f"{ID_SOURCES[need].setting.name}=4" for need in ESTIMATORS[name].needs] + _payload(name)
    cfg = load_config(DEMO_CONFIG, [f"estimator.name={name}", *NO_IDS, *made])
    assert cfg.estimator.spec is ESTIMATORS[name]


def _payload(name: str) -> list[str]:
    """The setting an estimator that reads the teacher's hidden states needs beside its ids."""
    return ["teacher.payload=hidden"] if ESTIMATORS[name].needs_teacher_hidden else []


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_rl_takes_exactly_the_estimators_whose_spec_weights_an_advantage(name):
    overrides = ["algorithm=rl", f"estimator.name={name}", "rl.samples_per_prompt=8", *ALL_IDS]
    if ESTIMATORS[name].needs_advantage:
        cfg = load_config(DEMO_CONFIG, [*overrides, "teacher.path=''"])
        assert not cfg.needs_teacher_scores  # β = 0: the reward alone
        assert load_config(DEMO_CONFIG, [*overrides, "rl.distill_coef=0.1"]).needs_teacher_scores
    else:
        with pytest.raises(ConfigError, match=rf"estimator.name = '{name}' is invalid with algorithm = rl"):
            load_config(DEMO_CONFIG, overrides)
    assert (name in RL_ESTIMATORS) == ESTIMATORS[name].needs_advantage
    distillation = [f"estimator.name={name}", *ALL_IDS, *_payload(name)]
    assert load_config(DEMO_CONFIG, distillation).needs_teacher_scores


def test_each_id_source_reads_and_names_its_setting():
    """The typed references of ID_SOURCES: each setting reads the run config's count it is
    named by (so the messages above name what --set takes), and each id field is named by
    its class and field."""
    cfg = load_config(DEMO_CONFIG, [f"{source.setting.name}={i + 2}" for i, source in enumerate(ID_SOURCES.values())])
    assert [source.setting.read(cfg) for source in ID_SOURCES.values()] == [2, 3, 4, 5]
    assert str(ID_SOURCES["candidates"].ids) == "RolloutBatch.candidate_ids"
    assert str(ID_SOURCES["teacher_topk"].scores) == "TeacherScoreCache.topk_logp"
    assert [s.ids.owner.__name__ for s in ID_SOURCES.values()] == [
        "RolloutBatch",
        "RolloutBatch",
        "TeacherScoreCache",
        "TeacherScoreCache",
    ]


def test_a_typed_reference_must_name_a_field():
    from asyncopd_jax.cache import RolloutBatch
    from asyncopd_jax.estimator_ids import ArrayField, Setting

    with pytest.raises(TypeError, match=r"^RolloutBatch has no field 'topk_ids'$"):
        ArrayField(RolloutBatch, lambda b: b.topk_ids)
    with pytest.raises(TypeError, match=r"must only read attributes"):
        Setting(lambda cfg: 4)
    with pytest.raises(TypeError):
        Setting(lambda cfg: cfg.sampling.num_candidates + cfg.scoring.topk)


def test_an_asymmetric_clip_range_loads_from_yaml():
    cfg = load_config(DEMO_CONFIG, ["estimator.ppo.clip_eps=[0.2, 0.28]", "estimator.mc.clip_eps=[0.1, 0.3]"])
    assert cfg.estimator.ppo.clip_eps == (0.2, 0.28) and cfg.estimator.mc.clip_eps == (0.1, 0.3)


def test_a_nested_estimator_knob_set_on_the_command_line_reaches_the_estimator(tmp_path):
    """``--set estimator.ppo.clip_eps=0.3`` (and a YAML file's nested ``ppo:``) reach the
    estimator's sub-section, leaving its other knobs and the other sub-sections at their
    defaults."""
    from asyncopd_jax.estimator_registry import EstimatorConfig, PPOConfig

    cfg = load_config("rl", ["estimator.ppo.clip_eps=0.3", "estimator.tis.cap=4"])
    assert cfg.estimator.ppo == PPOConfig(clip_eps=0.3, behavior_weight_cap=5.0)
    assert cfg.estimator.tis.cap == 4.0 and cfg.estimator.mc == EstimatorConfig().mc
    path = tmp_path / "run.yaml"
    path.write_text("estimator:\n  name: ppo_clip\n  ppo:\n    clip_eps: 0.1\n    dual_clip: 3\n")
    assert load_config(path).estimator.ppo == PPOConfig(clip_eps=0.1, dual_clip=3.0)
    with pytest.raises(ConfigError, match=r"^unknown config field estimator.ppo.clip; allowed in estimator.ppo: "):
        load_config(DEMO_CONFIG, ["estimator.ppo.clip=0.3"])


@pytest.mark.parametrize(
    "old,new",
    [
        ("estimator.ppo_clip_eps=0.3", "estimator.ppo.clip_eps"),
        ("estimator.mc_clip_eps=0.2", "estimator.mc.clip_eps"),
        ("estimator.mc_importance_sampling=false", "estimator.mc.importance_sampling"),
        ("estimator.topk_tail=true", "estimator.topk.tail"),
        ("estimator.reference_kl_coef=0.1", "estimator.regularisers.reference_kl_coef"),
        ("estimator.second_moment_clip_min_low=0.1", "estimator.second_moment_clip.min_low"),
    ],
)
def test_an_old_flat_estimator_knob_is_named_with_its_new_place(old, new):
    with pytest.raises(ConfigError, match=rf"^config field {old.split('=')[0]} is now {new} \(same values\)$"):
        load_config(DEMO_CONFIG, [old])


def test_a_config_with_several_old_estimator_knobs_is_told_every_new_place(tmp_path):
    """The shipped rl.yaml as it was before the knobs were grouped: one line naming both."""
    path = tmp_path / "old_rl.yaml"
    path.write_text("estimator:\n  name: decoupled_ppo\n  ppo_clip_eps: 0.2\n  behavior_weight_cap: 5.0\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        "config field estimator.behavior_weight_cap is now estimator.ppo.behavior_weight_cap, "
        "estimator.ppo_clip_eps is now estimator.ppo.clip_eps (same values)"
    )


# --- each section checks its own fields, at load_config ----------------------------

SECTION_CHECKS = [
    ("task.eval_fraction=1", r"task.eval_fraction = 1.0 is invalid; allowed: 0 <= fraction < 1"),
    ("task.name=dataset", r"task.path = '' is invalid with task.name = dataset; allowed: a .jsonl or .parquet file"),
    ("rl.samples_per_prompt=0", r"rl.samples_per_prompt = 0 is invalid; allowed: >= 1"),
    ("rl.distill_coef=-0.5", r"rl.distill_coef = -0.5 is invalid; allowed: >= 0"),  # in distillation too
    ("optim.learning_rate=0", r"optim.learning_rate = 0.0 is invalid; allowed: > 0"),
    ("learner.extrapolation.factors=[]", r"learner.extrapolation.factors = \(\) is invalid; allowed: a non-empty list"),
    (
        "learner.extrapolation.factors=[3, 1]",
        r"learner.extrapolation.factors = \(3.0, 1.0\) is invalid; allowed: "
        r"a non-empty list of factors > 1",
    ),
    ("learner.extrapolation.probe_prompts=0", r"learner.extrapolation.probe_prompts = 0 is invalid; allowed: >= 1"),
    (
        "learner.extrapolation.probe_temperature=-1",
        r"learner.extrapolation.probe_temperature = -1.0 is invalid; "
        r"allowed: >= 0 \(0: greedy answers\)",
    ),
    ("learner.batch_size=0", r"learner.batch_size = 0 is invalid; allowed: >= 1"),
    ("learner.mini_batches=0", r"learner.mini_batches = 0 is invalid; allowed: a divisor of learner.batch_size"),
    (
        "learner.micro_batches=3",
        r"learner.micro_batches = 3 is invalid; allowed: a divisor of learner.batch_size / "
        r"learner.mini_batches",
    ),
    ("learner.token_budget=-1", r"learner.token_budget = -1 is invalid; allowed: >= 0 \(0: off\)"),
    ("learner.token_bucket=0", r"learner.token_bucket = 0 is invalid; allowed: >= 1"),
    ("schedule.max_staleness=-1", r"schedule.max_staleness = -1 is invalid; allowed: >= 0"),
    ("schedule.n_step=0", r"schedule.n_step = 0 is invalid; allowed: >= 1"),
    ("schedule.lag=-1", r"schedule.lag = -1 is invalid; allowed: >= 0"),
    ("stages.rollouts=0", r"stages.rollouts = 0 is invalid; allowed: >= 1"),
    ("stages.rollouts=0", r"stages.rollouts = 0 is invalid; allowed: >= 1"),
    ("stages.scoring_processes=-1", r"stages.scoring_processes = -1 is invalid; allowed: >= 0"),
    ("stages.restarts=-1", r"stages.restarts = -1 is invalid; allowed: >= 0"),
    ("stages.rollout_niceness=20", r"stages.rollout_niceness = 20 is invalid; allowed: 0 to 19"),
    ("stages.rollout_cores=3-1", r"stages.rollout_cores = '3-1' is invalid; allowed: 'auto', '' or a CPU list"),
    ("distributed.num_processes=-1", r"distributed.num_processes = -1 is invalid; allowed: >= 0"),
    ("distributed.process_id=-2", r"distributed.process_id = -2 is invalid; allowed: -1 \(from the environment\)"),
    ("train.steps=0", r"train.steps = 0 is invalid; allowed: >= 1"),
    ("train.eval_every=0", r"train.eval_every = 0 is invalid; allowed: >= 1 \(the last step is always evaluated\)"),
    ("train.checkpoint_every=0", r"train.checkpoint_every = 0 is invalid; allowed: >= 1 \(and the last step\)"),
    ("train.diagnostics_every=-1", r"train.diagnostics_every = -1 is invalid; allowed: >= 0 \(0: off\)"),
    ("train.diagnostic_prompts=0", r"train.diagnostic_prompts = 0 is invalid; allowed: >= 1"),
    ("train.update_geometry_every=-1", r"train.update_geometry_every = -1 is invalid; allowed: >= 0 \(0: off\)"),
    ("estimator.m2po.budget=-1", r"estimator.m2po.budget = -1.0 is invalid; allowed: >= 0"),
    (
        "estimator.mc.clip_eps=1.5",
        r"estimator.mc.clip_eps = 1.5 is invalid; allowed: null, ε with 0 <= ε < 1, or "
        r"\[ε_low, ε_high\]",
    ),
    (
        "estimator.ppo.clip_eps=[0.2, 0.3, 0.4]",
        r"estimator.ppo.clip_eps = \(0.2, 0.3, 0.4\) is invalid; allowed: ε "
        r"with 0 <= ε < 1, or \[ε_low, ε_high\]",
    ),
    ("estimator.ppo.clip_eps=[0.2, -0.1]", r"estimator.ppo.clip_eps = \(0.2, -0.1\) is invalid"),
    ("estimator.gspo.clip_low=1", r"estimator.gspo.clip_low = 1.0 is invalid; allowed: 0 <= ε_low < 1"),
    ("estimator.gspo.clip_high=-1", r"estimator.gspo.clip_high = -1.0 is invalid; allowed: >= 0"),
    ("estimator.ppo=0.3", r"estimator.ppo must be a mapping, got 0.3"),
]


@pytest.mark.parametrize("override,message", SECTION_CHECKS, ids=[o for o, _ in SECTION_CHECKS])
def test_each_section_refuses_a_bad_field_at_load_config_in_one_line(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(DEMO_CONFIG, [override])
    assert "\n" not in str(err.value)


def test_a_section_built_in_python_checks_its_fields_too():
    from asyncopd_jax.config import LearnerConfig, ScheduleConfig
    from asyncopd_jax.estimator_registry import EstimatorConfig, PPOConfig

    with pytest.raises(ConfigError, match=r"^learner.mini_batches = 3 is invalid"):
        LearnerConfig(batch_size=8, mini_batches=3)
    with pytest.raises(ConfigError, match=r"^schedule.lag = -1 is invalid; allowed: >= 0"):
        ScheduleConfig(mode="fixed_lag", lag=-1)
    with pytest.raises(ConfigError, match=r"^estimator.name = 'kl' is invalid; allowed: decoupled_ppo"):
        EstimatorConfig("kl")
    with pytest.raises(ConfigError, match=r"^estimator.ppo.clip_eps = 1.5 is invalid"):
        PPOConfig(clip_eps=1.5)
    clip_higher = EstimatorConfig("ppo_clip", ppo=PPOConfig(clip_eps=(0.2, 0.28)))  # DAPO's clip-higher
    assert clip_higher.ppo.clip_eps == (0.2, 0.28)
    hash(clip_higher)  # a static jit argument


# --- what the trainer used to find at run time ---------------------------------------

TWO_LEARNERS = [
    "distributed.initialize=true",
    "distributed.num_processes=2",
    "distributed.process_id=0",
    "stages.placement=processes",
]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["train.diagnostics_every=5", "teacher.path=''", *RL],
            r"^train.diagnostics_every = 5 needs one in-process teacher \(teacher.path\); allowed without one: 0$",
        ),
        (
            [*TWO_LEARNERS, "stages.placement=threads"],
            r"^stages.placement = 'threads' is invalid for a learner over 2 processes; allowed: processes",
        ),
        (
            [*TWO_LEARNERS, "learner.token_budget=512"],
            r"^learner.token_budget = 512 is invalid for a learner over 2 processes; allowed: 0",
        ),
        (
            [*TWO_LEARNERS, "stages.snapshot_format=safetensors"],
            r"^stages.snapshot_format = 'safetensors' is invalid for a learner over 2 processes; "
            r"allowed: auto, orbax, objects$",
        ),
        (
            [*TWO_LEARNERS, "train.diagnostics_every=5"],
            r"^train.diagnostics_every = 5 is invalid for a learner over 2 processes; allowed: 0$",
        ),
    ],
)
def test_what_the_trainer_found_at_run_time_is_refused_at_load_config(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(DEMO_CONFIG, overrides)


def test_the_learner_process_count_is_checked_where_the_config_fixes_it():
    """One learner process (no ``distributed.initialize``), or a count from the environment
    (``num_processes = 0``): validation cannot refuse; ``asyncopd train`` checks the count
    ``jax.distributed.initialize`` gave with the same function."""
    one = ["stages.snapshot_format=safetensors", "learner.token_budget=512", "train.diagnostics_every=5"]
    assert load_config(DEMO_CONFIG, one).distributed.learner_processes == 1
    assert load_config(DEMO_CONFIG, [*one, "distributed.num_processes=2"]).distributed.learner_processes == 1
    cfg = load_config(DEMO_CONFIG, [*one, "distributed.initialize=true"])
    assert cfg.distributed.learner_processes is None
    check_learner_processes(cfg, 1)
    with pytest.raises(ConfigError, match=r"^stages.placement = 'threads' is invalid for a learner over 3 "):
        check_learner_processes(cfg, 3)
    assert load_config(DEMO_CONFIG, TWO_LEARNERS).distributed.learner_processes == 2
    with pytest.raises(ConfigError, match=r"^distributed.heartbeat_timeout = 0 is invalid; allowed: > 0$"):
        load_config(DEMO_CONFIG, ["distributed.heartbeat_timeout=0"])


@pytest.mark.parametrize(
    "old,new",
    [
        ("schedule.placement=processes", "stages.placement"),
        ("schedule.rollout_workers=2", "stages.rollouts"),
        ("stages.rollout_processes=2", "stages.rollouts"),
        ("schedule.snapshot_in_memory=false", "stages.snapshot_in_memory"),
    ],
)
def test_a_moved_field_is_named_with_its_new_place(old, new):
    with pytest.raises(ConfigError, match=rf"^config field {old.split('=')[0]} is now {new} \(same values\)$"):
        load_config(DEMO_CONFIG, [old])


def test_where_the_stages_run_is_one_section():
    cfg = load_config(DEMO_CONFIG, ["stages.placement=processes", "stages.rollouts=4", "learner.batch_size=64"])
    assert (cfg.rollout_stages, cfg.group_size) == (4, 16)
    assert load_config(DEMO_CONFIG, ["stages.rollouts=3"]).group_size == 64  # does not split: one group a batch
    fixed = load_config(DEMO_CONFIG, ["schedule.mode=fixed_lag", "stages.rollouts=4"])
    assert (fixed.rollout_stages, fixed.group_size) == (1, 64)  # fixed_lag samples in the learner's thread
    with pytest.raises(ConfigError, match=r"^stages.placement = 'processes' is invalid with schedule.mode = fixed_lag"):
        load_config(DEMO_CONFIG, ["schedule.mode=fixed_lag", "stages.placement=processes"])


def test_dead_fields_are_gone():
    from asyncopd_jax.config import SAFE_ON_RESUME

    with pytest.raises(ConfigError, match=r"unknown config field train.log_every; allowed in train: steps"):
        load_config(DEMO_CONFIG, ["train.log_every=1"])
    assert not [f for f in SAFE_ON_RESUME if f.endswith("log_every")]


#: Every setting that names a file or directory (the test's own list, so a path setting added
#: without the StorageLocation mark shows up as one the sections do not mark).
PATH_SETTINGS = (
    "output_dir",
    "stages.snapshot_dir",
    "task.path",
    "student.path",
    "reference.path",
    "teacher.path",
    "teacher.tokenizer",
    "teacher.prompt.tokenizer",
    "teacher.head_path",
)
#: What a path setting needs beside it to be read at all.
NEEDS = {
    "teacher.head_path": ["teacher.path=''", "teacher.server.url=http://x:1", "teacher.server.api=asyncopd"]
    + ["teacher.payload=hidden"]
}


@pytest.mark.parametrize("setting", PATH_SETTINGS)
def test_a_path_setting_takes_a_bucket_of_a_known_kind_and_refuses_other_urls_in_one_line(setting):
    for url in ("gs://bucket/runs", "s3://bucket/models/student"):
        cfg = load_config(DEMO_CONFIG, [f"{setting}={url}", *NEEDS.get(setting, [])])
        section, _, name = setting.rpartition(".")
        for part in section.split(".") if section else ():
            cfg = getattr(cfg, part)
        assert getattr(cfg, name) == url
    with pytest.raises(ConfigError) as refused:
        load_config(DEMO_CONFIG, [f"{setting}=ftp://h/x", *NEEDS.get(setting, [])])
    assert (
        str(refused.value)
        == f"{setting} = 'ftp://h/x' is invalid; allowed: a path, gs://BUCKET/PREFIX or s3://BUCKET/PREFIX"
    )


def test_snapshots_in_a_bucket_are_objects_for_one_learner_process_or_several():
    from asyncopd_jax.pipeline.layout import snapshot_channel

    bucket = ["output_dir=s3://b/runs", "stages.placement=processes"]
    for fmt in ("orbax", "safetensors"):
        with pytest.raises(
            ConfigError, match=rf"^stages.snapshot_format = '{fmt}' is invalid with snapshots in a bucket"
        ):
            load_config(DEMO_CONFIG, [*bucket, f"stages.snapshot_format={fmt}"])
    load_config(DEMO_CONFIG, [*bucket, "stages.snapshot_format=objects"])
    load_config(DEMO_CONFIG, ["output_dir=s3://b/runs", "stages.snapshot_format=safetensors"])  # threads: in memory
    # a learner over several processes: each checkpoints its own part; snapshots as objects
    two = load_config(
        DEMO_CONFIG, [*bucket, "distributed.initialize=true", "distributed.num_processes=2", "distributed.process_id=0"]
    )
    channel = snapshot_channel(two, "s3://b/runs/demo", multi_process=True)
    assert (channel.format, channel.directory) == ("objects", "s3://b/runs/demo/snapshots")
    assert snapshot_channel(two, "/shared/runs/demo", multi_process=True).format == "orbax"


def test_a_bad_url_in_a_second_teacher_names_that_teacher():
    teachers = "[{name: a, path: builtin:teacher}, {name: b, path: builtin:teacher, tokenizer: ftp://b/tok}]"
    with pytest.raises(ConfigError, match=r"^teachers\[1\]\.tokenizer = 'ftp://b/tok' is invalid; allowed: a path"):
        load_config(DEMO_CONFIG, [f"teachers={teachers}"])


def test_the_sections_mark_exactly_the_path_settings():
    from asyncopd_jax.config.rules import _location_fields

    cfg = load_config(DEMO_CONFIG)
    marked = set()

    def walk(section, prefix):
        for name in _location_fields(type(section)):
            marked.add(prefix + name)
        for field in dataclasses.fields(section):
            value = getattr(section, field.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{field.name}.")

    walk(cfg, "")
    assert marked == set(PATH_SETTINGS)


@pytest.mark.parametrize("path", ["runs/demo", "/tmp/x", "builtin:student", "./gs:/odd-but-local", ""])
def test_paths_and_built_in_names_are_not_urls(path):
    from asyncopd_jax.config_checks import storage_url_error

    assert storage_url_error("output_dir", path) is None


def _old_names(data: dict) -> dict:
    """A config mapping as an earlier version saved it: the estimator's knobs flat."""
    estimator = data["estimator"]
    estimator["mc_clip_eps"] = estimator["mc"].pop("clip_eps")
    estimator["control_variate"] = estimator["forward_mc"].pop("control_variate")
    estimator["reference_kl_coef"] = estimator["regularisers"].pop("reference_kl_coef")
    data["schedule"]["rollout_workers"] = data["stages"].pop("rollouts")
    return data


def test_a_saved_config_with_moved_fields_is_migrated_once_with_its_values(tmp_path):
    import yaml

    from asyncopd_jax.config import migrate_saved_config, save_config, to_dict

    saved = load_config(DEMO_CONFIG, ["estimator.mc.clip_eps=0.3", "estimator.regularisers.reference_kl_coef=0.05"])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(_old_names(to_dict(saved)), sort_keys=False))
    with pytest.raises(ConfigError, match="estimator.mc_clip_eps is now estimator.mc.clip_eps"):
        load_config(path)  # as a hand-written config: refused, naming the new field
    moves = migrate_saved_config(path)
    assert set(moves) == {
        "estimator.mc_clip_eps → estimator.mc.clip_eps",
        "estimator.control_variate → estimator.forward_mc.control_variate",
        "estimator.reference_kl_coef → estimator.regularisers.reference_kl_coef",
        "schedule.rollout_workers → stages.rollouts",
    }
    assert load_config(path) == saved  # every value where it was
    assert migrate_saved_config(path) == []  # the file was rewritten: nothing left to move
    save_config(saved, tmp_path / "current.yaml")
    assert migrate_saved_config(tmp_path / "current.yaml") == []


def test_a_saved_config_with_a_field_under_both_names_is_refused(tmp_path):
    import yaml

    from asyncopd_jax.config import migrate_saved_config, to_dict

    data = to_dict(load_config(DEMO_CONFIG))
    data["estimator"]["mc_clip_eps"] = 0.3
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="holds both estimator.mc_clip_eps and estimator.mc.clip_eps"):
        migrate_saved_config(path)


def test_a_served_teacher_or_a_teacher_list_given_by_override_replaces_the_files_teacher():
    """The demo config's teacher.path is builtin:teacher: a URL or a list of teachers on the
    command line is enough (the README's commands), unless teacher.path is set with it."""
    served = load_config(DEMO_CONFIG, ["teacher.server.url=http://h:8000"])
    assert (served.teacher.path, served.teacher.server.url) == ("", "http://h:8000")
    listed = load_config(DEMO_CONFIG, ["teachers=[{name: a, path: builtin:teacher}, {name: b, path: builtin:teacher}]"])
    assert listed.teacher.path == "" and [t.name for t in listed.teachers] == ["a", "b"]
    assert load_config(DEMO_CONFIG, ["teacher.server.url=''"]).teacher.path == "builtin:teacher"  # no URL: kept
    with pytest.raises(
        ConfigError, match=r"^teacher.path = 'builtin:teacher' and teacher.server.url = 'http://h:8000' are"
    ):
        load_config(DEMO_CONFIG, ["teacher.server.url=http://h:8000", "teacher.path=builtin:teacher"])


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["estimator.name=forward_kl_dense"],
            "estimator.name = 'forward_kl_dense' needs the teacher's hidden states; "
            "set teacher.payload (or scoring.payload) = hidden",
        ),
        (
            ["teacher.payload=hidden", "teacher.path=''", "teacher.server.url=http://127.0.0.1:8000"],
            "teacher.payload = hidden is invalid with a vllm or sglang server (it answers log-probs only; serve the "
            "teacher with asyncopd serve-teacher, server.api = asyncopd); allowed: scores",
        ),
        (
            ["teacher.payload=hidden", "teacher.path=''", "teacher.server.url=http://x:1", "teacher.server.api=sglang"],
            "teacher.payload = hidden is invalid with a vllm or sglang server",
        ),
        (  # a head is read only for a served teacher with hidden states
            ["teacher.head_path=builtin:teacher"],
            "teacher.head_path = 'builtin:teacher' is invalid for teacher 'teacher': it is read only for a served "
            "teacher with payload = hidden; allowed: ''",
        ),
        (
            ["teacher.head_path=builtin:teacher", "teacher.path=''", "teacher.server.url=http://x:1"]
            + ["teacher.server.api=asyncopd"],
            "teacher.head_path = 'builtin:teacher' is invalid for teacher 'teacher'",
        ),
        (
            ["teacher.payload=hidden", "algorithm=rl", "estimator.name=ppo_clip", "rl.distill_coef=0.1"],
            "teacher.payload = hidden is invalid with algorithm = rl; allowed: scores",
        ),
        (  # every teacher must ship hidden states for the dense estimators: one of two does not
            [
                "estimator.name=reverse_kl_dense",
                "teacher.path=''",
                "teachers=[{name: a, path: 'builtin:teacher', payload: hidden}, {name: b, path: 'builtin:teacher'}]",
            ],
            "estimator.name = 'reverse_kl_dense' needs the teacher's hidden states; set teachers[].payload",
        ),
    ],
)
def test_a_hidden_state_payload_is_refused_where_the_run_cannot_carry_it(sets, message):
    with pytest.raises(ConfigError) as refused:
        load_config(DEMO_CONFIG, sets)
    assert str(refused.value).startswith(message), str(refused.value)


def test_a_hidden_state_payload_configures_the_dense_estimators():
    cfg = load_config(DEMO_CONFIG, ["teacher.payload=hidden", "estimator.name=reverse_kl_dense"])
    assert cfg.teacher.scoring(cfg.scoring).payload == "hidden" and cfg.scoring.payload == "scores"
    assert cfg.estimator.spec.needs_teacher_hidden
    two = "[{name: a, path: 'builtin:teacher'}, {name: b, path: 'builtin:teacher_moe'}]"
    cfg = load_config(DEMO_CONFIG, ["scoring.payload=hidden", "teacher.path=''", f"teachers={two}"])
    assert [t.scoring(cfg.scoring).payload for t in cfg.teachers] == ["hidden", "hidden"]
    served = ["teacher.path=''", "teacher.server.url=http://x:1", "teacher.server.api=asyncopd"]
    cfg = load_config(DEMO_CONFIG, ["teacher.payload=hidden", "teacher.head_path=builtin:teacher", *served])
    assert cfg.teacher.head_path == "builtin:teacher" and cfg.teacher.scoring(cfg.scoring).payload == "hidden"
