"""A run whose teacher server is killed (SIGKILL) and restarted mid-run: the run waits,
retries and finishes; every rollout group is scored exactly once (none lost, none twice),
nothing is dropped, and the wait is in the metrics. End to end (``asyncopd serve-teacher``
in a process of its own, the trainer in this one): marked e2e."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from asyncopd_jax.config import load_config
from asyncopd_jax.pipeline.trace import load_spans
from asyncopd_jax.pipeline.trainer import Trainer
from asyncopd_jax.teacher import launch
from asyncopd_jax.teacher.launch import free_port
from tests.waits import SHORT_WAIT_SETS

pytestmark = pytest.mark.e2e


def start_server(port: int, log: Path) -> subprocess.Popen:
    """``asyncopd serve-teacher`` for the built-in teacher, up and answering on ``port``."""
    command = launch.serve_teacher_command("builtin:teacher", port)
    process = launch.start(command, log, {**os.environ, "JAX_PLATFORMS": "cpu"})
    launch.wait_until_healthy(f"http://127.0.0.1:{port}", process, log, launch.SERVE_TEACHER_START_S)
    return process


def steps_logged(metrics: Path) -> int:
    if not metrics.is_file():
        return 0
    lines = [line for line in metrics.read_text().splitlines() if line.strip()]
    return json.loads(lines[-1]).get("step", 0) if lines else 0


@pytest.mark.timeout(600)
def test_a_run_survives_its_teacher_server_killed_and_restarted(tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    server = start_server(port, log)
    cfg = load_config(
        "demo",
        [
            f"output_dir={tmp_path}",
            "teacher.path=''",
            f"teacher.server.url=http://127.0.0.1:{port}",
            "teacher.server.api=asyncopd",
            "teacher.server.backoff=0.2",
            "teacher.server.give_up_after=120",
            "estimator.name=reverse_kl_mc",
            "sampling.num_candidates=2",
            "learner.batch_size=16",
            "train.steps=24",
            "train.eval_every=1000",
            "train.checkpoint_every=1000",
            "task.eval_prompts=8",
            *SHORT_WAIT_SETS,
        ],
    )
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["summary"] = Trainer(cfg, progress=False).run()
        except BaseException as err:  # re-raised in the test's thread below
            outcome["error"] = err

    trainer = threading.Thread(target=train)
    trainer.start()
    metrics = tmp_path / "demo" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 300
        while steps_logged(metrics) < 6:
            assert time.monotonic() < deadline and trainer.is_alive(), outcome
            time.sleep(0.2)
        server.send_signal(signal.SIGKILL)  # mid-run, without warning
        server.wait()
        time.sleep(3)  # the run retries against a closed port meanwhile
        server = start_server(port, log)
        trainer.join(420)
    finally:
        server.kill()
        server.wait()
    assert not trainer.is_alive()
    if "error" in outcome:
        raise outcome["error"]
    summary = outcome["summary"]
    assert summary["steps"] == 24 and summary["dropped_stale"] == summary["dropped_future"] == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 25))
    assert sum(r.get("teacher_wait_s", 0.0) for r in records) > 3  # the outage, waited out and logged
    scored = sorted(s["args"]["group"] for s in load_spans(tmp_path / "demo" / "trace.json") if s["name"] == "score")
    assert (
        scored == list(range(1, len(scored) + 1)) and len(scored) >= 24
    )  # groups count from 1: each once, none skipped
