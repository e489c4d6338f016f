"""A run logged to TensorBoard, W&B (offline) and MLflow (SQLite), read back with each
sink's own reader (tests/tracking/readers.py): every metric of every metrics.jsonl record
under its grouped name, at its step, equal in float32 — after a SIGKILL and a resume
too, with nothing the resumed run repeated shown twice."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from asyncopd_jax.config import LoggingConfig
from asyncopd_jax.pipeline.run_outputs import RunDir, optimizer_step_records
from asyncopd_jax.pipeline.trainer import Trainer
from asyncopd_jax.tracking import RunInfo, Tracking, grouped
from asyncopd_jax.tracking.samples import COLUMNS as SAMPLE_COLUMNS
from tests.pipeline.test_trainer import _config, models  # noqa: F401 - fixture
from tests.tracking.readers import (
    Series,
    mlflow_scalars,
    mlflow_table,
    tensorboard_scalars,
    tensorboard_text,
    wandb_history,
    wandb_table,
)

ALL = "[jsonl,tensorboard,wandb,mlflow]"


def _equal_to_metrics(records: list[dict], logged: Series, sink: str) -> None:
    """Every scalar of every record is in ``logged`` once, at its step, equal in float32;
    and the sink has the steps metrics.jsonl has, no others."""
    for record in records:
        for name, value in grouped(record)[0].items():
            got = logged.get(name, {}).get(record["step"])
            assert got is not None and len(got) == 1, (sink, name, record["step"], got)
            assert np.float32(got[0]) == np.float32(value), (sink, name, record["step"], got[0], value)
    assert sorted(logged["train/loss"]) == [r["step"] for r in optimizer_step_records(records)], sink


def _latest_wins(incarnations: list[Series]) -> Series:
    """W&B offline: the later incarnation's values at the steps it logged."""
    merged: Series = {}
    for series in incarnations:
        for name, steps in series.items():
            merged.setdefault(name, {}).update(steps)
    return merged


@pytest.mark.e2e
def test_every_metric_reaches_each_sink_and_a_resume_drops_what_metrics_jsonl_drops(models, tmp_path):  # noqa: F811
    from tests.scenarios.test_kill_resume import _kill_at_random, _resume

    cfg = _config(
        models,
        tmp_path,
        **{
            "logging.sinks": ALL,
            "schedule.mode": "sync",
            "train.steps": 12,
            "train.checkpoint_every": 4,
            "train.eval_every": 3,
            "eval.mode": "background",  # its records come after later steps' (W&B: at eval/step)
        },
    )
    run, reached, _ = _kill_at_random(cfg, tmp_path, seed=3)
    resumed_from = RunDir(run).latest_checkpoint()
    assert resumed_from is not None and resumed_from < reached  # the kill left steps to drop
    _resume(run, seed=3)

    records = RunDir(run).read_metrics()
    assert [r["step"] for r in optimizer_step_records(records)] == list(range(1, 13))
    # each evaluation once, at its version's step (those before the checkpoint waited for)
    evals = sorted((r["step"], r["eval_version"]) for r in records if "eval_accuracy" in r)
    assert evals == [(v, v) for v in (3, 6, 9, 12)]
    _equal_to_metrics(records, tensorboard_scalars(run), "tensorboard")
    ids = json.loads((run / "tracking.json").read_text())
    _equal_to_metrics(records, mlflow_scalars(run, ids["mlflow"]), "mlflow")
    incarnations = wandb_history(run)
    assert len(incarnations) == 2  # the killed run's record log and the resumed one's, one id
    assert max(incarnations[0]["train/loss"]) > resumed_from  # it had logged past the checkpoint
    _equal_to_metrics(records, _latest_wins(incarnations), "wandb")
    # the table of sample answers at the last evaluation: four rows, each answer's KL mean
    # that of its tokens' (3 decimals each); TensorBoard shows it as text
    columns = list(SAMPLE_COLUMNS)
    tables = [
        ("wandb", wandb_table(run, "samples", 12)),
        ("mlflow", mlflow_table(run, ids["mlflow"], "samples/step_00000012.json")),
    ]
    for sink, table in tables:
        assert table["columns"] == columns, sink
        rows = [dict(zip(columns, values)) for values in table["data"]]
        assert len(rows) == 4 and all(r["prompt"] and r["kl_per_token"] for r in rows), (sink, rows)
        for r in rows:
            kl = [float(cell.rsplit("(", 1)[1][:-1]) for cell in r["kl_per_token"].split(" ")]
            assert abs(np.mean(kl) - r["kl_mean"]) < 1e-3, (sink, r)
    assert rows[0]["prompt"] in tensorboard_text(run, "samples")[12]
    # the eval curve starts at step 0 (before training) in each
    for series in (tensorboard_scalars(run), mlflow_scalars(run, ids["mlflow"])):
        assert 0 in series["eval/accuracy"] and 12 in series["eval/accuracy"]


