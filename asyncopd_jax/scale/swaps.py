"""Weight swaps in a plan: what one published policy version costs the learner that
publishes it and each sampler that loads it, on a topology's links.

A run publishes one version per rollout batch (``pipeline/trainer.py``: after the batch's
M optimizer steps), and every rollout stage loads it between two engine calls
(``pipeline/rollout_loop.py``) and then, where generation is interruptible, rewrites its live
sequences' KV cache under the new weights (the sampler's ``recompute``, which the plan
compiles with the sampler). The run's snapshot channel (``pipeline/layout.py:
snapshot_channel``) decides the route:

* **in memory** (``threads`` placement): ``jax.device_put`` of the learner's parameters
  onto the sampler's shardings. Each sampler chip receives its own shard over its links:
  ``bytes per sampler chip / (interconnect / 2)``; the learner's chips send one copy per
  sampler: ``samplers · bytes / learner chips / (interconnect / 2)``, counted against the
  learner (the copy reads the buffers the next step donates).
* **through storage** (stage processes): the learner writes the version (Orbax's shards or
  one safetensors file) and every rollout process reads all of it back, each at
  ``storage_bytes_per_s``: a setting (``asyncopd plan --storage-gbps``), since a pod's
  storage is not this machine's; ``benchmarks/bench_swaps.py`` measures this machine's.
  The write is counted against the learner in full, an upper bound: Orbax writes in the
  background and the learner waits for it only at the next publish.

Bytes are those of the published parameters: ``stages.snapshot_dtype`` (auto: the
learner's master copy, ``student.dtype``), which the sampler casts to
``sampling.compute_dtype`` inside its programs. Through
storage the plan also prints what a version costs as sparse deltas (``objects``: a full
version every N, deltas between at :data:`DELTA_FRACTION` of it); the balance keeps the
full version's seconds, an upper bound.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from asyncopd_jax.models.lora import adapted_kernels, split_adapters
from asyncopd_jax.pipeline.layout import SnapshotChannel
from asyncopd_jax.scale.chips import Chip

DEFAULT_STORAGE_BYTES_PER_S = 1e9  # --storage-gbps 1: a cloud VM's persistent disk or object store, roughly
# A sparse delta's bytes against its full version: measured for a Qwen3-0.6B-shaped model
# published as bf16 at lr 1e-6 (4.05 %; 15.2 % at lr 1e-5), benchmarks/bench_delta_sync.py,
# docs/storage.md. The fraction grows with the learning rate and with the published dtype's
# width (fp32 weights change everywhere: no delta then).
DELTA_FRACTION = 0.0405
DELTA_FULL_EVERY = 10  # stages.snapshot_full_every's default, for channels that publish no deltas


def bytes_per_device(tree: Any) -> int:
    """The bytes the busiest device holds of ``tree``: ``ShapeDtypeStruct`` s (or arrays)
    placed by their ``sharding`` (none: whole on one device)."""
    held: dict[Any, int] = {}
    for x in jax.tree_util.tree_leaves(tree):
        sharding = getattr(x, "sharding", None)
        size = np.dtype(x.dtype).itemsize
        if sharding is None:
            held[None] = held.get(None, 0) + math.prod(x.shape) * size
            continue
        for device, index in sharding.devices_indices_map(tuple(x.shape)).items():
            shard = math.prod(len(range(*i.indices(n))) for i, n in zip(index, x.shape))
            held[device] = held.get(device, 0) + shard * size
    return max(held.values(), default=0)


def total_bytes(tree: Any) -> int:
    """The bytes of ``tree``'s arrays, each counted once."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


