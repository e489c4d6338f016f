"""The weights channel's two ends, built from the layout: the learner's writing end and a
rollout stage's reading end (:class:`~asyncopd_jax.pipeline.layout.SnapshotChannel` says
how weights travel).

    in memory         a device-to-device copy onto the rollout threads' devices
    stored            versioned snapshots under the channel's directory or bucket, in its
                      format (:class:`~asyncopd_jax.pipeline.snapshots.DiskSnapshotStore`,
                      :class:`~asyncopd_jax.pipeline.object_snapshots.ObjectSnapshotStore`)

A LoRA student's channel holds its base once and each version's adapters
(:class:`~asyncopd_jax.pipeline.adapter_snapshots.AdapterSnapshots`): in memory, two
in-memory stores; stored, ``<dir>/base`` in the channel's format and ``<dir>/adapters`` as
objects, digest-checked. A rollout stage that merges the adapters at the swap reads through
:class:`~asyncopd_jax.pipeline.adapter_snapshots.MergedAtSwap` (:func:`sampler_view`).
"""

from __future__ import annotations

import shutil
from typing import Any

from asyncopd_jax.config import RunConfig
from asyncopd_jax.learner import distributed, state_shardings
from asyncopd_jax.models.lora import has_adapters, split_adapters
from asyncopd_jax.pipeline.adapter_snapshots import AdapterSnapshots, MergedAtSwap
from asyncopd_jax.pipeline.devices import with_shardings
from asyncopd_jax.pipeline.layout import Layout, SnapshotChannel, StagePlan
from asyncopd_jax.pipeline.learner_stage import LearnerStage
from asyncopd_jax.pipeline.model_loading import student_graph
from asyncopd_jax.pipeline.object_snapshots import ObjectSnapshotStore
from asyncopd_jax.pipeline.rollout_stage import rollout_shardings
from asyncopd_jax.pipeline.run_models import RunModels
from asyncopd_jax.pipeline.snapshots import DiskSnapshotStore, InMemorySnapshotStore, SnapshotStore
from asyncopd_jax.storage import is_url, join, open_store


def learner_snapshots(cfg: RunConfig, layout: Layout, learner: LearnerStage, leader: bool) -> SnapshotStore:
    """The learner's end of the weights channel."""
    channel, params = layout.snapshots, learner.state.params
    if channel.in_memory:
        rollout = layout.of_role("rollout")[0]
        shardings = rollout_shardings(cfg, layout, rollout, params)
        if not has_adapters(params):
            return InMemorySnapshotStore(keep=channel.keep, shardings=shardings)
        trained, frozen = split_adapters(shardings)
        return AdapterSnapshots(
            InMemorySnapshotStore(keep=1, shardings=frozen), InMemorySnapshotStore(keep=channel.keep, shardings=trained)
        )
    # Versions left by an earlier incarnation of this run may be newer than the restored
    # policy; rollouts from them would be refused as "future". The learner is the only
    # writer and no reader runs yet, so start from an empty directory.
    if leader:
        if is_url(channel.directory):
            store = open_store(channel.directory)
            for key in store.list(""):
                store.delete(key)
        else:
            shutil.rmtree(channel.directory, ignore_errors=True)
    distributed.barrier("snapshot directory emptied")
    abstract = with_shardings(params, state_shardings(params, learner.mesh))
    return stored_snapshots(channel, abstract, read_only=False, reader="learner")


def reader_snapshots(cfg: RunConfig, layout: Layout, plan: StagePlan, models: RunModels) -> SnapshotStore:
    """A rollout stage's reading end of the stored snapshots: each version restored straight
    into the stage's own shardings."""
    _, abstract = student_graph(cfg, models)
    placed = with_shardings(abstract, rollout_shardings(cfg, layout, plan, abstract))
    return stored_snapshots(layout.snapshots, placed, read_only=True, reader=plan.name)


def sampler_view(cfg: RunConfig, snapshots: SnapshotStore) -> SnapshotStore:
    """What a rollout stage samples from: ``snapshots`` itself, or, when a LoRA student's
    adapters are merged at the swap, each version merged into the base."""
    return MergedAtSwap(snapshots, cfg.student.lora.scale) if cfg.student.lora.merged_at_swap else snapshots


def stored_snapshots(channel: SnapshotChannel, abstract: Any, *, read_only: bool, reader: str) -> SnapshotStore:
    """The stored ``channel``'s end (one writer, many readers) for parameters like
    ``abstract``: a LoRA student's base and adapters apart, every other student whole."""
    if not has_adapters(abstract):
        return _store(channel, channel.format, channel.directory, abstract, read_only, reader)
    trained, frozen = split_adapters(abstract)
    return AdapterSnapshots(
        _store(channel, channel.format, join(channel.directory, "base"), frozen, read_only, reader),
        _store(channel, "objects", join(channel.directory, "adapters"), trained, read_only, reader),
    )


def _store(
    channel: SnapshotChannel, fmt: str, directory: str, abstract: Any, read_only: bool, reader: str
) -> SnapshotStore:
    if fmt == "objects":
        return ObjectSnapshotStore(
            open_store(directory),
            abstract,
            keep=channel.keep,
            read_only=read_only,
            full_every=channel.full_every,
            reader=reader,
        )
    return DiskSnapshotStore(directory, abstract, keep=channel.keep, read_only=read_only, format=fmt)
