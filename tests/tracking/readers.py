"""Each sink's record read back with the sink's own reader: TensorBoard's event
accumulator, W&B's record log decoded with W&B's protobuf schema, MLflow's client.
Each returns ``{name: {step: [values]}}`` (a list: a step logged twice shows twice)."""

from __future__ import annotations

import collections
import json
import struct
from collections.abc import Iterator
from pathlib import Path

Series = dict[str, dict[int, list[float]]]


def tensorboard_scalars(run: Path) -> Series:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()  # honours purge_step: events of an earlier incarnation after it are dropped
    out: Series = collections.defaultdict(lambda: collections.defaultdict(list))
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            out[tag][event.step].append(event.value)
    return out


# The record log W&B writes offline (run-<id>.wandb): a 7-byte header, then LevelDB's log
# format — 32 KiB blocks of chunks, each `crc32 u32, length u16, type u8` then the bytes;
# type 1 a whole record, 2/3/4 its first/middle/last piece — each record a `Record` message
# of W&B's schema (wandb/proto/wandb_internal.proto).
_HEADER, _BLOCK, _CHUNK = b":W&B\xe1\xbe\x00", 32768, 7


def _wandb_records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    assert data[: len(_HEADER)] == _HEADER, f"{path}: not a W&B record log"
    pos, pieces = len(_HEADER), b""
    while pos + _CHUNK <= len(data):
        if _BLOCK - pos % _BLOCK < _CHUNK:  # a block's tail too short for a chunk header: padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK])
        pieces += data[pos + _CHUNK : pos + _CHUNK + length]
        pos += _CHUNK + length
        if kind in (1, 4):
            yield pieces
            pieces = b""


def _wandb_logs(run: Path) -> list[Path]:
    """The record log of each offline run under ``<run>/wandb``, in the order they were written."""
    return sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))


def _history_items(log: Path) -> Iterator[dict]:
    """Each history row of the record log ``log``: ``{key: value}`` (a nested key joined by ``/``)."""
    from wandb.proto import wandb_internal_pb2

    for data in _wandb_records(log):
        record = wandb_internal_pb2.Record.FromString(data)
        if record.WhichOneof("record_type") == "history":
            yield {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}


def wandb_history(run: Path) -> list[Series]:
    """Each offline run's history (one per incarnation, in the order they were written)."""
    incarnations = []
    for log in _wandb_logs(run):
        out: Series = collections.defaultdict(lambda: collections.defaultdict(list))
        for items in _history_items(log):
            step = int(items.pop("_step"))
            eval_step = items.pop("eval/step", None)  # eval/… charts' own x axis (wandb_sink.EVAL_STEP)
            for name, value in items.items():
                if isinstance(value, (int, float)) and not name.startswith("_"):
                    at = int(eval_step) if eval_step is not None and name.startswith("eval/") else step
                    out[name][at].append(float(value))
        incarnations.append(out)
    return incarnations


def mlflow_scalars(run: Path, run_id: str) -> Series:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    out: Series = collections.defaultdict(lambda: collections.defaultdict(list))
    for name in client.get_run(run_id).data.metrics:
        for metric in client.get_metric_history(run_id, name):
            out[name][metric.step].append(metric.value)
    return out


def tensorboard_text(run: Path, tag: str) -> dict[int, str]:
    """The text TensorBoard shows under ``tag``, by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    return {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(f"{tag}/text_summary")}


def wandb_table(run: Path, name: str, step: int) -> dict:
    """The W&B table ``name`` logged at ``step`` (the newest offline run that has it): its
    history item points at a JSON file in the run's files."""
    found = None
    for log in _wandb_logs(run):
        for items in _history_items(log):
            if items.get("_step") == step and f"{name}/path" in items:  # the table's fields, flattened
                found = json.loads((log.parent / "files" / items[f"{name}/path"]).read_text())
    assert found is not None, f"no table {name} at step {step} in {run / 'wandb'}"
    return found


def mlflow_table(run: Path, run_id: str, artifact: str) -> dict:
    """The MLflow table artifact ``artifact`` of run ``run_id``: ``{"columns", "data"}``."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    path = client.download_artifacts(run_id, artifact, str(run / "downloaded"))
    return json.loads(Path(path).read_text())


def tensorboard_images(run: Path) -> dict[str, dict[int, list[tuple[int, int]]]]:
    """Each image TensorBoard shows: ``{tag: {step: [(width, height)]}}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    out: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for tag in events.Tags()["images"]:
        for event in events.Images(tag):
            out[tag][event.step].append((event.width, event.height))
    return out


def wandb_images(run: Path) -> dict[str, dict[int, list[tuple[int, int]]]]:
    """Each image in the W&B record logs: ``{name: {step: [(width, height)]}}``."""
    out: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for log in _wandb_logs(run):
        # an image's fields come flattened: NAME/_type = "image-file", NAME/width, NAME/height, …
        for items in _history_items(log):
            for key, value in items.items():
                if key.endswith("/_type") and value == "image-file":
                    name = key.removesuffix("/_type")
                    out[name][int(items["_step"])].append((items[f"{name}/width"], items[f"{name}/height"]))
    return out


def mlflow_artifacts(run: Path, run_id: str, folder: str) -> list[str]:
    """The paths of run ``run_id``'s artifacts under ``folder``."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    return sorted(f.path for f in client.list_artifacts(run_id, folder))
