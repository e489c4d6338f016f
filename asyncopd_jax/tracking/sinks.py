"""A run's metric sinks besides ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow.

``metrics.jsonl`` is the record and is always written
(:class:`~asyncopd_jax.pipeline.run_outputs.RunDir`); the sinks ``logging.sinks`` names get
the same records under grouped names (:mod:`~asyncopd_jax.tracking.names`), the run's
hyperparameters (the resolved config, the code version, the layout) once, and its images
(``report.png``) at the end. Only the learner's process 0 logs: stage processes and the
other learner processes report through it, so a run is logged once.

A sink that fails — its package missing, no network, a full disk, a bad key — is warned
about once and dropped; the run goes on and ``metrics.jsonl`` stays complete.

Resume: each sink continues the run it started (ids kept in ``<run>/tracking.json``) from
the checkpoint's step, and drops what it logged after that step where the backend can
(each backend's module says how).
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncopd_jax.tracking.names import grouped
from asyncopd_jax.tracking.sink import RunInfo, Sink

log = logging.getLogger(__name__)

IDS_FILE = "tracking.json"  # each sink's run id, for a resumed run to continue it
# What the sinks write under the run directory: a run in a bucket uploads these with
# metrics.jsonl and downloads them at resume.
FILES = (IDS_FILE, "tensorboard", "mlflow.db", "mlflow-artifacts", "wandb")


def _opener(name: str) -> Callable[[RunInfo], Sink]:
    """The backend of sink ``name``, imported only when configured (each is an extra)."""
    if name == "tensorboard":
        from asyncopd_jax.tracking.tensorboard_sink import TensorBoardSink

        return TensorBoardSink
    if name == "wandb":
        from asyncopd_jax.tracking.wandb_sink import WandbSink

        return WandbSink
    if name == "mlflow":
        from asyncopd_jax.tracking.mlflow_sink import MlflowSink

        return MlflowSink
    raise ValueError(f"logging.sinks: unknown sink {name!r}")


class Tracking:
    """The run's sinks, called in turn on a thread of their own, so the learner's step never
    waits for them (a write to W&B's service or MLflow's database takes milliseconds;
    inline, three sinks slowed the demo's learner by about a fifth). A sink that raises is
    warned about once and dropped (``failed`` says which, with the reason). :meth:`flush`
    and :meth:`close` return once everything submitted before them is written."""

    def __init__(self, sinks: Mapping[str, Sink] | None = None):
        self.sinks: dict[str, Sink] = dict(sinks or {})  # changed on the worker only, once it runs
        self.failed: dict[str, str] = {}
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._worker: threading.Thread | None = None

    @classmethod
    def open(cls, info: RunInfo) -> Tracking:
        """The sinks ``info.settings.sinks`` names (``jsonl`` is RunDir's own) for the run
        ``info``."""
        ids_file = info.directory / IDS_FILE
        if info.start_step and ids_file.is_file():
            info.ids = json.loads(ids_file.read_text())
        tracking = cls()
        for name in info.settings.sinks:
            if name != "jsonl":
                tracking._call(name, tracking._open_one, name, info)
        ids_file.write_text(json.dumps(info.ids, indent=2) + "\n")
        return tracking

    def _open_one(self, name: str, info: RunInfo) -> None:
        try:
            self.sinks[name] = _opener(name)(info)
        except ModuleNotFoundError as err:  # the sink's extra is not installed
            raise ModuleNotFoundError(f'{err.name} is not installed: pip install "asyncopd-jax[{name}]"') from None

    def _call(self, name: str, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)``; if it raises, sink ``name`` is warned about once and dropped."""
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - any failure of a sink: the run goes on
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            self.failed[name] = reason
            self.sinks.pop(name, None)
            log.warning(
                "the %s sink failed (%s); the run goes on without it (metrics.jsonl has every metric)", name, reason
            )

    def _submit(self, method: str, *args: Any) -> None:
        """Call ``method(*args)`` of every sink on the worker thread (started on first use)."""
        if not self.sinks:
            return
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="metric-sinks", daemon=True)
            self._worker.start()
        self._queue.put(functools.partial(self._each, method, *args))

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            job()
            self._queue.task_done()
        self._queue.task_done()

    def _each(self, method: str, *args: Any) -> None:
        for name, sink in list(self.sinks.items()):
            self._call(name, getattr(sink, method), *args)

    def log(self, record: Mapping[str, Any]) -> None:
        """One ``metrics.jsonl`` record, at its ``step`` (grouped here: the record may change)."""
        scalars, histograms = grouped(record)
        self._submit("log", int(record["step"]), scalars, histograms)

    def image(self, name: str, path: Path, step: int) -> None:
        self._submit("image", name, path, step)

    def table(self, name: str, columns: Sequence[str], rows: list[list], step: int) -> None:
        self._submit("table", name, list(columns), rows, step)

    def flush(self) -> None:
        """Write everything logged so far (each sink's own buffers too) before returning."""
        self._submit("flush")
        if self._worker is not None:
            self._queue.join()

    def close(self) -> None:
        """Write everything, close each sink, stop the worker."""
        self._submit("close")
        if self._worker is not None:
            self._queue.put(None)
            self._queue.join()
            self._worker.join()
            self._worker = None
        self.sinks.clear()
