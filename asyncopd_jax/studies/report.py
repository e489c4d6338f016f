"""A study's report: Markdown with tables and embedded PNG plots, and the command that made it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


class Report:
    """Builds ``<out_dir>/<name>.md``; plots go to ``<out_dir>/<name>/`` and are linked."""

    def __init__(self, out_dir: str | Path, name: str, title: str, command: str):
        self.out_dir = Path(out_dir)
        self.name = name
        self.figures = self.out_dir / name
        self.figures.mkdir(parents=True, exist_ok=True)
        self.lines: list[str] = [f"# {title}", "", "Made by:", "", "```bash", command, "```", ""]

    def text(self, paragraph: str) -> None:
        self.lines += [paragraph.strip(), ""]

    def heading(self, title: str, level: int = 2) -> None:
        self.lines += [f"{'#' * level} {title}", ""]

    def table(self, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        self.lines.append("| " + " | ".join(header) + " |")
        self.lines.append("|" + "---|" * len(header))
        for row in rows:
            self.lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
        self.lines.append("")

    def figure(self, fig, filename: str, caption: str) -> None:
        """Save a matplotlib figure as PNG and embed it."""
        path = self.figures / filename
        fig.savefig(path, dpi=110, bbox_inches="tight")
        self.lines += [f"![{caption}]({self.name}/{filename})", "", f"*{caption}*", ""]

    def config(self, title: str, settings: dict[str, Any]) -> None:
        """A collapsible block with the exact settings of the runs."""
        self.lines += [
            f"<details><summary>{title}</summary>",
            "",
            "```json",
            json.dumps(settings, indent=1, sort_keys=True, default=str),
            "```",
            "",
            "</details>",
            "",
        ]

    def write(self) -> Path:
        path = self.out_dir / f"{self.name}.md"
        path.write_text("\n".join(self.lines).rstrip() + "\n")
        return path


def log_figures(report: Path, work_dir: Path, sinks: Sequence[str], hparams: dict[str, Any]) -> Path:
    """The plots of the study report ``report`` (``<out>/<name>.md``; its PNGs under
    ``<out>/<name>/``) as images ``study/<file stem>`` at step 0 of a run ``study-<name>``
    of their own in each of ``sinks`` (``tensorboard``, ``wandb``, ``mlflow``), written
    afresh under ``<work_dir>/<name>-plots`` (returned). A sink that fails is warned
    about once (:class:`~asyncopd_jax.tracking.Tracking`)."""
    from asyncopd_jax.config import LoggingConfig
    from asyncopd_jax.tracking import FILES, RunInfo, Tracking

    name = report.stem
    directory = Path(work_dir) / f"{name}-plots"
    directory.mkdir(parents=True, exist_ok=True)
    for old in FILES:  # an earlier report's
        path = directory / old
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    settings = LoggingConfig(sinks=("jsonl", *sinks))  # type: ignore[arg-type]  # names checked by argparse
    tracking = Tracking.open(RunInfo(directory, f"study-{name}", 0, hparams, settings))
    for png in sorted(report.with_suffix("").glob("*.png")):
        tracking.image(f"study/{png.stem}", png, 0)
    tracking.close()
    return directory


def pyplot():
    """matplotlib's pyplot on the Agg backend (PNG files; no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def mean_spread(values: Iterable[float], digits: int = 3) -> str:
    """``mean ± half-range`` (``mean`` alone for one value)."""
    numbers = [float(v) for v in values]
    mean = sum(numbers) / len(numbers)
    if len(numbers) == 1:
        return f"{mean:.{digits}g}"
    return f"{mean:.{digits}g} ± {(max(numbers) - min(numbers)) / 2:.2g}"


def save_measured(path: Path, settings: Any, payload: dict[str, Any]) -> None:
    """Write a study's measurements (``payload``) as JSON next to its report, with the
    settings (a dataclass) they were taken under."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": _plain(settings), **payload}, indent=0))


def load_measured(path: Path, settings: Any) -> dict[str, Any] | None:
    """What :func:`save_measured` wrote at ``path``, if it was taken with ``settings``, else None."""
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    return saved if saved["settings"] == _plain(settings) else None


def _plain(settings: Any) -> Any:
    return json.loads(json.dumps(dataclasses.asdict(settings)))  # tuples as lists, as JSON reads them back
