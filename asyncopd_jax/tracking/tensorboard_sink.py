"""TensorBoard: event files under ``<run>/tensorboard`` (tensorboardX's writer, the
``tensorboard`` extra; ``tensorboard --logdir runs`` compares runs, and reads ``gs://``).

Resume: the writer opens with ``purge_step = start_step + 1``, an event that makes
TensorBoard drop what the earlier incarnation logged at steps after the checkpoint.
Scalars are stored as float32 (TensorBoard's ``simple_value``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from asyncopd_jax.tracking.sink import RunInfo

DIRECTORY = "tensorboard"


def _markdown(hparams: dict) -> str:
    """The hyperparameters as a two-column Markdown table (TensorBoard's text tab)."""
    rows = "\n".join(f"| `{k}` | `{v}` |" for k, v in sorted(hparams.items()))
    return f"| field | value |\n|---|---|\n{rows}"


class TensorBoardSink:
    def __init__(self, info: RunInfo):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(
            str(info.directory / DIRECTORY), purge_step=info.start_step + 1 if info.start_step else None, flush_secs=10
        )
        if not info.start_step:
            self.writer.add_text("run/hparams", _markdown(info.hparams), 0)

    def log(self, step: int, scalars: dict[str, float], histograms: dict[str, np.ndarray]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        for name, counts in histograms.items():
            if counts.sum():  # counts per integer value 0 … n−1: one bin each
                values = np.repeat(np.arange(counts.size), counts)
                self.writer.add_histogram(name, values, step, bins=np.arange(counts.size + 1) - 0.5)

    def image(self, name: str, path: Path, step: int) -> None:
        import matplotlib.image

        pixels = matplotlib.image.imread(path)  # [H, W, C] floats in [0, 1] for a PNG
        self.writer.add_image(name, pixels, step, dataformats="HWC")

    def table(self, name: str, columns: Sequence[str], rows: list[list], step: int) -> None:
        """TensorBoard has no tables: a Markdown table in its text tab."""
        cells = [[str(c).replace("|", "\\|").replace("\n", " ") for c in row] for row in rows]
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        self.writer.add_text(name, "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells]), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
