"""End to end on tiny models: every schedule learns; stop + resume loses and repeats nothing;
a crashing worker stops the run with its error."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax.config import load_config
from asyncopd_jax.models import save_pretrained
from asyncopd_jax.pipeline.staleness import PipelineStopped
from asyncopd_jax.pipeline.trainer import Trainer
from asyncopd_jax.tasks.builtin import new_model
from asyncopd_jax.tasks.tokenizer import save_tokenizer
from tests.waits import SHORT_WAITS


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The shipped teacher, and a freshly initialised student saved in HF layout."""
    root = tmp_path_factory.mktemp("models")
    save_pretrained(new_model("student", 2), root / "student")
    save_tokenizer(root / "student")
    return root


def _config(models, tmp_path, **sets):
    overrides = {
        "name": "t",
        "output_dir": str(tmp_path),
        "student.path": str(models / "student"),
        "teacher.path": "builtin:teacher",
        "task.eval_prompts": 16,
        "sampling.max_new_tokens": 12,
        "sampling.num_candidates": 4,
        "sampling.chunk_steps": 4,
        "learner.batch_size": 8,
        "learner.mesh": "{data: 1, fsdp: 1}",
        "optim.learning_rate": 0.01,
        "estimator.name": "forward_kl_topk",
        "scoring.topk": 8,
        "optim.warmup_steps": 0,
        "optim.schedule": "constant",
        "train.steps": 12,
        "train.eval_every": 100,
        "train.checkpoint_every": 4,
        **SHORT_WAITS,  # a hang fails within a minute (tests/waits.py)
        **sets,
    }
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


def _kl_start_end(records, k=4):
    """Forward KL(teacher ‖ student) (the loss of forward_kl_topk) at the first step (on the
    initial student's rollouts, the same in every schedule) and its mean over the last k."""
    kl = [r["loss"] for r in records]
    return kl[0], np.mean(kl[-k:])


@pytest.mark.e2e  # a whole run per schedule: the end-to-end step (-m e2e)
@pytest.mark.parametrize(
    "mode,extra",
    [
        ("sync", {}),
        # the samplers on bf16 weights published from the fp32 master copy
        ("n_step_off", {"schedule.n_step": 1, "stages.snapshot_dtype": "bfloat16"}),
        ("fully_async", {"schedule.max_staleness": 2, "stages.rollouts": 2}),
        # the exact forward KL from the teacher's hidden states (bf16 on the way) and its head
        (
            "fully_async",
            {"teacher.payload": "hidden", "scoring.hidden_dtype": "bfloat16", "estimator.name": "forward_kl_dense"},
        ),
        # the same through the spool between stage processes, the scores in bf16 too
        (
            "fully_async",
            {
                "teacher.payload": "hidden",
                "scoring.hidden_dtype": "bfloat16",
                "scoring.store_dtype": "bfloat16",
                "estimator.name": "forward_kl_dense",
                "stages.placement": "processes",
            },
        ),
    ],
)
def test_every_schedule_reduces_the_kl_to_the_teacher(models, tmp_path, mode, extra):
    cfg = _config(models, tmp_path, **{"schedule.mode": mode, **extra})
    trainer = Trainer(cfg, progress=False)
    summary = trainer.run()
    if not trainer.layout.snapshots.temporary:  # stage processes' /dev/shm snapshots are gone after the run
        published = {x.dtype for x in jax.tree_util.tree_leaves(trainer.snapshots.load()[1])}
        assert published == {jnp.dtype(extra.get("stages.snapshot_dtype", "float32"))}, published
    assert {x.dtype for x in jax.tree_util.tree_leaves(trainer.learner.state.params)} == {jnp.dtype("float32")}
    run = tmp_path / "t"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    start, end = _kl_start_end(records)
    assert end < 0.85 * start, (mode, [round(r["loss"], 2) for r in records])
    eta = cfg.eta
    assert all(r["staleness_max"] <= eta for r in records)
    if mode == "sync":
        assert all(r["staleness_max"] == 0 for r in records)
    for name in ("config.yaml", "trace.json", "report.png", "summary.json"):
        assert (run / name).is_file(), name
    trace = json.loads((run / "trace.json").read_text())["traceEvents"]
    assert {"rollout", "score", "learn", "publish"} <= {e["name"] for e in trace}
    assert summary["steps"] == 12 and 0.0 <= summary["student_after"] <= 1.0


