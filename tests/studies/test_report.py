"""A study report's plots as images in TensorBoard, W&B and MLflow (``asyncopd study NAME
--sinks …``), read back with each sink's own reader."""

from __future__ import annotations

import json

import matplotlib.image

from asyncopd_jax.studies.report import Report, log_figures, pyplot
from tests.tracking.readers import mlflow_artifacts, tensorboard_images, wandb_images


def test_a_reports_plots_reach_each_sink_once_per_report(tmp_path):
    report = Report(tmp_path / "docs", "a_study", "A study", "asyncopd study a_study")
    plt = pyplot()
    for name, size in (("curve", (4, 3)), ("bars", (6, 2))):
        fig, ax = plt.subplots(figsize=size)
        ax.plot([0, 1], [0, 1])
        report.figure(fig, f"{name}.png", name)
        plt.close(fig)
    path = report.write()
    pixels = {
        name: matplotlib.image.imread(tmp_path / "docs" / "a_study" / f"{name}.png").shape for name in ("curve", "bars")
    }
    sizes = {f"study/{name}": {0: [(shape[1], shape[0])]} for name, shape in pixels.items()}  # (width, height), once

    for _ in range(2):  # a report made again replaces the plots it logged before
        run = log_figures(path, tmp_path / "work", ["tensorboard", "wandb", "mlflow"], {"study": "a_study"})
    assert run == tmp_path / "work" / "a_study-plots"
    assert {tag: dict(steps) for tag, steps in tensorboard_images(run).items()} == sizes
    assert {name: dict(steps) for name, steps in wandb_images(run).items()} == sizes
    mlflow_id = json.loads((run / "tracking.json").read_text())["mlflow"]
    assert mlflow_artifacts(run, mlflow_id, "images") == ["images/bars.png", "images/curve.png"]


def test_asyncopd_study_sinks_sends_the_reports_plots(tmp_path, monkeypatch, capsys):
    """``asyncopd study NAME --sinks …``: the report that study wrote, its plots to the sinks
    named (a stand-in study: the real ones train for minutes)."""
    from asyncopd_jax import studies
    from asyncopd_jax.cli import main

    def study(out_dir, work_dir, *, quick, seeds, jobs, command):
        report = Report(out_dir, "kl_direction", "E1", command)
        fig, ax = pyplot().subplots()
        report.figure(fig, "curve.png", "a curve")
        return report.write()

    monkeypatch.setattr(studies, "get_study", lambda name: study)
    out, work = tmp_path / "docs", tmp_path / "work"
    argv = ["study", "kl_direction", "--out", str(out), "--work", str(work), "--seeds", "2", "--sinks", "tensorboard"]
    assert main(argv) == 0
    run = work / "kl_direction-plots"
    assert set(tensorboard_images(run)) == {"study/curve"}
    assert not (run / "wandb").exists() and not (run / "mlflow.db").exists()  # only the sinks named
    assert "its plots went to tensorboard (run study-kl_direction" in capsys.readouterr().out
