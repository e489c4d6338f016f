"""MLflow: ``mlflow-skinny`` with SQLAlchemy (the ``mlflow`` extra), by default a SQLite
store in the run directory (``<run>/mlflow.db``, artifacts in ``<run>/mlflow-artifacts``);
``logging.mlflow_tracking_uri`` names another (a tracking server, a database).

Resume: the same MLflow run continues (its id in ``tracking.json``). MLflow's API cannot
delete logged values, so in the run's own SQLite store the values logged after the
checkpoint's step are deleted through MLflow's SQLAlchemy store (its tables, at the
pinned version); on another store they stay, and MLflow shows both incarnations' values
at those steps (warned once).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from asyncopd_jax.tracking.sink import RunInfo

log = logging.getLogger(__name__)

DATABASE, ARTIFACTS = "mlflow.db", "mlflow-artifacts"
MAX_PARAM = 6000  # characters MLflow stores of a parameter's value


class MlflowSink:
    def __init__(self, info: RunInfo):
        import mlflow
        from mlflow.entities import Param

        own_store = not info.settings.mlflow_tracking_uri
        uri = f"sqlite:///{info.directory / DATABASE}" if own_store else info.settings.mlflow_tracking_uri
        if own_store and not (info.directory / DATABASE).exists():
            _forget_store()
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        run_id = info.ids.get("mlflow") if info.start_step else None
        if run_id is None:
            project = info.settings.project
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(project, artifact_location=(info.directory / ARTIFACTS).as_uri())
            )
            run_id = self.client.create_run(experiment_id, run_name=info.name).info.run_id
            params = [Param(k, str(v)[:MAX_PARAM]) for k, v in sorted(info.hparams.items())]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
                self.client.log_batch(run_id, params=params[i : i + 100])
            info.ids["mlflow"] = run_id
        else:
            self.client.update_run(run_id, status="RUNNING")
            if own_store:
                _drop_after(self.client, run_id, info.start_step)
            else:
                log.warning(
                    "MLflow keeps the values run %s logged after step %d (another store than the run's own): "
                    "the steps after the checkpoint show both incarnations",
                    run_id,
                    info.start_step,
                )
        self.run_id = run_id

    def log(self, step: int, scalars: dict[str, float], histograms: dict[str, np.ndarray]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, step) for name, value in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def image(self, name: str, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path="images")

    def table(self, name: str, columns: Sequence[str], rows: list[list], step: int) -> None:
        """An artifact ``<name>/step_<step>.json`` in the layout of MLflow's tables
        (``{"columns": …, "data": …}``); ``log_table`` itself needs pandas."""
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory, f"step_{step:08d}.json")
            path.write_text(json.dumps({"columns": list(columns), "data": rows}))
            self.client.log_artifact(self.run_id, str(path), artifact_path=name)

    def flush(self) -> None:
        pass  # every call is written at once

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
        # MLflow keeps one SQLAlchemy engine per store URI for the process's life; its pooled
        # connections would hold this database file open even after it is replaced (a run in
        # a bucket resumed in the same process downloads it again): close them.
        engine = getattr(self.client._tracking_client.store, "engine", None)
        if engine is not None:
            engine.dispose()


def _forget_store() -> None:
    """Make MLflow open its stores anew. It keeps one store per URI for the process's life
    and creates a database's tables when it opens the store: a run's database file deleted
    since (the run started afresh in this process) would be used without its tables."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry

    _tracking_store_registry._get_store_with_resolved_uri.cache_clear()


def _drop_after(client, run_id: str, step: int) -> None:
    """Delete the run's metric values at steps after ``step`` from the SQLite store, and
    its latest values (MLflow recomputes them from what is left)."""
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric

    store = client._tracking_client.store  # the SqlAlchemyStore behind the client
    with store.ManagedSessionMaker() as session:
        session.query(SqlMetric).filter(SqlMetric.run_uuid == run_id, SqlMetric.step > step).delete()
        session.query(SqlLatestMetric).filter(SqlLatestMetric.run_uuid == run_id).delete()