@pytest.mark.e2e  # a whole run: the end-to-end step (-m e2e)
def test_two_hidden_state_teachers_each_teach_the_prompts_routed_to_them(models, tmp_path):
    """Two teachers of different architectures (dense and mixture-of-experts) ship hidden
    states; each row's exact KL is taken with its own teacher's head."""
    teachers = (
        "[{name: dense, path: 'builtin:teacher', payload: hidden},"
        " {name: moe, path: 'builtin:teacher_moe', payload: hidden, temperature: 0.9}]"
    )
    sets = {"teacher.path": "''", "teachers": teachers, "estimator.name": "forward_kl_dense", "schedule.mode": "sync"}
    cfg = _config(models, tmp_path, **sets)
    Trainer(cfg, progress=False).run()
    records = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    rows = {name: sum(r[f"teacher/{name}/rows"] for r in records) for name in ("dense", "moe")}
    assert min(rows.values()) > 0 and sum(rows.values()) == 12 * cfg.learner.batch_size, rows
    start, end = _kl_start_end(records)
    assert end < 0.85 * start, [round(r["loss"], 2) for r in records]


@pytest.mark.e2e  # a whole run, crashed and resumed: the end-to-end step (-m e2e)
def test_resume_after_a_crash_continues_without_loss_or_repetition(models, tmp_path, monkeypatch):
    cfg = _config(models, tmp_path, **{"schedule.mode": "fully_async", "train.steps": 10})
    trainer = Trainer(cfg, progress=False)
    real_step = trainer.learner.train_step
    calls = {"n": 0}

    def crashing_step(state, batch):
        calls["n"] += 1
        if calls["n"] == 7:  # steps 1-6 done, last checkpoint at step 4
            raise RuntimeError("simulated crash")
        return real_step(state, batch)

    trainer.learner.train_step = crashing_step
    saved = {}  # what each checkpoint held, as the trainer handed it over
    real_save = trainer.run_dir.save_checkpoint

    def recording_save(step, state, meta):
        saved[step] = (jax.device_get(state), dict(meta))
        real_save(step, state, meta)

    trainer.run_dir.save_checkpoint = recording_save
    with pytest.raises(RuntimeError, match="simulated crash"):
        trainer.run()
    run = tmp_path / "t"
    before = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert before == [1, 2, 3, 4, 5, 6]
    assert sorted(saved) == [4]

    resumed = Trainer(cfg, resume=True, progress=False)
    assert resumed.start_step == 4
    # Parameters, optimizer moments, step and the data / RNG position are those saved, exactly.
    state, meta = saved[4]
    restored = jax.device_get(resumed.state)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
    for want, got in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored)):
        np.testing.assert_array_equal(got, want)
    assert int(restored.step) == 4
    moments = [x for x in jax.tree_util.tree_leaves(state.opt_state) if np.ndim(x) == 2]
    assert moments and all(np.abs(m).max() > 0 for m in moments)  # Adam's moments after 4 steps
    fresh = jax.device_get(Trainer(_config(models, tmp_path, name="fresh"), progress=False).state)
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree_util.tree_leaves(fresh.params), jax.tree_util.tree_leaves(restored.params))
    )
    assert meta["worker_index"] >= 4  # one rollout group per batch: at least 4 started before step 4
    assert resumed.worker_index == meta["worker_index"]
    summary = resumed.run()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11))  # 5 and 6 redone once, nothing lost
    assert summary["steps"] == 10
    with pytest.raises(FileExistsError, match="already holds a run with checkpoints; continue it with --resume"):
        Trainer(cfg, progress=False)  # a fresh run must not overwrite it


def test_a_crashing_worker_stops_the_run_cleanly(models, tmp_path):
    cfg = _config(models, tmp_path, **{"schedule.mode": "fully_async", "stages.rollouts": 2})
    trainer = Trainer(cfg, progress=False)

    def broken_prompts(rng, n):
        raise ValueError("prompt source exploded")

    for rollout in trainer.process.rollouts:
        rollout.producer.prompts = broken_prompts
    with pytest.raises(PipelineStopped, match="prompt source exploded"):
        trainer.run()


def _params_after_one_step(models, tmp_path, name, probe=None):
    """Train one deterministic (fixed_lag) step; with ``probe``, EffOPD extrapolation is on
    and ``probe`` replaces its score. Returns (the trainer after the run, its first record)."""
    cfg = _config(
        models,
        tmp_path,
        **{
            "name": name,
            "schedule.mode": "fixed_lag",
            "train.steps": 1,
            "learner.extrapolation.enabled": probe is not None,
            "learner.extrapolation.probe_prompts": 4,
        },
    )
    trainer = Trainer(cfg, progress=False)
    if probe is not None:
        trainer.probes.extrapolation_probe = probe
    trainer.run()
    return trainer, json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])


