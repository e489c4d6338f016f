"""A LoRA student's weights channel: its frozen base once, then each version's adapters alone.

The learner of a LoRA student trains the adapters only (``…lora_a``, ``…lora_b``), so every
other weight of every version is the base's. :class:`AdapterSnapshots` is a
:class:`~asyncopd_jax.pipeline.snapshots.SnapshotStore` over two stores of the channel:

    publish(v, params)   the first time, the base (every weight but the adapters) as version
                         0 of the base store, committed before any adapters are; then the
                         adapters of ``v`` as version ``v`` of the adapter store
    load(v)              the adapters of ``v`` joined with the base (read once, then kept)

so a version ships the adapters' bytes (rank 16 on a Qwen3-1.7B-shaped student: about 1 %
of the full version, ``asyncopd plan`` prints it) and a reader sees the same whole student
a full snapshot gives it. Stored channels keep the adapters as objects
(:class:`~asyncopd_jax.pipeline.object_snapshots.ObjectSnapshotStore`) in every format:
each version's record carries its bytes and digest, checked at every load, so a corrupted
adapter stops the reader in one line naming the version and the stage. The base goes in
the channel's own format (a multi-process learner's Orbax shards, a flat file, objects).

:class:`MergedAtSwap` is a rollout stage's view of such a channel when the sampler decodes
merged weights (``student.lora.sampler = merged``): each version, once loaded, is folded
into the base (``W + (α/r)·A B``, :func:`~asyncopd_jax.models.lora.merged_state`) by one
compiled function before the stream swaps it in, always from the base, so versions never
accumulate rounding. The sampler then holds the base and the merged weights (twice the
adapted kernels) and decodes a plain model; unmerged, it holds one copy and pays two thin
matrix products per projection per token. ``benchmarks/bench_lora_sampler.py`` measures
both (docs/lora.md).

A swap is never partial in either form: a load builds the new weights whole (read, digest
checked, joined or merged, on the devices) and only then hands them to the stream, whose
weights are replaced by one assignment; a sampler killed on the way has sampled nothing
from them.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
from flax import nnx

from asyncopd_jax.models.lora import join, merged_state, split_adapters, without_adapters
from asyncopd_jax.pipeline.snapshots import SnapshotStore

BASE_VERSION = 0  # the base store holds one version


class AdapterSnapshots:
    """The :class:`SnapshotStore` of a LoRA student over ``base`` and ``adapters`` (the
    module docstring); readers and the writer of one channel open the same two stores."""

    def __init__(self, base: SnapshotStore, adapters: SnapshotStore):
        self.base, self.adapters = base, adapters
        self._base_published = False
        self._base_state: nnx.State | None = None  # reader: the base, read once
        self._last: tuple[int, nnx.State] | None = None

    # --- writer side --------------------------------------------------------------------

    def publish(self, version: int, params: nnx.State) -> None:
        trained, frozen = split_adapters(params)
        if not self._base_published:
            self.base.publish(BASE_VERSION, frozen)
            self.base.flush()  # committed before any version that needs it
            self._base_published = True
        self.adapters.publish(version, trained)

    def flush(self) -> None:
        self.adapters.flush()

    @property
    def last_published(self) -> dict[str, int]:
        """The adapters' record of the last committed version (``snapshot_bytes``: its
        adapters alone), with ``snapshot_base_bytes``, what the base took once."""
        record = dict(self.adapters.last_published)
        base = self.base.last_published.get("snapshot_bytes")
        return record if not record or base is None else {**record, "snapshot_base_bytes": base}

    # --- reader side --------------------------------------------------------------------

    def latest_version(self) -> int | None:
        return self.adapters.latest_version()

    def wait_for(self, version: int, timeout: float = 300.0) -> None:
        self.adapters.wait_for(version, timeout)

    def load(self, version: int | None = None) -> tuple[int, nnx.State]:
        """The whole student of ``version`` (default: the newest): its adapters joined with
        the base; the version read last is returned again without a read."""
        chosen, trained = self.adapters.load(version)
        if self._last is not None and self._last[0] == chosen:
            return self._last
        if self._base_state is None:
            self._base_state = self.base.load(BASE_VERSION)[1]
        self._last = (chosen, join(trained, self._base_state))
        return self._last

    def close(self) -> None:
        self.adapters.close()
        self.base.close()


class MergedAtSwap:
    """A rollout stage's view of a LoRA student's versions, each merged into its base once,
    when it is loaded (the module docstring); ``scale``: α / r."""

    def __init__(self, store: SnapshotStore, scale: float):
        self.store, self.scale = store, scale
        self._merge: Any = None  # compiled at the first load, for the shardings of the base
        self._last: tuple[int, nnx.State] | None = None
        self.last_merge_s = 0.0  # seconds the last merge took (compilation included, the first time)

    @property
    def last_published(self) -> dict[str, int]:
        return self.store.last_published

    def publish(self, version: int, params: nnx.State) -> None:
        raise RuntimeError("a sampler's merged view of the snapshots is read-only")

    def flush(self) -> None:
        self.store.flush()

    def latest_version(self) -> int | None:
        return self.store.latest_version()

    def wait_for(self, version: int, timeout: float = 300.0) -> None:
        self.store.wait_for(version, timeout)

    def load(self, version: int | None = None) -> tuple[int, nnx.State]:
        chosen, state = self.store.load(version)
        if self._last is not None and self._last[0] == chosen:
            return self._last
        start = time.perf_counter()
        if self._merge is None:  # each merged kernel lies as its base does
            shardings = jax.tree_util.tree_map(lambda x: x.sharding, without_adapters(state))
            self._merge = jax.jit(functools.partial(merged_state, scale=self.scale), out_shardings=shardings)
        merged = jax.block_until_ready(self._merge(state))  # whole before the stream sees it
        self.last_merge_s = time.perf_counter() - start
        self._last = (chosen, merged)
        return self._last

    def close(self) -> None:
        self.store.close()
