"""The exchange that the learner and its stage processes share: a local directory, or a
prefix in a bucket every host reaches (``gs://…``, ``s3://…``; :mod:`asyncopd_jax.storage`).

    <exchange>/
      config.yaml    the config every stage runs with
      layout.json    the typed :class:`~asyncopd_jax.pipeline.layout.Layout`
      tickets/       groups to sample (from the learner)            ┐
      sampled/       sampled groups to score (with scoring processes) ├ spools (pipeline/spool.py)
      scored/        scored groups (to the learner)                 ┘
      trace/         one trace per stage process
      teacher_accuracy.json   the in-process teachers' accuracies, by the first scoring stage
      STOP           the learner is done

A stage process needs nothing else, so the same stage can be started by hand on another
host that reaches the exchange (``asyncopd stage``; see ``launch/``). Every file is one
object written whole: a stage starting while one is rewritten reads the old or the new.
The stage processes' logs stay on the learner's host, which starts them
(``<exchange>/logs/``, or ``log_dir`` for a bucket).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from asyncopd_jax.config import RunConfig, config_yaml, load_config
from asyncopd_jax.pipeline.layout import Layout
from asyncopd_jax.pipeline.spool import Spool
from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.storage import Store, open_store
from asyncopd_jax.storage.local import LocalStore

STOP = "STOP"
TRACE = "trace/"
# How often a process looks for STOP in a bucket (each look is a billed request; a local
# directory is looked at every time).
STOP_CHECK_S = 1.0


class Exchange:
    """The exchange the stage processes and the learner share (see the module docstring).

    ``location``: a local directory (created), a bucket URL, or a store. ``log_dir``: where
    the stage processes' logs go when the exchange is in a bucket (default: a new
    temporary directory)."""

    def __init__(self, location: str | Path | Store, log_dir: str | Path | None = None):
        self.store = open_store(location) if isinstance(location, (str, Path)) else location
        self.url = self.store.url
        self.tickets = Spool(self.store.child("tickets"))
        self.sampled = Spool(self.store.child("sampled"))
        self.scored = Spool(self.store.child("scored"))
        self._local = self.store.root if isinstance(self.store, LocalStore) else None
        if log_dir is None:
            log_dir = self._local / "logs" if self._local is not None else tempfile.mkdtemp(prefix="asyncopd-logs-")
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._stopped_at: float | None = None  # the last look at STOP in a bucket
        self._stopped = False

    # --- config and layout -------------------------------------------------------------------

    def write(self, cfg: RunConfig, layout: Layout) -> None:
        self.store.write("config.yaml", config_yaml(cfg).encode())
        self.store.write("layout.json", layout.to_json().encode())

    def read(self) -> tuple[RunConfig, Layout]:
        layout = self.store.read("layout.json")
        config = self.store.read("config.yaml")
        if layout is None or config is None:
            raise FileNotFoundError(f"{self.url}/layout.json does not exist: is {self.url} a run's exchange?")
        with tempfile.TemporaryDirectory() as tmp:  # load_config reads (and checks) a file
            path = Path(tmp) / "config.yaml"
            path.write_bytes(config.data)
            cfg = load_config(path)
        return cfg, Layout.from_json(layout.data.decode(), f"{self.url}/layout.json")

    # --- teachers' accuracies ----------------------------------------------------------------

    def write_teacher_accuracies(self, accuracies: dict[str, float]) -> None:
        """Each in-process teacher's held-out accuracy, by name."""
        self.store.write("teacher_accuracy.json", json.dumps(accuracies).encode())

    def read_teacher_accuracies(self) -> dict[str, float] | None:
        """The teachers' held-out accuracies, once the stage that holds them has written them."""
        blob = self.store.read("teacher_accuracy.json")
        return None if blob is None else {name: float(value) for name, value in json.loads(blob.data).items()}

    def wait_for_teacher_accuracies(self, timeout: float) -> dict[str, float] | None:
        """:meth:`read_teacher_accuracies`, waiting up to ``timeout`` seconds for them."""
        deadline = time.monotonic() + timeout
        while (accuracies := self.read_teacher_accuracies()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return accuracies

    # --- stop --------------------------------------------------------------------------------

    def stop(self) -> None:
        """Tell every stage process that the run is done."""
        self.store.write(STOP, b"")

    def clear_stop(self) -> None:
        self.store.delete(STOP)
        self._stopped, self._stopped_at = False, None

    @property
    def stopped(self) -> bool:
        if self._stopped:
            return True
        if self.store.remote and self._stopped_at is not None and time.monotonic() - self._stopped_at < STOP_CHECK_S:
            return False
        self._stopped_at = time.monotonic()
        self._stopped = self.store.read(STOP) is not None
        return self._stopped

    # --- traces ------------------------------------------------------------------------------

    def dump_trace(self, tracer: Tracer, name: str) -> None:
        """Write stage process ``name``'s trace (for the learner to merge)."""
        if self._local is not None:
            (self._local / "trace").mkdir(exist_ok=True)
            tracer.dump(self._local / "trace" / f"{name}.json")
            return
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            tracer.dump(path)
            self.store.write(f"{TRACE}{name}.json", path.read_bytes())

    def trace_generation(self, name: str) -> str | None:
        """The generation of ``name``'s trace (None: none written): a stage process rewrites
        it while it runs, so a change is a sign of life judged without comparing clocks."""
        blob = self.store.read(f"{TRACE}{name}.json")
        return None if blob is None else blob.generation

    def trace_files(self) -> list[Path]:
        """The stage processes' traces as local files (downloaded from a bucket)."""
        if self._local is not None:
            return sorted((self._local / "trace").glob("*.json"))
        out = []
        for key in self.store.list(TRACE):
            blob = self.store.read(key)
            if blob is not None:
                path = self.log_dir / "trace" / Path(key).name
                path.parent.mkdir(exist_ok=True)
                path.write_bytes(blob.data)
                out.append(path)
        return out