class _Broken:
    def __init__(self, fail_at: str):
        self.fail_at, self.logged = fail_at, 0

    def log(self, step, scalars, histograms):
        if self.fail_at == "log" and step == 2:
            raise OSError("No space left on device")
        self.logged += 1

    def image(self, name, path, step):
        pass

    def flush(self):
        pass

    def close(self):
        pass


def test_a_sink_that_fails_mid_run_is_warned_about_once_and_dropped(caplog):
    broken, fine = _Broken("log"), _Broken("never")
    tracking = Tracking({"tensorboard": broken, "wandb": fine})
    with caplog.at_level(logging.WARNING):
        for step in range(1, 6):
            tracking.log({"step": step, "loss": 1.0})
        tracking.flush()  # the sinks run on a thread of their own: wait for it
    warnings = [r.getMessage() for r in caplog.records if "sink failed" in r.getMessage()]
    assert warnings == [
        "the tensorboard sink failed (OSError: No space left on device); the run goes on without it "
        "(metrics.jsonl has every metric)"
    ]
    assert (broken.logged, fine.logged) == (1, 5) and list(tracking.sinks) == ["wandb"]
    tracking.close()
    assert tracking._worker is None and not tracking.sinks


def test_the_learner_does_not_wait_for_a_slow_sink():
    """log returns before the sink has written; flush waits for it."""
    import threading

    release, written = threading.Event(), []

    class Slow(_Broken):
        def log(self, step, scalars, histograms):
            release.wait(10)
            written.append(step)

    tracking = Tracking({"wandb": Slow("never")})
    tracking.log({"step": 1, "loss": 1.0})
    assert written == []  # the caller went on while the sink waits
    release.set()
    tracking.flush()
    assert written == [1]
    tracking.close()


@pytest.mark.e2e
def test_a_sink_that_cannot_start_leaves_the_run_complete(models, tmp_path, caplog):  # noqa: F811
    """An MLflow store that cannot be opened: one warning, the other sinks and metrics.jsonl
    whole; a real ``tensorboard`` on loopback serves the run's scalars over its HTTP API."""
    cfg = _config(
        models,
        tmp_path,
        **{
            "logging.sinks": "[jsonl,tensorboard,mlflow]",
            "logging.mlflow_tracking_uri": "nosuchscheme://x",
            "train.steps": 4,
        },
    )
    with caplog.at_level(logging.WARNING):
        Trainer(cfg, progress=False).run()
    warnings = [r.getMessage() for r in caplog.records if "sink failed" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("the mlflow sink failed"), warnings
    run = tmp_path / "t"
    records = RunDir(run).read_metrics()
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    _equal_to_metrics(records, tensorboard_scalars(run), "tensorboard")
    with _tensorboard_server(run / "tensorboard") as url:
        served = json.loads(_get(f"{url}/data/plugin/scalars/scalars?run=.&tag=train%2Floss"))
    assert [(step, np.float32(value)) for _, step, value in served] == [
        (r["step"], np.float32(r["loss"])) for r in records
    ]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read()


@contextlib.contextmanager
def _tensorboard_server(logdir: Path) -> Iterator[str]:
    """``tensorboard --logdir LOGDIR`` on 127.0.0.1 (the package's own command), once it
    answers; yields its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1"]
    server = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if json.loads(_get(f"{url}/data/plugin/scalars/tags")).get("."):  # the run is loaded
                    break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, server.stderr.read().decode()[-2000:]
            time.sleep(0.2)
        yield url
    finally:
        server.kill()
        server.wait(10)


def test_a_resumed_run_continues_each_sinks_own_run(tmp_path):
    """The ids a fresh run records are the ones a resume reads (RunInfo.ids)."""
    info = RunInfo(tmp_path, "t", 0, {})
    info.ids["wandb"] = "abc"
    Tracking.open(info).close()
    assert json.loads((tmp_path / "tracking.json").read_text()) == {"wandb": "abc"}
    resumed = RunInfo(tmp_path, "t", 4, {})
    Tracking.open(resumed).close()
    assert resumed.ids == {"wandb": "abc"}


def test_a_sink_without_its_extra_names_the_extra(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if not installed
    with caplog.at_level(logging.WARNING):
        tracking = Tracking.open(RunInfo(tmp_path, "t", 0, {}, LoggingConfig(sinks=("jsonl", "tensorboard"))))
    assert tracking.failed == {
        "tensorboard": 'ModuleNotFoundError: tensorboardX is not installed: pip install "asyncopd-jax[tensorboard]"'
    }
