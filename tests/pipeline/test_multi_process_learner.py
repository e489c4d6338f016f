"""``asyncopd train`` with a learner over two processes (``distributed.initialize``, CPU
collectives on localhost) and a rollout stage process: the run learns, every step is
logged once by the leader, checkpoints and the distilled student are written."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from asyncopd_jax.config import save_config
from tests.pipeline.test_trainer import _config, _kl_start_end, models  # noqa: F401 - fixture
from tests.waits import communicate_all
from tests.xla_flags import host_devices

pytestmark = pytest.mark.e2e  # several JAX processes: the end-to-end step (-m e2e)

ROOT = Path(__file__).resolve().parents[2]


def learner_processes(
    args: list[str], processes: int = 2, staging: list[Path] | None = None, **popen
) -> list[subprocess.Popen]:
    """``asyncopd train ARGS`` as the ``processes`` processes of one learner
    (``distributed.initialize``, CPU collectives on localhost, two CPU devices each);
    ``staging``: each process's ``$ASYNCOPD_STAGING`` (stand-in hosts of a run in a bucket)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": host_devices(2), "PYTHONPATH": str(ROOT)}
    distributed = [
        "distributed.initialize=true",
        f"distributed.coordinator_address=127.0.0.1:{port}",
        f"distributed.num_processes={processes}",
    ]
    return [
        subprocess.Popen(
            [sys.executable, "-m", "asyncopd_jax.cli", "train", "--no-progress", *args]
            + [a for item in [*distributed, f"distributed.process_id={i}"] for a in ("--set", item)],
            cwd=ROOT,
            env={**env, **({"ASYNCOPD_STAGING": str(staging[i])} if staging else {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            **popen,
        )
        for i in range(processes)
    ]


def learners_finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[str]:
    """Each process's output, once all exited with 0 (else the failures' output)."""
    outputs = communicate_all(procs, timeout=timeout)  # a peer that fails ends the other at once
    assert all(p.returncode == 0 for p in procs), "\n".join(
        f"learner process {i} exited with {p.returncode}:\n{text[-5000:]}"
        for i, (p, text) in enumerate(zip(procs, outputs))
        if p.returncode != 0
    )
    return outputs


@pytest.mark.slow  # CI time: tests/learner/test_distributed.py runs a two-process learner in CI
def test_a_learner_over_two_processes_runs_the_pipeline(models, tmp_path):  # noqa: F811
    cfg = _config(
        models,
        tmp_path,
        **{
            "stages.placement": "processes",
            "schedule.mode": "fully_async",
            "schedule.max_staleness": 2,
            "learner.mesh": "{data: -1, fsdp: 2}",
            "train.steps": 8,
            "train.checkpoint_every": 4,
            "stages.rollouts": 2,  # two groups per batch: their order matters
        },
    )
    config_file = tmp_path / "config.yaml"
    save_config(cfg, config_file)
    outputs = learners_finish(learner_processes(["--config", str(config_file)]))

    run = tmp_path / "t"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))  # the leader logs each step once
    start, end = _kl_start_end(records, k=3)
    assert end < 0.9 * start, [round(r["loss"], 3) for r in records]
    assert all(r["staleness_max"] <= 2 for r in records)
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [4, 8]
    assert (run / "student" / "config.json").is_file()
    # Only the leader evaluates; the other process prints the figure it broadcast.
    teacher = [line.split()[-1] for text in outputs for line in text.splitlines() if line.startswith("  teacher ")]
    assert len(teacher) == 2 and teacher[0] == teacher[1] != "0.0%", teacher
