"""Write rollouts and teacher score caches to disk with tensorstore, and read them back.

One directory per batch; one zarr array per non-empty field, plus ``fields.json`` naming
the class and its fields. Used for offline teacher scoring (score once, train many
times) and for inspecting what the teacher stored.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, TypeVar, cast

import jax
import numpy as np
import tensorstore as ts

from asyncopd_jax.cache import RolloutBatch, StudentLogProbs, TeacherScoreCache

_CLASSES = {cls.__name__: cls for cls in (RolloutBatch, TeacherScoreCache, StudentLogProbs)}
T = TypeVar("T", RolloutBatch, TeacherScoreCache, StudentLogProbs)


def _spec(path: Path, array: np.ndarray | None = None) -> dict:
    spec: dict = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(path)}}
    if array is not None:
        spec["metadata"] = {"shape": list(array.shape), "dtype": _zarr_dtype(array.dtype)}
    return spec


def _zarr_dtype(dtype: np.dtype) -> str:
    return "bfloat16" if dtype.name == "bfloat16" else np.dtype(dtype).str


def save_arrays(obj: RolloutBatch | TeacherScoreCache | StudentLogProbs, path: str | Path) -> None:
    """Write every non-None field of ``obj`` as a zarr array under ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    fields = {}
    writes = []
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if value is None:
            continue
        array = np.asarray(jax.device_get(value))
        store = ts.open(_spec(path / field.name, array), create=True, delete_existing=True).result()
        writes.append(store.write(array))
        fields[field.name] = {"shape": list(array.shape), "dtype": str(array.dtype)}
    for write in writes:
        write.result()
    # Written last: a directory without fields.json is an incomplete write.
    (path / "fields.json").write_text(json.dumps({"class": type(obj).__name__, "fields": fields}, indent=2))


def load_arrays(path: str | Path, cls: type[T] | None = None) -> T:
    """Read back what :func:`save_arrays` wrote (as numpy arrays)."""
    path = Path(path)
    meta_file = path / "fields.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{meta_file} is missing: not a saved cache, or an incomplete write")
    meta = json.loads(meta_file.read_text())
    saved_cls = _CLASSES[meta["class"]]
    if cls is not None and cls is not saved_cls:
        raise ValueError(f"{path} holds a {meta['class']}, not a {cls.__name__}")
    # numpy arrays where the classes say jax.Array: both are array pytree leaves
    values: dict[str, Any] = {name: ts.open(_spec(path / name)).result().read().result() for name in meta["fields"]}
    return cast(T, saved_cls(**values))
