"""What a metric sink is (:class:`Sink`) and what it is opened with (:class:`RunInfo`);
the backends implement it, :class:`~asyncopd_jax.tracking.sinks.Tracking` calls them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from asyncopd_jax.config import LoggingConfig


@dataclasses.dataclass
class RunInfo:
    """What a sink needs to open (or continue) the run's record.

    Attributes:
      directory: the run's local directory (a run in a bucket: its staging copy).
      name: the run's name.
      start_step: 0 for a fresh run, else the checkpoint's step it resumes from.
      hparams: flat ``{field: value}``: the resolved config, the code version, the layout.
      settings: the ``logging`` section (the project, each sink's settings).
      ids: each sink's run id, by sink name (read from and written to ``tracking.json``).
    """

    directory: Path
    name: str
    start_step: int
    hparams: dict[str, Any]
    settings: LoggingConfig = LoggingConfig()
    ids: dict[str, str] = dataclasses.field(default_factory=dict)


class Sink(Protocol):
    """One backend; ``step`` is the optimizer step (the x axis everywhere)."""

    def log(self, step: int, scalars: dict[str, float], histograms: dict[str, np.ndarray]) -> None: ...

    def image(self, name: str, path: Path, step: int) -> None: ...

    def table(self, name: str, columns: Sequence[str], rows: list[list], step: int) -> None: ...

    def flush(self) -> None:
        """Write what the sink buffers (at every checkpoint: a killed run keeps its steps
        up to the checkpoint it resumes from)."""

    def close(self) -> None: ...