def _leaves(tree):
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.slow  # CI time: the real-probe extrapolation test below runs in CI
def test_extrapolation_in_the_learner_accepts_what_helps_and_rolls_back_exactly_what_does_not(models, tmp_path):
    """After step 1 (an extrapolation point) with D = θ₁ − θ₀: a probe that rewards moving
    further keeps θ₀ + 11·D on attention/MLP weights (all five factors tried, each better)
    and θ₁ elsewhere; a probe that never improves keeps θ₁ bit for bit. The optimizer state
    is the plain run's either way."""
    plain, _ = _params_after_one_step(models, tmp_path, "plain")
    theta0 = _leaves(Trainer(_config(models, tmp_path, name="init"), progress=False).state.params)
    theta1 = _leaves(plain.state.params)
    moved = {
        k
        for k in theta0
        if any(p in k for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    }
    assert moved and moved != set(theta0)

    def distance_from_start(params):  # strictly larger for every factor: must accept them all
        return float(sum(np.sum((v - theta0[k]) ** 2) for k, v in _leaves(params).items()))

    further, record = _params_after_one_step(models, tmp_path, "further", distance_from_start)
    assert record["extrapolation_factor"] == 11 and [f for f, _ in record["extrapolation_tried"]] == [3, 5, 7, 9, 11]
    for k, v in _leaves(further.state.params).items():
        want = theta0[k] + 11 * (theta1[k] - theta0[k]) if k in moved else theta1[k]
        np.testing.assert_allclose(v, want, rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(
        jax.tree_util.tree_leaves(further.state.opt_state), jax.tree_util.tree_leaves(plain.state.opt_state)
    ):
        np.testing.assert_array_equal(a, b)

    rejected, record = _params_after_one_step(models, tmp_path, "rejected", lambda params: 0.5)
    assert record["extrapolation_factor"] == 1 and len(record["extrapolation_tried"]) == 1
    for k, v in _leaves(rejected.state.params).items():
        np.testing.assert_array_equal(v, theta1[k], err_msg=k)


@pytest.mark.e2e  # a whole run: the end-to-end step (-m e2e)
def test_extrapolation_with_the_real_probe_logs_every_jump_and_the_update_geometry(models, tmp_path):
    cfg = _config(
        models,
        tmp_path,
        **{
            "schedule.mode": "sync",
            "train.steps": 5,
            "learner.extrapolation.enabled": True,
            "learner.extrapolation.probe_prompts": 8,
            "learner.extrapolation.factors": "[3, 5]",
            "train.update_geometry_every": 2,
        },
    )
    Trainer(cfg, progress=False).run()
    records = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    jumps = {r["step"]: r for r in records if "extrapolation_factor" in r}
    assert sorted(jumps) == [1, 2, 4]  # steps 1, 2, 4, 8, … only
    for r in jumps.values():
        assert r["extrapolation_factor"] in (1, 3, 5) and 0 <= r["extrapolation_base_score"] <= 1
        assert r["extrapolation_seconds"] > 0 and 1 <= len(r["extrapolation_tried"]) <= 2
    assert (tmp_path / "t" / "report.png").is_file()
    # the update geometry every 2 steps: the 14 attention/MLP matrices of the 2-layer student,
    # against θ_0 (no alignment yet at the first measurement: nothing moved before it)
    geometry = {r["step"]: r["update_geometry"] for r in records if "update_geometry" in r}
    assert sorted(geometry) == [2, 4] and len(geometry[2]) == 14
    for module, (norm, rank1, align) in geometry[4].items():
        assert norm > 0 and 0 < rank1 <= 1 and -1 <= align <= 1, module
        assert geometry[2][module][2] is None


def test_prompts_must_fit_the_teachers_context_too(models, tmp_path):  # noqa: F811
    """The teacher scores the whole of prompt + answer: a teacher with a shorter context than
    the student's is refused before anything runs, naming its context."""
    import shutil

    teacher = tmp_path / "short-teacher"
    shutil.copytree(models / "student", teacher)
    config = json.loads((teacher / "config.json").read_text())
    config["max_position_embeddings"] = 16  # the default task's prompts (11) + 12 new tokens do not fit
    (teacher / "config.json").write_text(json.dumps(config))
    cfg = _config(models, tmp_path, **{"teacher.path": str(teacher)})
    with pytest.raises(ValueError, match=r"is longer than the models' context \(16 positions, the smaller "):
        Trainer(cfg, progress=False)