@dataclasses.dataclass(frozen=True)
class SwapFigures:
    """One published version's cost, at the roofline of the links it travels over.

    ``publish_seconds`` delays the learner once per version; ``load_seconds`` delays each
    sampler once per version, before its recompute."""

    route: str
    published_bytes: int  # the version: every parameter, in the published dtype
    reader_chip_bytes: int  # what the busiest sampler chip receives (in memory) or a sampler process reads
    publish_seconds: float
    load_seconds: float
    # through storage: the mean bytes a version costs as sparse deltas with a full version
    # every ``delta_full_every`` (at DELTA_FRACTION), and the seconds each way; None in
    # memory, and for 32-bit weights (every element changes: a delta is the whole version)
    delta_bytes: float | None = None
    delta_seconds: float | None = None
    delta_full_every: int = DELTA_FULL_EVERY
    # a LoRA student: the whole student's bytes (its versions ship what trains alone, the
    # frozen base once), and the seconds of a merge into the sampler's weights (in load_seconds)
    full_bytes: int = 0
    merge_seconds: float = 0.0

    def describe(self) -> str:
        shipped = f"{_gb(self.published_bytes)} published"
        if self.full_bytes > self.published_bytes:
            shipped += (
                f" (what trains alone, the adapters and any modules_to_save: "
                f"{100 * self.published_bytes / self.full_bytes:.2f} % of the full version's "
                f"{_gb(self.full_bytes)}, whose frozen base ships once)"
            )
        merge = f", {self.merge_seconds:.3f} s of it merging them into its weights" if self.merge_seconds else ""
        line = (
            f"a weight swap per published version ({self.route}): {shipped}, "
            f"learner {self.publish_seconds:.3f} s, each sampler {self.load_seconds:.3f} s to load "
            f"({_gb(self.reader_chip_bytes)}{merge})"
        )
        if self.route.startswith("in memory") or self.full_bytes > self.published_bytes:
            return line  # (adapters: no delta figure measured)
        if self.delta_bytes is None or self.delta_seconds is None:
            return (
                f"{line}; sparse deltas would save nothing (32-bit weights change in every element each step; "
                "stages.snapshot_dtype: bfloat16 publishes them as bf16)"
            )
        return (
            f"{line}; as sparse deltas (stages.snapshot_format: objects, a full version every "
            f"{self.delta_full_every}, deltas at {100 * DELTA_FRACTION:.2f} % of it): {self.delta_bytes / 1e9:.3f} GB "
            f"and {self.delta_seconds:.3f} s each way per version on average"
        )


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e9:.4f} GB"


def swap_figures(
    channel: SnapshotChannel,
    params: Any,
    sampler_params: Any,
    *,
    learner_chips: int,
    samplers: int,
    chip: Chip,
    storage_bytes_per_s: float = DEFAULT_STORAGE_BYTES_PER_S,
    merge: bool = False,
) -> SwapFigures:
    """The cost of one version on ``channel`` (module docstring).

    A LoRA student's versions ship its adapters alone (``pipeline/adapter_snapshots.py``: the
    base once); ``merge``: each sampler then folds them into its weights, reading and
    writing every adapted kernel at its chip's memory bandwidth.

    Args:
      params: the published parameters (``ShapeDtypeStruct`` s; their shardings unused).
      sampler_params: the same, placed as one sampler receives them (its mesh's shardings).
      learner_chips: the chips that send an in-memory copy.
      samplers: rollout stages, each loading every version.
      chip: the topology's chip (its interconnect).
      storage_bytes_per_s: the storage route's rate, each way.
    """
    shipped, received = split_adapters(params)[0], split_adapters(sampler_params)[0]
    published, full = total_bytes(shipped), total_bytes(params)
    merge_seconds = 2 * bytes_per_device(adapted_kernels(sampler_params)) / chip.hbm_bytes_per_s if merge else 0.0
    if channel.in_memory:
        per_chip = bytes_per_device(received)
        rate = chip.copy_bytes_per_s
        return SwapFigures(
            route="in memory: device to device over the chips' links",
            published_bytes=published,
            reader_chip_bytes=per_chip,
            publish_seconds=samplers * published / learner_chips / rate,
            load_seconds=per_chip / rate + merge_seconds,
            full_bytes=full,
            merge_seconds=merge_seconds,
        )
    every = channel.full_every if channel.format == "objects" else DELTA_FULL_EVERY
    # 32-bit weights move in every element each step: a delta would be the whole version
    narrow = all(np.dtype(x.dtype).itemsize <= 2 for x in jax.tree_util.tree_leaves(shipped))
    delta = published * (1 + (every - 1) * DELTA_FRACTION) / every if narrow and published == full else None
    return SwapFigures(
        route=f"{channel.format} through storage at {storage_bytes_per_s / 1e9:.2f} GB/s",
        published_bytes=published,
        reader_chip_bytes=published,
        publish_seconds=published / storage_bytes_per_s,
        load_seconds=published / storage_bytes_per_s + merge_seconds,
        delta_bytes=delta,
        delta_seconds=None if delta is None else delta / storage_bytes_per_s,
        delta_full_every=every,
        full_bytes=full,
        merge_seconds=merge_seconds,
    )
