"""The learner over several processes or hosts, on JAX's own multi-controller runtime.

Every learner process runs the same program (SPMD). ``jax.distributed.initialize``
joins them; from then on ``jax.devices()`` lists the devices of *all* processes, so the
learner's :func:`~asyncopd_jax.learner.sharding.make_mesh` is a global mesh, the
parameters and optimizer state are FSDP-sharded across hosts, and the train step is one
jitted computation whose collectives cross process boundaries (ICI / DCN on TPU, NCCL
on GPU, gloo on CPU).

Each process feeds only its own rows of a batch (:func:`process_rows`,
:func:`global_batch`): ``jax.make_array_from_process_local_data`` stitches the local
rows into one global ``jax.Array`` whose shards stay where they were loaded. Orbax
checkpoints of such arrays are written and restored by all processes together (each
writes its own shards): into the one run directory every host sees, or, for a run in a
bucket, each into its own staging copy, uploaded as its part
(:class:`~asyncopd_jax.pipeline.run_outputs.RunDir`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from asyncopd_jax.config import DistributedConfig
from asyncopd_jax.learner.sharding import batch_shardings


def initialize(cfg: DistributedConfig) -> bool:
    """Join the other learner processes when ``cfg.initialize``; return whether this is a
    multi-process run. Call it before anything else uses JAX (it fixes the device list)."""
    if not cfg.initialize:
        return False
    kwargs: dict[str, Any] = {
        "initialization_timeout": cfg.initialization_timeout,
        "heartbeat_timeout_seconds": cfg.heartbeat_timeout,
    }
    if cfg.coordinator_address:
        kwargs["coordinator_address"] = cfg.coordinator_address
    if cfg.num_processes:
        kwargs["num_processes"] = cfg.num_processes
    if cfg.process_id >= 0:
        kwargs["process_id"] = cfg.process_id
    jax.distributed.initialize(**kwargs)
    return jax.process_count() > 1


def is_leader() -> bool:
    """Process 0 writes what exists once per run: metrics, traces, the distilled student."""
    return jax.process_index() == 0


def process_rows(rows: int, process: int | None = None, processes: int | None = None) -> slice:
    """The contiguous rows of a ``rows``-row global batch that ``process`` feeds.

    Devices of a mesh built from ``jax.devices()`` are ordered process by process, and the
    batch axis is split over all of them in that order (``batch_shardings``), so process
    ``p`` of ``P`` holds rows ``[p·rows/P, (p+1)·rows/P)``.
    """
    process = jax.process_index() if process is None else process
    processes = jax.process_count() if processes is None else processes
    if rows % processes:
        raise ValueError(
            f"a batch of {rows} rows does not split evenly over {processes} learner processes; "
            "make learner.batch_size / learner.mini_batches a multiple of the process count"
        )
    share = rows // processes
    return slice(process * share, (process + 1) * share)


def global_batch(local: Any, mesh: Mesh) -> Any:
    """This process's rows of every leaf (``[B/P, ...]``) → global arrays (``[B, ...]``)
    split over the mesh's batch axes; scalars are replicated."""
    shardings = batch_shardings(local, mesh)
    return jax.tree_util.tree_map(
        lambda x, s: jax.make_array_from_process_local_data(s, np.asarray(x)), local, shardings
    )


def from_leader(value: Any) -> Any:
    """``value`` as process 0 has it, on every process (a collective: all must call)."""
    if jax.process_count() == 1:
        return value
    out = multihost_utils.broadcast_one_to_all(np.asarray(value))
    return out.item() if np.ndim(value) == 0 and not isinstance(value, np.ndarray) else np.asarray(out)


def barrier(name: str) -> None:
    """Wait until every process gets here (no-op in one process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def gather(tree: Any) -> Any:
    """Every leaf as a whole NumPy array on every process (for evaluation and export;
    the leaves may be sharded over devices of other processes)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


__all__ = ["barrier", "from_leader", "gather", "global_batch", "initialize", "is_leader", "process_rows"]
