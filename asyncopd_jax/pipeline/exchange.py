"""The exchange directory that the learner and its stage processes share.

    <run>/exchange/
      config.yaml    the config every stage runs with
      layout.json    the typed :class:`~asyncopd_jax.pipeline.layout.Layout`
      tickets/       groups to sample (from the learner)            ┐
      sampled/       sampled groups to score (with scoring processes) ├ spools (pipeline/spool.py)
      scored/        scored groups (to the learner)                 ┘
      trace/ logs/   one file per process
      teacher_accuracy.json   the in-process teachers' accuracies, by the first scoring stage
      STOP           the learner is done

A stage process needs nothing else, so the same stage can be started by hand on another
host that mounts the directory (``asyncopd stage``; see ``launch/``). Both files are
written atomically: a stage starting while they are rewritten reads the old or the new.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from asyncopd_jax.atomic_files import write_text_atomically
from asyncopd_jax.config import RunConfig, load_config, save_config
from asyncopd_jax.pipeline.layout import Layout
from asyncopd_jax.pipeline.spool import Spool


class Exchange:
    """The directory the stage processes and the learner share (see the module docstring)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.tickets = Spool(self.root / "tickets")
        self.sampled = Spool(self.root / "sampled")
        self.scored = Spool(self.root / "scored")
        self.trace_dir = self.root / "trace"
        self.log_dir = self.root / "logs"
        for d in (self.trace_dir, self.log_dir):
            d.mkdir(exist_ok=True)
        self.stop_file = self.root / "STOP"
        self.config_file = self.root / "config.yaml"
        self.layout_file = self.root / "layout.json"
        self.teacher_accuracy_file = self.root / "teacher_accuracy.json"

    def write(self, cfg: RunConfig, layout: Layout) -> None:
        save_config(cfg, self.config_file)
        write_text_atomically(self.layout_file, layout.to_json())

    def read(self) -> tuple[RunConfig, Layout]:
        if not self.layout_file.is_file():
            raise FileNotFoundError(f"{self.layout_file} does not exist: is {self.root} a run's exchange directory?")
        return load_config(self.config_file), Layout.from_json(self.layout_file.read_text(), str(self.layout_file))

    def write_teacher_accuracies(self, accuracies: dict[str, float]) -> None:
        """Each in-process teacher's held-out accuracy, by name."""
        write_text_atomically(self.teacher_accuracy_file, json.dumps(accuracies))

    def read_teacher_accuracies(self) -> dict[str, float] | None:
        """The teachers' held-out accuracies, once the stage that holds them has written them."""
        try:
            return {name: float(value) for name, value in json.loads(self.teacher_accuracy_file.read_text()).items()}
        except FileNotFoundError:
            return None

    def wait_for_teacher_accuracies(self, timeout: float) -> dict[str, float] | None:
        """:meth:`read_teacher_accuracies`, waiting up to ``timeout`` seconds for them."""
        deadline = time.monotonic() + timeout
        while (accuracies := self.read_teacher_accuracies()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return accuracies

    @property
    def stopped(self) -> bool:
        return self.stop_file.exists()
