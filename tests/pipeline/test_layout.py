"""The placement: decided once into a typed layout; every stage on its own devices.

On the 8 virtual CPU devices of the test session (tests/conftest.py) the threads placement
puts the learner on devices 0-3 and rollout + scoring on 4-7 inside one process: each
stage's arrays live on its own devices, weights reach the sampler by a device-to-device
copy, and the run learns the same as with every stage on one device.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from asyncopd_jax import configs
from asyncopd_jax.config import ConfigError, load_config
from asyncopd_jax.pipeline import host_env
from asyncopd_jax.pipeline.exchange import Exchange
from asyncopd_jax.pipeline.layout import Layout, LayoutError, device_ids, local_device_ids, plan_layout
from asyncopd_jax.pipeline.scoring_stage import ScoringStage
from asyncopd_jax.pipeline.trainer import Trainer
from tests.pipeline.test_trainer import _config, models  # noqa: F401 - fixture


def _layout(models, tmp_path, **sets) -> Layout:  # noqa: F811
    cfg = _config(models, tmp_path, **sets)
    return plan_layout(cfg, run_path=tmp_path / "t", available_cores=range(8))


def test_threads_puts_every_stage_in_the_learner_process_on_its_own_devices(models, tmp_path):  # noqa: F811
    layout = _layout(
        models,
        tmp_path,
        **{
            "stages.rollouts": 2,
            "stages.learner_devices": "0-3",
            "stages.rollout_devices": "4-5",
            "stages.scoring_devices": "6,7",
        },
    )
    assert [(s.name, s.process, s.devices) for s in layout.stages] == [
        ("learner-0", "learner", (0, 1, 2, 3)),
        ("rollout-0", "learner", (4, 5)),
        ("rollout-1", "learner", (4, 5)),
        ("scoring-0", "learner", (6, 7)),
    ]
    assert layout.stage_processes() == () and layout.snapshots.in_memory and layout.group_size == 4


def test_processes_deal_devices_to_the_processes_and_rollouts_score_without_scoring_processes(models, tmp_path):  # noqa: F811
    layout = _layout(
        models,
        tmp_path,
        **{
            "stages.placement": "processes",
            "stages.rollouts": 2,
            "stages.rollout_devices": "2-5",
            "stages.learner_devices": "0,1",
        },
    )
    assert [(s.name, s.process, s.devices) for s in layout.stages] == [
        ("learner-0", "learner", (0, 1)),
        ("rollout-0", "rollout-0", (2, 3)),
        ("rollout-1", "rollout-1", (4, 5)),
        ("scoring-0", "rollout-0", (2, 3)),
        ("scoring-1", "rollout-1", (4, 5)),
    ]
    assert [s.name for s in layout.stage_processes()] == ["rollout-0", "rollout-1"]
    assert [s.name for s in layout.hosted_by("rollout-1")] == ["rollout-1", "scoring-1"]
    assert [s.name for s in layout.hosted_by("learner")] == ["learner-0"]
    # a stage process started by hand on another host runs what its role's first one runs, on its own devices
    assert [(s.name, s.process, s.devices) for s in layout.hosted_by("rollout-100")] == [
        ("rollout-0", "rollout-100", ()),
        ("scoring-0", "rollout-100", ()),
    ]
    with pytest.raises(KeyError, match="no stage runs in process 'teacher-3'"):
        layout.hosted_by("teacher-3")
    assert not layout.snapshots.in_memory and layout.snapshots.format == "safetensors"


def test_device_ids_resolve_an_empty_list_as_the_run_does(models, tmp_path):  # noqa: F811
    """What ``asyncopd plan`` compiles each stage on: a stage's own list; no list is the
    learner's devices beside the learner, and every device for the learner or, on a GPU or
    TPU, a process of its own (one device for a CPU stage process)."""
    split = {"stages.learner_devices": "0-3", "stages.scoring_devices": "6,7"}
    threads = _layout(models, tmp_path, **split, **{"learner.mesh": "{data: -1, fsdp: 1}"})
    ids = {s.name: device_ids(threads, s, 16, "tpu") for s in threads.stages}
    assert ids == {"learner-0": (0, 1, 2, 3), "rollout-0": (0, 1, 2, 3), "scoring-0": (6, 7)}
    # the learner's mesh takes the first of its devices when learner.mesh says fewer
    # (data: 1, fsdp: 1 here): so does a stage beside it that has none of its own
    one = _layout(models, tmp_path, **split)
    assert {s.name: device_ids(one, s, 16, "tpu") for s in one.stages} == {
        "learner-0": (0,),
        "rollout-0": (0,),
        "scoring-0": (6, 7),
    }
    processes = _layout(
        models, tmp_path, **{"stages.placement": "processes", "stages.rollouts": 2, "learner.mesh": "{data: -1}"}
    )
    everything = {name: (0, 1, 2, 3) for name in ("learner-0", "rollout-0", "rollout-1", "scoring-0", "scoring-1")}
    assert {s.name: device_ids(processes, s, 4, "gpu") for s in processes.stages} == everything
    one_each = {**{name: (0,) for name in everything}, "learner-0": (0, 1, 2, 3)}
    assert {s.name: device_ids(processes, s, 4, "cpu") for s in processes.stages} == one_each
    with pytest.raises(ValueError, match=r"stages.scoring_devices = 6,7 names device 7; there are 4 \(0-3\)"):
        device_ids(threads, threads.stage("scoring-0"), 4, "cpu")


def _seen_by(layout: Layout, stage, platform: str, host: list, monkeypatch) -> list:
    """The devices ``stage``'s process sees, as its start-up variables make them visible on
    a host whose devices are ``host``: the learner's process as ``asyncopd train`` prepares
    it, a stage process with the variables the learner starts it with."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
    for name in ("CUDA_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(host_env, "pin_this_process", lambda cores: None)
    host_env.prepare_learner_process(layout, platform)  # sets this test's environment (undone by monkeypatch)
    learner_env = {k: host_env.os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "TPU_VISIBLE_CHIPS")}
    visible = learner_env["CUDA_VISIBLE_DEVICES"] or learner_env["TPU_VISIBLE_CHIPS"]
    learner_sees = [host[int(i)] for i in visible.split(",")] if visible else host
    if stage.process == "learner":
        return learner_sees
    env = host_env.stage_process_env(layout, stage, platform, len(learner_sees))
    if platform == "cpu":  # a CPU process's devices are its own: as many as its XLA:CPU count
        count = int(env["XLA_FLAGS"].split("device_count=")[1].split()[0])
        assert "--xla_backend_optimization_level=0" in env["XLA_FLAGS"]  # the other flags are kept
        return [f"{stage.process}:cpu{i}" for i in range(count)]
    visible = env.get("CUDA_VISIBLE_DEVICES") or env.get("TPU_VISIBLE_CHIPS")
    return [host[int(i)] for i in visible.split(",")] if visible else host


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
@pytest.mark.parametrize("name", configs.names())
def test_plan_and_run_agree_on_every_stage_s_devices_in_every_shipped_config(name, platform, monkeypatch, tmp_path):
    """For every shipped config, in both placements: the devices ``asyncopd plan`` compiles
    each stage on (:func:`device_ids` over the host's) are the devices the run's stage
    computes on (:func:`local_device_ids` over what its process sees, given the variables
    it is started with). On a CPU a stage process's devices are its own: their count."""
    for placement in ("threads", "processes"):
        sets = [f"stages.placement={placement}", "schedule.mode=fully_async"]
        cfg = load_config(name, sets)
        layout = plan_layout(cfg, run_path=tmp_path / "t", available_cores=range(8))
        listed = [i for s in layout.stages for i in s.devices]
        host = [f"host:{i}" for i in range(max([7, *listed]) + 1)]
        for stage in layout.stages:
            planned = [host[i] for i in device_ids(layout, stage, len(host), platform)]
            seen = _seen_by(layout, stage, platform, host, monkeypatch)
            ran = [seen[i] for i in local_device_ids(layout, stage, len(seen), platform)]
            if platform == "cpu" and stage.process != "learner":
                assert len(ran) == len(planned), (name, placement, stage.name)
            else:
                assert ran == planned, (name, placement, stage.name)
            monkeypatch.undo()


