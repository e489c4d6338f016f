"""SIGKILL the learner at a random moment, then ``asyncopd train --resume``: nothing lost,
nothing repeated, nothing corrupt — proven by really killing a run started from the CLI.

The kill lands at a random step after the first checkpoint plus a random delay, so over
many CI runs it hits every phase of a step (learning, publishing a snapshot, appending
metrics, saving a checkpoint). The seed of the moment is in every failure message.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from asyncopd_jax.config import save_config
from asyncopd_jax.pipeline.run_outputs import RunDir
from asyncopd_jax.pipeline.trainer import Trainer
from tests.pipeline.test_processes import _children
from tests.pipeline.test_trainer import _config, models  # noqa: F401

pytestmark = pytest.mark.e2e  # a scenario: the end-to-end step (-m e2e)

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.Popen:
    """``asyncopd train ARGS`` in its own process group, output to a pipe."""
    return subprocess.Popen(
        [sys.executable, "-m", "asyncopd_jax.cli", "train", "--no-progress", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in RunDir(run).read_metrics()]


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" not in status.read_text().lower()
    except OSError:
        return False


def _kill_at_random(cfg, tmp_path, seed: int) -> tuple[Path, int, set[int]]:
    """Start ``cfg`` from the CLI, SIGKILL its learner at a random moment after the first
    checkpoint; returns (run directory, the last step on disk, the stage processes it had)."""
    rng = random.Random(seed)
    target = rng.randint(cfg.train.checkpoint_every + 1, cfg.train.steps - 2)
    config_file = tmp_path / "config.yaml"
    save_config(cfg, config_file)
    run = Path(cfg.output_dir) / cfg.name
    proc = _cli("--config", str(config_file))
    stages: set[int] = set()
    try:
        deadline = time.monotonic() + 120  # under the per-test limit (pyproject.toml)
        while time.monotonic() < deadline and proc.poll() is None:
            stages |= _children(proc.pid)
            if (run / "metrics.jsonl").is_file() and len(_steps(run)) >= target:
                break
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.5))  # anywhere inside the next step
        assert proc.poll() is None, (
            f"seed {seed}: the run ended before the kill:\n" + proc.stdout.read().decode(errors="replace")[-3000:]
        )
        os.kill(proc.pid, signal.SIGKILL)  # the learner only: its stage processes must notice
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return run, max(_steps(run)), stages


def _resume(run: Path, seed: int) -> str:
    proc = _cli("--resume", str(run))
    try:
        output = proc.communicate(timeout=180)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:  # stuck: end it and its stage processes, then fail
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"seed {seed}: the resume failed:\n{output[-3000:]}"
    return output


def test_sigkill_of_the_learner_then_resume_is_the_uninterrupted_run(models, tmp_path):  # noqa: F811
    """A deterministic schedule (sync): the killed-and-resumed run's every step has the
    loss of an uninterrupted run's, and it ends on the same student."""
    seed = int.from_bytes(os.urandom(4), "little")
    sets = {"schedule.mode": "sync", "train.steps": 12, "train.checkpoint_every": 3}
    reference = Trainer(_config(models, tmp_path, name="reference", **sets), progress=False)
    want = reference.run()
    cfg = _config(models, tmp_path, name="killed", **sets)
    run, reached, _ = _kill_at_random(cfg, tmp_path, seed)
    checkpoints = RunDir(run).latest_checkpoint()
    assert checkpoints is not None and checkpoints <= reached, (seed, checkpoints, reached)
    _resume(run, seed)
    records = RunDir(run).read_metrics()
    assert [r["step"] for r in records] == list(range(1, 13)), f"seed {seed}"  # every step exactly once
    ref = RunDir(tmp_path / "reference").read_metrics()
    np.testing.assert_allclose(
        [r["loss"] for r in records],
        [r["loss"] for r in ref],
        rtol=1e-5,
        err_msg=f"seed {seed}: killed at step {reached}, resumed from {checkpoints}",
    )
    got = json.loads((run / "summary.json").read_text())
    assert got["student_after"] == pytest.approx(want["student_after"], abs=1e-9), f"seed {seed}"


@pytest.mark.slow  # ~2 min on 2 cores; the threads variant above runs in CI
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists child processes through /proc")
def test_sigkill_of_the_learner_with_stage_processes_leaves_no_orphan_and_resumes(models, tmp_path):  # noqa: F811
    """Stages in their own processes, fully async: the stage processes exit by themselves
    when their learner dies, and the resumed run has every step once, within η."""
    seed = int.from_bytes(os.urandom(4), "little")
    cfg = _config(
        models,
        tmp_path,
        name="killed",
        **{
            "stages.placement": "processes",
            "schedule.mode": "fully_async",
            "schedule.max_staleness": 2,
            "train.steps": 14,
            "train.checkpoint_every": 4,
        },
    )
    run, reached, stages = _kill_at_random(cfg, tmp_path, seed)
    assert stages, f"seed {seed}: no stage process was seen"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in stages):
        time.sleep(0.1)
    assert not any(_alive(p) for p in stages), f"seed {seed}: stage processes outlived their learner"
    _resume(run, seed)
    records = RunDir(run).read_metrics()
    assert [r["step"] for r in records] == list(range(1, 15)), f"seed {seed}: killed at step {reached}"
    assert all(r["staleness_max"] <= 2 for r in records), f"seed {seed}"
