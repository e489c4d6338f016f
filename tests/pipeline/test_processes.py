"""Stage placement ``processes``: stages really in their own processes; the run learns with
the staleness bound kept; a stage process that dies stops the run within seconds with its
error (or is restarted), and nothing committed to the spool is lost across a resume."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from asyncopd_jax.config import StagesConfig, load_config, save_config
from asyncopd_jax.pipeline.layout import plan_layout
from asyncopd_jax.pipeline.placements.stage_processes import StageFailed
from asyncopd_jax.pipeline.staleness import PipelineStopped
from asyncopd_jax.pipeline.trainer import Trainer
from tests.pipeline.test_trainer import _config, _kl_start_end, models  # noqa: F401 - fixture
from tests.xla_flags import host_devices

pytestmark = pytest.mark.e2e  # every test here starts stage processes: the end-to-end step (-m e2e)


def _cores(
    stages: StagesConfig, available
) -> tuple[tuple[int, ...], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """(the learner's cores, [(stage process, cores, devices)]) of the processes placement."""
    cfg = dataclasses.replace(load_config(None), stages=dataclasses.replace(stages, placement="processes"))
    layout = plan_layout(cfg, run_path=Path("/tmp/run"), available_cores=available)
    return layout.learner.cores, [(s.name, s.cores, s.devices) for s in layout.stage_processes()]


def test_auto_split_gives_the_learner_its_share_and_the_rest_to_rollouts():
    learner, specs = _cores(StagesConfig(), range(4))
    assert learner == (0, 1) and [(name, cores) for name, cores, _ in specs] == [("rollout-0", (2, 3))]
    learner, specs = _cores(StagesConfig(rollouts=2, scoring_processes=2), range(16))
    assert learner == tuple(range(6))  # ⌈0.37 · 16⌉
    # Of the 10 left, ⌈0.55 · 10⌉ = 6 score and 4 sample, dealt evenly.
    assert [(name, cores) for name, cores, _ in specs] == [
        ("rollout-0", (6, 7)),
        ("rollout-1", (8, 9)),
        ("scoring-0", (10, 11, 12)),
        ("scoring-1", (13, 14, 15)),
    ]


def test_auto_leaves_processes_unpinned_when_a_process_would_get_fewer_than_two_cores():
    learner, specs = _cores(StagesConfig(), [0, 1, 2])  # 2 processes need 4 cores
    assert learner == () and [cores for _, cores, _ in specs] == [()]
    # 10 cores would be 2 per process on average, but the split leaves each rollout one.
    learner, specs = _cores(StagesConfig(rollouts=2, scoring_processes=2), range(10))
    assert learner == () and [cores for _, cores, _ in specs] == [()] * 4
    # Explicit lists are taken as given.
    learner, specs = _cores(StagesConfig(learner_cores="0", rollout_cores="1"), [0, 1])
    assert learner == (0,) and [cores for _, cores, _ in specs] == [(1,)]


def test_explicit_cores_and_devices_are_dealt_to_the_processes():
    stages = StagesConfig(
        rollouts=3,
        learner_cores="0-1",
        rollout_cores="2,3",
        scoring_processes=1,
        scoring_cores="",
        rollout_devices="1,2",
        learner_devices="0",
    )
    learner, specs = _cores(stages, range(4))
    assert learner == (0, 1)
    assert specs == [
        ("rollout-0", (2,), (1,)),
        ("rollout-1", (3,), (2,)),
        ("rollout-2", (2,), (1,)),
        ("scoring-0", (), ()),
    ]


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_stages_run_in_their_own_processes_and_the_run_learns(models, tmp_path):  # noqa: F811
    cfg = _config(
        models,
        tmp_path,
        **{
            "stages.placement": "processes",
            "schedule.mode": "fully_async",
            "schedule.max_staleness": 2,
            "stages.rollouts": 2,
            "stages.scoring_processes": 1,
            "train.steps": 12,
            "stages.rollout_niceness": 7,
        },
    )
    trainer = Trainer(cfg, progress=False)
    summary = trainer.run()
    run = tmp_path / "t"
    for name in ("rollout-0", "rollout-1", "scoring-0"):  # every stage process runs at the niceness asked for
        assert (
            f"{name}: pid {trainer.stages.pids[name]}, niceness {min(os.nice(0) + 7, 19)},"
            in (run / "exchange" / "logs" / f"{name}.log").read_text()
        )
    records = _records(run)
    assert [r["step"] for r in records] == list(range(1, 13))
    start, end = _kl_start_end(records)
    assert end < 0.85 * start, [round(r["loss"], 2) for r in records]
    assert all(r["staleness_max"] <= 2 for r in records)
    assert summary["steps"] == 12
    pids = trainer.stages.pids
    assert set(pids) == {"rollout-0", "rollout-1", "scoring-0"} and os.getpid() not in pids.values()
    trace = json.loads((run / "trace.json").read_text())["traceEvents"]
    process_names = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    spans = {(process_names[e["pid"]], e["name"]) for e in trace if e["ph"] == "X"}
    assert {("rollout-0", "rollout"), ("rollout-1", "rollout"), ("scoring-0", "score"), ("learner", "learn")} <= spans
    assert ("learner", "score") not in spans and ("rollout-0", "score") not in spans  # scoring had its own process
    # The final checkpoint covers every consumed record: only unconsumed ones may remain.
    # At most (η + 1) batches of 8 samples are ever in flight: 6 groups of 4.
    left = {p.name[: -len(".npz")] for p in (run / "exchange" / "scored").glob("*.npz")}
    assert len(left) <= 6
    # the learner's bookkeeping forgets deleted records: it stays bounded over a long run
    assert trainer.stages._seen <= left and len(trainer.stages._admitted) <= 6 + 3  # + tickets not yet sampled
    assert not trainer.snapshot_dir.exists()  # the RAM-backed snapshots are cleaned up


def _claims(exchange: Path, owner: str) -> set[str]:
    """Record files ``owner`` has claimed (a ticket to sample, a sampled group to score)."""
    from asyncopd_jax.pipeline.spool import Spool

    return {f"{c.name}.npz" for spool in ("tickets", "sampled") for c in Spool(exchange / spool).claims_of(owner)}


def _kill_when(
    trainer, role_name, committed: int, seen: set, killed: dict, while_holding: bool = False
) -> threading.Thread:
    """Kill ``role_name`` with SIGKILL once ``committed`` scored records exist (and, with
    ``while_holding``, while it holds a claimed record: ``killed["held"]``, listed after the
    kill, so exact); note every record name ever seen in the spool."""

    def watch():
        exchange = trainer.run_dir.path / "exchange"
        scored = exchange / "scored"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and "at" not in killed:
            if scored.is_dir():
                seen.update(p.name for p in scored.glob("*.npz"))
            stages = getattr(trainer, "stages", None)
            if stages is not None and len(seen) >= committed and (not while_holding or _claims(exchange, role_name)):
                os.kill(stages.pids[role_name], signal.SIGKILL)
                killed["at"] = time.monotonic()
                killed["held"] = _claims(exchange, role_name)
            time.sleep(0.005)
        while time.monotonic() < deadline and not killed.get("done"):  # keep listing until the run ends
            if scored.is_dir():
                seen.update(p.name for p in scored.glob("*.npz"))
            if time.monotonic() - killed.get("at", time.monotonic()) > 180 and not killed.get("watchdog"):
                killed["watchdog"] = True  # a run that would hang fails the test instead
                trainer.stages.buffer.fail(AssertionError("the run neither stopped nor went on after the kill"))
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


# A rollout process samples and scores its groups; with ``stages.scoring_processes`` the
# teacher runs in a process of its own, which claims sampled records from a spool: killed,
# it dies holding a claim that must be given back, not lost.
# CI time: each test runs one of the two roles in CI and the other with -m slow.
ROLLOUT = pytest.param("rollout-0", {}, id="rollout")
SCORING = pytest.param("scoring-0", {"stages.scoring_processes": 1}, id="scoring")


def _slow(param):
    return pytest.param(*param.values, marks=pytest.mark.slow, id=param.id)


def test_snapshots_as_objects_ship_sparse_deltas_that_every_stage_loads_by_digest(models, tmp_path):  # noqa: F811
    """``stages.snapshot_format: objects``, fp32 master weights published in bf16
    (``stages.snapshot_dtype``) at a small learning rate: the learner publishes a full
    version every 3 (half the fp32 bytes) and deltas between them (their bytes in
    metrics.jsonl, far below the full version's), and the rollout processes rebuild each
    version from them, every load checked by its digest (a mismatch would stop the run)."""
    cfg = _config(
        models,
        tmp_path,
        **{
            "stages.placement": "processes",
            "stages.snapshot_format": "objects",
            "stages.snapshot_full_every": 3,
            "stages.scoring_processes": 0,
            "stages.snapshot_dtype": "bfloat16",
            # the regime of real OPD / RL runs: at 1e-5 this tiny model's small weights cross
            # a bf16 rounding step in ~10 % of elements per step (deltas ~30 % of a version)
            "optim.learning_rate": 1e-6,
            "schedule.mode": "sync",
            "train.steps": 8,
        },
    )
    trainer = Trainer(cfg, progress=False)
    trainer.run()
    records = _records(tmp_path / "t")
    published = [
        (r["snapshot_version"], r["snapshot_full"], r["snapshot_bytes"]) for r in records if "snapshot_version" in r
    ]
    assert [v for v, _, _ in published] == list(range(len(published))) and len(published) >= 6, published
    assert [full for _, full, _ in published] == [int(v % 3 == 0) for v, _, _ in published]
    full_bytes = min(b for _, full, b in published if full)
    params = jax.tree_util.tree_leaves(trainer.learner.state.params)
    assert {x.dtype for x in params} == {jnp.dtype("float32")}  # the master copy
    assert full_bytes < 0.51 * sum(x.nbytes for x in params), (full_bytes, sum(x.nbytes for x in params))
    assert all(b < full_bytes / 4 for _, full, b in published if not full), published
    log = (tmp_path / "t" / "exchange" / "logs" / "rollout-0.log").read_text()
    assert "digest" not in log
    # the rollout side's loads: the newest version loaded for each batch and its seconds
    loads = [(r["snapshot_load_version"], r["snapshot_load_s"]) for r in records if "snapshot_load_s" in r]
    assert len(loads) == len(records) and all(s > 0 for _, s in loads), loads
    assert [v for v, _ in loads] == sorted(v for v, _ in loads) and loads[-1][0] >= 1


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_a_run_in_a_bucket_needs_no_shared_directory_and_resumes_on_another_host(models, tmp_path, request, kind):  # noqa: F811
    """``output_dir`` in a bucket (moto's S3 server, fake-gcs-server), the stages in
    processes: the exchange, the snapshots (objects), the metrics and the checkpoints all
    go through the bucket. Resumed after the host's staging copy is gone (another host), the
    run continues from the bucket's checkpoint with nothing repeated or lost."""
    from asyncopd_jax.storage import open_store
    from tests.storage.fixtures import pointed_at
    from tests.tracking.readers import mlflow_scalars, tensorboard_scalars

    server = request.getfixturevalue(f"{kind}_server")
    with pointed_at(kind, server.endpoint) as url:
        sets = {
            "output_dir": url,
            "stages.placement": "processes",
            "stages.scoring_processes": 0,
            "train.steps": 8,
            "train.checkpoint_every": 4,
            "logging.sinks": "[jsonl,tensorboard,mlflow]",  # their files travel with the run
        }
        trainer = Trainer(_config(models, tmp_path, **sets), progress=False)
        trainer.run()
        bucket = open_store(f"{url}/t")
        keys = set(bucket.list(""))
        assert {"config.yaml", "metrics.jsonl", "summary.json", "trace.json", "checkpoints/8.commit"} <= keys, keys
        assert any(k.startswith("snapshots/versions/") for k in keys) and any(k.startswith("exchange/") for k in keys)
        shutil.rmtree(trainer.run_dir.path)  # another host: nothing staged here
        resumed = Trainer(_config(models, tmp_path, **{**sets, "train.steps": 12}), resume=True, progress=False)
        assert resumed.start_step == 8
        assert isinstance(resumed.unlearned, list)  # the checkpoint says which started groups it had not learned
        resumed.run()
        records = [json.loads(line) for line in bucket.read("metrics.jsonl").data.decode().splitlines()]
        assert [r["step"] for r in records] == list(range(1, 13))
        assert "checkpoints/12.commit" in bucket.list("checkpoints/")
        # the sinks' records, as a third host reads them from the bucket: both incarnations, one run
        copy = tmp_path / "host-c"
        for key in bucket.list("tensorboard/") + ["mlflow.db", "tracking.json"]:
            (copy / key).parent.mkdir(parents=True, exist_ok=True)
            bucket.download(key, copy / key)
        mlflow_run = json.loads((copy / "tracking.json").read_text())["mlflow"]
        for sink, logged in [("tensorboard", tensorboard_scalars(copy)), ("mlflow", mlflow_scalars(copy, mlflow_run))]:
            assert {s: len(v) for s, v in logged["train/loss"].items()} == dict.fromkeys(range(1, 13), 1), sink


@pytest.mark.parametrize("role,stages", [ROLLOUT, _slow(SCORING)])
def test_a_killed_stage_process_stops_the_run_in_seconds_and_resume_loses_nothing(models, tmp_path, role, stages):  # noqa: F811
    cfg = _config(
        models,
        tmp_path,
        **{
            "stages.placement": "processes",
            "schedule.mode": "fully_async",
            "schedule.max_staleness": 2,
            "train.steps": 16,
            "train.checkpoint_every": 5,
            **stages,
        },
    )
    trainer = Trainer(cfg, progress=False)
    seen: set = set()
    killed: dict = {}
    # One group per batch: at most 7 records ever exist, so the learner reaches step 5 (a
    # checkpoint) but never step 10; the records of steps 6 and 7 are committed but not
    # covered by a checkpoint when the run stops.
    watcher = _kill_when(trainer, role, committed=7, seen=seen, killed=killed)
    with pytest.raises(PipelineStopped) as info:
        trainer.run()
    stopped_at = time.monotonic()
    killed["done"] = True
    watcher.join(10)
    assert "at" in killed, f"{role} was never killed"
    assert stopped_at - killed["at"] < 15, f"the run took {stopped_at - killed['at']:.1f} s to stop"
    cause = info.value.__cause__
    assert isinstance(cause, StageFailed) and role in str(cause) and "SIGKILL" in str(cause)
    for pid in trainer.stages.pids.values():  # every stage process is gone (and reaped)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    run = tmp_path / "t"
    last_checkpoint = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    on_disk = {p.name for p in (run / "exchange" / "scored").glob("*.npz")}
    deleted = seen - on_disk
    # Only records consumed before the last checkpoint were deleted (the oldest ones); every
    # later record committed before the kill is still there.
    assert on_disk and max(deleted, default="") < min(on_disk), (sorted(seen), sorted(on_disk))

    resumed = Trainer(cfg, resume=True, progress=False)
    assert resumed.start_step == last_checkpoint
    resumed.run()
    records = _records(run)
    assert [r["step"] for r in records] == list(range(1, 17))  # every step exactly once
    left = {p.name for p in (run / "exchange" / "scored").glob("*.npz")}
    assert not (on_disk & left), "records committed before the crash were not consumed after the resume"


@pytest.mark.parametrize("role,stages", [_slow(ROLLOUT), SCORING])
def test_a_killed_stage_process_is_restarted_when_configured(models, tmp_path, role, stages):  # noqa: F811
    cfg = _config(
        models,
        tmp_path,
        **{
            "stages.placement": "processes",
            "schedule.mode": "fully_async",
            "stages.restarts": 1,
            "train.steps": 10,
            "train.checkpoint_every": 100,
            **stages,
        },
    )
    trainer = Trainer(cfg, progress=False)
    seen: set = set()
    killed: dict = {}
    watcher = _kill_when(trainer, role, committed=3, seen=seen, killed=killed, while_holding=True)
    trainer.run()
    killed["done"] = True
    watcher.join(10)
    assert "at" in killed and killed["held"], "the stage was not killed while holding a record"
    assert [r["step"] for r in _records(tmp_path / "t")] == list(range(1, 11))
    assert trainer.stages.restarts_left == 0
    # what the killed process held was given back and finished by its successor (scored
    # records are deleted only after a checkpoint, and there is none before the end)
    assert killed["held"] <= seen | {p.name for p in (tmp_path / "t" / "exchange" / "scored").glob("*.npz")}


def _children(pid: int) -> set[int]:
    """The child processes of ``pid`` (Linux: /proc/<pid>/task/<tid>/children)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found.update(int(c) for c in (task / "children").read_text().split())
    return found


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists child processes through /proc")
def test_ctrl_c_checkpoints_and_stops_every_process(models, tmp_path):  # noqa: F811
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it: the learner saves a
    checkpoint of the step it reached, stops its stage processes and exits with 130, and no
    stage process is left behind."""
    cfg = _config(
        models,
        tmp_path,
        **{
            "stages.placement": "processes",
            "schedule.mode": "fully_async",
            "schedule.max_staleness": 2,
            "stages.scoring_processes": 1,
            "train.steps": 10_000,
            "train.checkpoint_every": 10_000,
        },
    )
    config_file = tmp_path / "config.yaml"
    save_config(cfg, config_file)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncopd_jax.cli", "train", "--no-progress", "--config", str(config_file)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # its own process group, like a job in a terminal
    metrics = tmp_path / "t" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 120  # healthy: ~10 s; under the per-test limit (pyproject.toml)
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        stages = _children(proc.pid)
        assert proc.poll() is None and len(stages) >= 2, proc.stdout.read().decode(errors="replace")[-3000:]
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        try:
            output = proc.communicate(timeout=120)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:  # stuck: fail with every thread's stack (cli.py registers SIGUSR1)
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(3)
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(
                "not stopped 120 s after Ctrl-C; its threads:\n"
                + proc.communicate()[0].decode(errors="replace")[-8000:]
            )
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "interrupted; resume with --resume" in output, output[-3000:]
    assert took < 30, f"stopping took {took:.1f} s"
    for pid in stages:  # gone, not orphaned
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    checkpoints = [int(p.name) for p in (tmp_path / "t" / "checkpoints").iterdir() if p.name.isdigit()]
    assert checkpoints == [steps[-1]], (checkpoints, steps)  # the step reached, saved on Ctrl-C


@pytest.mark.slow  # ~1 min; tests/pipeline/test_snapshots.py checks the error itself in CI
def test_a_snapshot_directory_removed_mid_run_stops_it_with_that_reason(models, tmp_path):  # noqa: F811
    """A cleaner of /dev/shm removes the snapshots under a running learner and its stage
    processes: the run stops within seconds with an error naming the directory, and every
    stage process is gone."""
    import shutil

    cfg = _config(
        models,
        tmp_path,
        **{
            "stages.placement": "processes",
            "schedule.mode": "fully_async",
            "train.steps": 200,
            "train.checkpoint_every": 4,
        },
    )
    trainer = Trainer(cfg, progress=False)
    removed: dict = {}

    def remove_after_three_steps():
        metrics = tmp_path / "t" / "metrics.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.01)
        shutil.rmtree(trainer.snapshot_dir)
        removed["at"] = time.monotonic()

    threading.Thread(target=remove_after_three_steps, daemon=True).start()
    with pytest.raises((FileNotFoundError, PipelineStopped)) as info:
        trainer.run()
    took = time.monotonic() - removed["at"]
    text = f"{info.value} {info.value.__cause__}"
    assert f"the snapshot directory {trainer.snapshot_dir} was removed" in text, text
    assert took < 30, f"the run took {took:.1f} s to stop"
    for pid in trainer.stages.pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_stage_processes_started_by_hand_elsewhere_serve_a_learner_that_starts_none(models, tmp_path):  # noqa: F811
    """``stages.start_processes: false`` (a learner holding every chip of its host): the
    learner starts no stage process; one started by hand as launch/stage_host.sh starts it
    (``asyncopd stage rollout --index 100``, a name the layout does not list) hosts what
    rollout-0 would on every device its process sees (2 XLA:CPU devices), samples and
    scores every group, and stops with the run."""
    cfg = _config(
        models,
        tmp_path,
        **{
            "stages.placement": "processes",
            "stages.start_processes": False,
            "stages.rollouts": 1,
            "stages.scoring_processes": 0,
            "train.steps": 4,
        },
    )
    trainer = Trainer(cfg, progress=False)
    exchange = tmp_path / "t" / "exchange"
    done: dict = {}

    def learn():
        try:
            done["summary"] = trainer.run()
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            done["error"] = err

    learner = threading.Thread(target=learn, daemon=True)
    learner.start()
    deadline = time.monotonic() + 60
    while learner.is_alive() and not (exchange / "layout.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = open(tmp_path / "rollout-100.log", "wb")  # noqa: SIM115 - closed below
    stage = subprocess.Popen(
        [sys.executable, "-m", "asyncopd_jax.cli", "stage", "rollout", "--exchange", str(exchange), "--index", "100"],
        stdout=log,
        stderr=subprocess.STDOUT,
        # its launcher gives it 2 XLA:CPU devices: with no device list it computes on both
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": host_devices(2)},
    )
    try:
        # The learner started no stage process, so it has none to watch: were the one started
        # here to die, it would wait for groups forever. Watch it here, and stop the learner
        # at once when it exits before the run stopped (healthy, the run takes ~25 s).
        deadline = time.monotonic() + 120
        while learner.is_alive() and stage.poll() is None and time.monotonic() < deadline:
            learner.join(timeout=0.1)
        if learner.is_alive() and not (exchange / "STOP").exists() and getattr(trainer, "stages", None) is not None:
            trainer.stages.buffer.fail(AssertionError(f"rollout-100 exited with {stage.poll()} before the run ended"))
        learner.join(timeout=60)
        assert done.get("summary", {}).get("steps") == 4, (
            f"{done.get('error')!r}; rollout-100 exited with {stage.poll()}; its log:\n"
            + (tmp_path / "rollout-100.log").read_text()[-3000:]
        )
        assert stage.wait(timeout=60) == 0  # it stops with the run
    finally:
        if stage.poll() is None:
            stage.kill()
        log.close()
    assert trainer.stages.pids == {}  # the learner started none
    assert f"rollout-100: pid {stage.pid}," in (tmp_path / "rollout-100.log").read_text()
    assert "devices [0, 1]" in (tmp_path / "rollout-100.log").read_text()  # both devices of its process
    assert [r["step"] for r in _records(tmp_path / "t")] == [1, 2, 3, 4]


def test_a_stage_host_shares_nothing_with_the_learner_but_the_bucket(models, tmp_path, s3_server, monkeypatch):  # noqa: F811
    """launch/stage_host.sh on a stand-in host (its own working directory and model cache,
    nothing of the learner's but the bucket URL), started before the learner: the student
    and the teacher are read from the bucket by both hosts, each into its own cache; the
    stage process waits for the exchange to appear in the bucket, samples and scores every
    group of a learner that starts none, and the script returns 0 when the run stops."""
    from asyncopd_jax.storage import open_store
    from asyncopd_jax.tasks.assets import resolve_model_path
    from tests.storage.fixtures import pointed_at

    with pointed_at("s3", s3_server.endpoint) as url:
        bucket = open_store(url)
        for name, directory in (("student", models / "student"), ("teacher", resolve_model_path("builtin:teacher"))):
            for file in directory.rglob("*"):
                if file.is_file():
                    bucket.write(f"models/{name}/{file.relative_to(directory)}", file.read_bytes())
        monkeypatch.setenv("ASYNCOPD_CACHE", str(tmp_path / "learner-cache"))
        host = tmp_path / "stage-host"
        host.mkdir()
        env = {
            **os.environ,
            "ASYNCOPD_CACHE": str(host / "cache"),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "DEVICE_KIND": "cpu",
            "ROLLOUT_DEVICES": "0-1",
            "EXCHANGE_TIMEOUT": "120",
            "STAGE_RESTARTS": "0",  # it must wait for the exchange, not be rescued by a restart
            "JAX_PLATFORMS": "cpu",
        }
        script = Path(__file__).resolve().parents[2] / "launch" / "stage_host.sh"
        stage_host = subprocess.Popen(
            ["bash", str(script), f"{url}/t/exchange"],
            cwd=host,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            time.sleep(10)  # the stage process is up well before the learner writes the exchange
            sets = {
                "output_dir": url,
                "stages.placement": "processes",
                "stages.start_processes": False,
                "stages.scoring_processes": 0,
                "train.steps": 4,
                "student.path": f"{url}/models/student",
                "teacher.path": f"{url}/models/teacher",
            }
            summary = Trainer(_config(models, tmp_path, **sets), progress=False).run()
            assert summary["steps"] == 4
            out, _ = stage_host.communicate(timeout=120)
            logs = "".join(p.read_text() for p in (host / "stage-logs").glob("*.log"))
            assert stage_host.returncode == 0, out.decode()[-2000:] + logs[-3000:]
            assert "rollout-100: pid" in logs  # the stage process ran on the stand-in host
            for cache in (tmp_path / "learner-cache", host / "cache"):  # each host read both models from the bucket
                assert {p.name.rsplit("-", 1)[0] for p in cache.iterdir()} == {"student", "teacher"}, cache
        finally:
            if stage_host.poll() is None:
                stage_host.kill()


def test_a_resumed_runs_tickets_ask_for_weights_within_eta_of_its_version(models, tmp_path):  # noqa: F811
    """Resumed at step 4 (version 4), η = 1, its stage processes started by hand (none
    here): the tickets it issues before a group arrives ask for weights of version 3 or
    newer, as a run that never stopped would at step 4; counted from 0 instead, a rollout
    process would keep sampling version-0 weights, every group dropped as stale."""
    from asyncopd_jax.pipeline.spool import read_record

    sets = {"schedule.mode": "fully_async", "schedule.max_staleness": 1, "train.checkpoint_every": 4}
    Trainer(_config(models, tmp_path, **sets, **{"train.steps": 4}), progress=False).run()
    hand_started = {"stages.placement": "processes", "stages.start_processes": False, "stages.startup_timeout": 3}
    cfg = _config(models, tmp_path, **sets, **hand_started, **{"train.steps": 8})
    resumed = Trainer(cfg, resume=True, progress=False)
    assert resumed.start_step == 4 and resumed.learner.version == 4
    with pytest.raises(PipelineStopped):  # no group within stages.startup_timeout
        resumed.run()
    tickets = sorted((tmp_path / "t" / "exchange" / "tickets").glob("*.npz"))
    assert tickets, "no ticket was issued"
    assert {int(read_record(path)["min_version"]) for path in tickets} == {3}
    assert [int(read_record(path)["index"]) for path in tickets] == [int(path.stem) for path in tickets]