def test_the_layout_round_trips_through_json_and_refuses_another_version(models, tmp_path):  # noqa: F811
    layout = _layout(
        models,
        tmp_path,
        **{"stages.placement": "processes", "stages.scoring_processes": 1, "stages.scoring_devices": "'3'"},
    )
    assert Layout.from_json(layout.to_json()) == layout
    data = json.loads(layout.to_json())
    with pytest.raises(LayoutError, match="layout version 0; this asyncopd reads version 3"):
        Layout.from_json(json.dumps({**data, "version": 0}), "x/layout.json")
    del data["group_size"]
    with pytest.raises(LayoutError, match="not a layout of this version"):
        Layout.from_json(json.dumps(data))


def test_the_exchange_writes_the_layout_atomically(models, tmp_path, monkeypatch):  # noqa: F811
    """A stage reading layout.json while it is rewritten sees the old file or the new one:
    a write that dies half-way leaves the old one whole."""
    cfg = _config(models, tmp_path, **{"stages.placement": "processes"})
    layout = plan_layout(cfg, run_path=tmp_path / "t", available_cores=[])
    exchange = Exchange(tmp_path / "exchange")
    exchange.write(cfg, layout)
    before = exchange.store.read("layout.json").data
    bigger = Layout(**{**layout.__dict__, "group_size": 2})
    real_open = Path.open

    class DiesHalfWay:  # the disk fills up after half of the file
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    from asyncopd_jax.storage import local

    monkeypatch.setattr(  # the local store's own open: each object is written to a temporary file first
        local,
        "open",
        lambda path, mode="r", *a, **k: (
            DiesHalfWay(real_open(Path(path), mode, *a, **k))
            if "w" in mode and Path(path).name.startswith(".layout.json")
            else real_open(Path(path), mode, *a, **k)
        ),
        raising=False,
    )
    with pytest.raises(OSError, match="No space"):
        exchange.write(cfg, bigger)
    monkeypatch.undo()
    assert exchange.store.read("layout.json").data == before
    assert exchange.read()[1] == layout
    assert not [p for p in (tmp_path / "exchange").iterdir() if p.name.endswith(".tmp")]  # no half-written leftover


