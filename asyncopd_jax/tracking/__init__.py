"""Where a run's metrics go besides ``metrics.jsonl``: TensorBoard, Weights & Biases,
MLflow (``logging.sinks``), under grouped names (:mod:`~asyncopd_jax.tracking.names`)."""

from asyncopd_jax.tracking.names import grouped, metric_name
from asyncopd_jax.tracking.sink import RunInfo, Sink
from asyncopd_jax.tracking.sinks import FILES, Tracking

__all__ = ["FILES", "RunInfo", "Sink", "Tracking", "grouped", "metric_name"]
