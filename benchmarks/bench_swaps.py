"""What one weight swap costs on this machine: publish + load of a policy snapshot for the
shipped configs' students, by every route the runs use.

For each config, its student's parameters (the weights themselves where they ship —
``builtin:`` students — random ones at the real shapes of a model planned from
``asyncopd_jax/scale/architectures/``, e.g. Qwen3-1.7B) in ``student.dtype`` go through:

* ``in-memory``: :class:`~asyncopd_jax.pipeline.snapshots.InMemorySnapshotStore` onto another
  device (a second XLA:CPU device here): the ``threads`` placement's device-to-device
  hand-over;
* ``orbax`` and ``safetensors`` on disk: :class:`~asyncopd_jax.pipeline.snapshots.DiskSnapshotStore`
  ``publish`` + ``flush`` (written and committed), then a read-only store's ``load`` in
  the same process (the stage processes' route), under ``--dir`` (default: the working
  directory's disk).

It prints each route's seconds (the median of ``--repeats`` after one warm-up) and GB/s,
against the rate ``asyncopd plan`` assumes for storage (``--storage-gbps``, default 1 GB/s)
and the in-memory rate of the chips it plans for: a plan's swap is this arithmetic at
the topology's rates (``asyncopd_jax/scale/swaps.py``)::

    python benchmarks/bench_swaps.py
    python benchmarks/bench_swaps.py --configs demo qwen3_1.7b_from_8b_v5e16 --repeats 3
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # a device to hand over to

import argparse
import tempfile
from pathlib import Path

import jax
from bench_sampler import timed  # this directory: run as a script, as every benchmark is
from flax import nnx

from asyncopd_jax.config import load_config
from asyncopd_jax.models.decoder import Decoder
from asyncopd_jax.pipeline.model_loading import load_model_and_tokenizer
from asyncopd_jax.pipeline.snapshots import DiskSnapshotStore, InMemorySnapshotStore
from asyncopd_jax.scale.learner_inputs import architecture
from asyncopd_jax.scale.swaps import total_bytes

CONFIGS = ["demo", "long_tailed", "rl", "qwen3_0.6b_from_4b_v6e8", "qwen3_1.7b_from_8b_v5e16"]


def student_params(config: str) -> tuple[nnx.State, str]:
    """A config's student parameters: its own weights where they are here, else random
    ones at the real shapes of the architecture it names."""
    cfg = load_config(config)
    if cfg.student.path.startswith("builtin:") or Path(cfg.student.path).is_dir():
        model, _ = load_model_and_tokenizer(cfg.student.path, cfg.student.dtype)
        return nnx.split(model)[1], cfg.student.path
    shape, source = architecture(cfg.student)
    model = Decoder(shape, rngs=nnx.Rngs(0), dtype=cfg.student.dtype)
    return nnx.split(model)[1], f"random weights at {source}"


def swap_seconds(params: nnx.State, root: Path, repeats: int) -> dict[str, float]:
    """Seconds of one publish + load by each route (module docstring)."""
    other = jax.devices()[1]
    target = jax.tree_util.tree_map(lambda _: jax.sharding.SingleDeviceSharding(other), params)
    memory = InMemorySnapshotStore(keep=2, shardings=target)
    version = iter(range(1_000_000))

    def in_memory() -> None:
        v = next(version)
        memory.publish(v, params)
        jax.block_until_ready(memory.load(v)[1])

    out = {"in-memory": timed(in_memory, repeats)}
    for fmt in ("orbax", "safetensors"):
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            writer = DiskSnapshotStore(tmp, params, keep=2, format=fmt)
            reader = DiskSnapshotStore(tmp, params, read_only=True, format=fmt)

            def through_storage(writer: DiskSnapshotStore = writer, reader: DiskSnapshotStore = reader) -> None:
                v = next(version)
                writer.publish(v, params)
                writer.flush()
                jax.block_until_ready(reader.load(v)[1])

            out[fmt] = timed(through_storage, repeats)
            writer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=CONFIGS, help="configs whose students to swap")
    parser.add_argument("--repeats", type=int, default=5, help="timed swaps per route (after a warm-up)")
    parser.add_argument("--dir", default=".", help="where the snapshots are written (a disk, or /dev/shm)")
    parser.add_argument("--storage-gbps", type=float, default=1.0, help="the storage rate asyncopd plan assumes")
    args = parser.parse_args()
    root = Path(args.dir).resolve()
    print(
        f"publish + load of one version, medians of {args.repeats} | jax {jax.__version__}, {os.cpu_count()} cores, "
        f"snapshots under {root} | asyncopd plan assumes {args.storage_gbps:g} GB/s through storage"
    )
    print(f"{'config':<28}{'MB':>9}{'route':>13}{'seconds':>10}{'GB/s':>8}{'/ plan':>8}  student")
    for config in args.configs:
        params, what = student_params(config)
        size = total_bytes(params)
        for route, seconds in swap_seconds(params, root, args.repeats).items():
            rate = size / seconds / 1e9
            versus = f"{rate / args.storage_gbps:>8.2f}" if route != "in-memory" else f"{'-':>8}"
            print(f"{config:<28}{size / 1e6:>9.1f}{route:>13}{seconds:>10.4f}{rate:>8.2f}{versus}  {what}")
        del params


if __name__ == "__main__":
    main()
