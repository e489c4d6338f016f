"""Weights & Biases (the ``wandb`` extra): online where a key is set up, else offline
(``logging.wandb_mode``), the run's files under ``<run>/wandb``; ``wandb sync
<run>/wandb/offline-run-*`` uploads an offline run later.

Resume: the same W&B run id (``tracking.json``). Online, the run is rewound to the
checkpoint's step (``resume_from="<id>?_step=<step>"``), so W&B drops what was logged
after it. Offline, W&B writes the resumed incarnation as another offline run directory
with the same id; the steps after the checkpoint appear in both record logs, and the
later log is the one that continues the run (W&B's own rewind needs its server).
"""

from __future__ import annotations

import netrc
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from asyncopd_jax.tracking.sink import RunInfo

FLUSH_S = 0.25  # W&B's record log is written this often (x_transaction_log_flush_interval)
# W&B's step only goes forward, and a background evaluation's record (eval.mode: background)
# arrives after the steps that followed its version: eval/… metrics carry their own step,
# the x axis of their charts (W&B's define_metric).
EVAL_STEP = "eval/step"


def _logged_in() -> bool:
    """Whether a W&B key is set up here: ``WANDB_API_KEY``, or ``wandb login``'s entry in
    ``~/.netrc``."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        hosts = netrc.netrc().hosts
    except (OSError, netrc.NetrcParseError):
        return False
    return any("wandb" in host for host in hosts)


class WandbSink:
    def __init__(self, info: RunInfo):
        import wandb

        mode = info.settings.wandb_mode
        if mode == "auto":
            mode = "online" if _logged_in() else "offline"
        run_id = info.ids.get("wandb") if info.start_step else None
        kwargs: dict = {}
        if run_id is None:
            run_id = uuid.uuid4().hex[:12]
        elif mode == "online":
            kwargs["resume_from"] = f"{run_id}?_step={info.start_step}"
        else:
            kwargs["resume"] = "allow"
        info.ids["wandb"] = run_id
        self._wandb = wandb
        self.run = wandb.init(
            project=info.settings.project,
            name=info.name,
            id=None if "resume_from" in kwargs else run_id,
            dir=str(info.directory),
            config=info.hparams,
            mode=mode,
            settings=wandb.Settings(
                console="off", x_disable_stats=True, silent=True, x_transaction_log_flush_interval=FLUSH_S
            ),
            reinit="create_new",
            **kwargs,
        )
        self.run.define_metric(EVAL_STEP)
        self.run.define_metric("eval/*", step_metric=EVAL_STEP)
        self.step = info.start_step  # the newest step logged

    def _log(self, data: dict, step: int) -> None:
        """``data`` at ``step``; a step already passed goes in at the newest (eval/… at their own)."""
        if any(name.startswith("eval/") for name in data):
            data[EVAL_STEP] = step
        self.step = max(self.step, step)
        self.run.log(data, step=self.step)

    def log(self, step: int, scalars: dict[str, float], histograms: dict[str, np.ndarray]) -> None:
        data: dict = dict(scalars)
        for name, counts in histograms.items():
            edges = np.arange(counts.size + 1) - 0.5
            data[name] = self._wandb.Histogram(np_histogram=(counts.tolist(), edges.tolist()))
        self._log(data, step)

    def image(self, name: str, path: Path, step: int) -> None:
        self._log({name: self._wandb.Image(str(path))}, step)

    def table(self, name: str, columns: Sequence[str], rows: list[list], step: int) -> None:
        self._log({name: self._wandb.Table(columns=list(columns), data=rows)}, step)

    def flush(self) -> None:
        # W&B's service process writes the record log every FLUSH_S (by default every 15 s: a
        # run killed before that left an empty log here); no call forces it, so wait two
        # periods for what was logged before the checkpoint to be on disk.
        time.sleep(2 * FLUSH_S)

    def close(self) -> None:
        self.run.finish()