@pytest.mark.parametrize(
    "platform,devices,expected",
    [
        ("gpu", (2, 3), {"CUDA_VISIBLE_DEVICES": "2,3"}),
        (
            "tpu",
            (4, 5, 6, 7),
            {
                "TPU_VISIBLE_CHIPS": "4,5,6,7",
                "TPU_PROCESS_BOUNDS": "1,1,1",
                "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1",
                "TPU_PROCESS_PORT": "8480",
                "TPU_PROCESS_ADDRESSES": "localhost:8480",
                "CLOUD_TPU_TASK_ID": "0",
                "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
            },
        ),
        ("cpu", (1, 3), {"XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=2"}),
        ("tpu", (), {}),
    ],
)
def test_a_stage_process_gets_its_devices_by_the_platform_mechanism(platform, devices, expected, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_force_host_platform_device_count=8")
    assert host_env.device_env(platform, devices, port=8480) == expected


def test_a_tpu_stage_process_holds_a_chip_count_libtpu_can_bound():
    with pytest.raises(ValueError, match="1, 2, 4 or 8 chips, not 3"):
        host_env.device_env("tpu", (0, 1, 2))


def test_each_stage_process_gets_its_own_tpu_port(models, tmp_path):  # noqa: F811
    layout = _layout(
        models,
        tmp_path,
        **{
            "stages.placement": "processes",
            "stages.rollouts": 2,
            "stages.scoring_processes": 2,
            "stages.rollout_devices": "0,1",
            "stages.scoring_devices": "2,3",
            "stages.learner_devices": "4-7",
        },
    )
    ports = [host_env.stage_process_env(layout, s, "tpu", 8)["TPU_PROCESS_PORT"] for s in layout.stage_processes()]
    assert len(set(ports)) == 4 and host_env.TPU_BASE_PORT not in map(int, ports)


@pytest.mark.parametrize(
    "sets,message",
    [
        ({"stages.rollout_devices": "4-x"}, r"stages.rollout_devices = '4-x' is invalid; allowed: '' or a device list"),
        (
            {"stages.learner_cores": "3-1"},
            r"stages.learner_cores = '3-1' is invalid; allowed: 'auto', '' or a CPU list",
        ),
        (
            {"stages.placement": "processes", "stages.learner_devices": "0,1", "stages.rollout_devices": "1,2"},
            r"stages.learner_devices = '0,1' is invalid; allowed: devices no rollout or scoring process holds",
        ),
    ],
)
def test_bad_device_and_core_lists_name_the_field(models, tmp_path, sets, message):  # noqa: F811
    with pytest.raises(ConfigError, match=message):
        _config(models, tmp_path, **sets)


def test_a_stage_on_devices_this_process_lacks_is_refused_naming_them(models, tmp_path):  # noqa: F811
    cfg = _config(models, tmp_path, **{"stages.learner_devices": "6-9", "learner.mesh": "{data: -1, fsdp: 1}"})
    with pytest.raises(
        ValueError,
        match=r"stages.learner_devices = 6,7,8,9 names device 9; there are 8 \(0-7\)",
    ):
        Trainer(cfg, progress=False)


# --- every stage on its own devices, one process -----------------------------------------------------

SPLIT = {
    "stages.learner_devices": "0-3",
    "stages.rollout_devices": "4-7",
    "stages.scoring_devices": "4-7",
    "learner.mesh": "{data: -1, fsdp: 1}",
}


def _ids(tree) -> set[int]:
    return {d.id for x in jax.tree_util.tree_leaves(tree) for d in x.devices()}


def _run_recording(models, tmp_path, monkeypatch, name, **sets):  # noqa: F811
    """Run 8 sync steps; return (trainer, losses, the devices of what each stage made)."""
    cfg = _config(
        models,
        tmp_path,
        **{"name": name, "schedule.mode": "sync", "train.steps": 8, "train.checkpoint_every": 100, **sets},
    )
    trainer = Trainer(cfg, progress=False)
    seen: dict[str, set[int]] = {"rollout": set(), "scores": set(), "weights_to_sampler": set()}
    real_score = ScoringStage.score

    def recording_score(scoring, group, *args):
        tokens = group.batch.response_tokens  # as the sampler made it: rows split over its devices
        seen["rollout"] |= _ids(tokens)
        seen["rollout_rows_per_device"] = {tokens.sharding.shard_shape(tokens.shape)[0]}
        scored = real_score(scoring, group, *args)
        seen["scores"] |= _ids(scored.cache)
        return scored

    monkeypatch.setattr(ScoringStage, "score", recording_score)
    real_start = trainer._start_stages

    def recording_start(buffer):
        stages = real_start(buffer)
        real_take = stages.take

        def take(version):
            groups = real_take(version)
            seen["weights_to_sampler"] |= _ids(trainer.snapshots.load()[1])
            return groups

        stages.take = take
        return stages

    trainer._start_stages = recording_start
    trainer.run()
    losses = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return trainer, losses, seen


@pytest.mark.e2e  # two whole runs: the end-to-end step (-m e2e)
def test_threads_run_each_stage_on_its_own_devices_and_learn_as_on_one(models, tmp_path, monkeypatch):  # noqa: F811
    split, split_losses, seen = _run_recording(models, tmp_path, monkeypatch, "split", **SPLIT)
    assert _ids(split.state.params) == _ids(split.state.opt_state) == {0, 1, 2, 3}
    assert seen == {
        "rollout": {4, 5, 6, 7},
        "scores": {4, 5, 6, 7},
        "weights_to_sampler": {4, 5, 6, 7},
        "rollout_rows_per_device": {2},
    }  # 8 rows over 4 devices: batch-parallel, not replicated
    assert _ids(split.scoring.teacher) == {4, 5, 6, 7}
    assert len(split_losses) == 8
    # Today's placement (every stage on device 0): the same rollouts (same keys, same
    # weights) and the same loss curve, up to the reduction order of 4 devices.
    _, one_losses, one_seen = _run_recording(models, tmp_path, monkeypatch, "one")
    assert one_seen["rollout"] == {0}
    np.testing.assert_allclose(split_losses, one_losses, rtol=2e-3)


@pytest.mark.e2e  # a whole run: the end-to-end step (-m e2e)
def test_scoring_runs_on_its_own_devices_apart_from_rollout(models, tmp_path, monkeypatch):  # noqa: F811
    trainer, _, seen = _run_recording(
        models,
        tmp_path,
        monkeypatch,
        "apart",
        **{**SPLIT, "train.steps": 2, "stages.rollout_devices": "4,5", "stages.scoring_devices": "6,7"},
    )
    assert seen["rollout"] == {4, 5} and seen["scores"] == {6, 7} and seen["weights_to_sampler"] == {4, 5}


def test_the_learner_loads_weights_and_creates_moments_in_their_shardings(models, tmp_path):  # noqa: F811
    """FSDP over devices 4-7: the student is read from disk straight into its shards and the
    optimizer state created there: no device-to-device copy (which a first copy on device 0
    would need), every leaf on 4-7, the large ones split."""
    from asyncopd_jax.pipeline.learner_stage import LearnerStage
    from asyncopd_jax.pipeline.run_models import run_models

    cfg = _config(models, tmp_path, **{"stages.learner_devices": "4-7", "learner.mesh": "{data: 1, fsdp: -1}"})
    layout = plan_layout(cfg, run_path=tmp_path / "t", available_cores=[])
    with jax.transfer_guard_device_to_device("disallow_explicit"):
        learner = LearnerStage(cfg, layout, run_models(cfg), multi_process=False)
    leaves = jax.tree_util.tree_leaves(learner.state)
    assert _ids(learner.state) == {4, 5, 6, 7}
    largest = max(leaves, key=lambda x: x.size)
    assert largest.sharding.shard_shape(largest.shape) != largest.shape  # split over fsdp, not replicated
