"""Where each stage runs, decided once: from the config and this host's cores and devices.

A run has four kinds of stage: the *learner*, *rollout* stages (sample groups; the task's
reward is computed there), *scoring* stages (the teacher's score cache, the reference's
log-probs). :func:`plan_layout` turns the config into a :class:`Layout`: every stage with
its devices, its CPU cores and the process that hosts it, plus the weights channel
(in memory, or snapshots on disk). Everything else asks the layout; nothing else reads
``stages.placement``.

    threads    every stage in the learner's process, each on its own devices when
               ``stages.<role>_devices`` say so (e.g. the learner on chips 0-3, rollout and
               scoring on 4-7); rollout threads score their groups in the scoring stage.
    processes  each rollout / scoring stage in its own process (``asyncopd stage``), its
               devices made visible by the platform's own mechanism and pinned to its
               cores (:mod:`asyncopd_jax.pipeline.host_env`); without scoring processes
               each rollout process scores.

Device lists count this host's accelerators (or its CPU devices, e.g. the 8 virtual ones
of ``--xla_force_host_platform_device_count=8``) in ``jax.local_devices()`` order. Which
devices a stage computes on is decided here once (:func:`device_ids`, which the plan asks)
and mapped onto a process's own devices once (:func:`local_device_ids`, which the run asks).

This module starts no JAX: the ``asyncopd`` command plans the layout, and sets each
process's device variables from it (:mod:`asyncopd_jax.pipeline.host_env`), before JAX starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from asyncopd_jax.config import MeshConfig
from asyncopd_jax.storage import is_url, join

if TYPE_CHECKING:
    from asyncopd_jax.config import IdList, RunConfig, StagesConfig

Role = Literal["learner", "rollout", "scoring"]
Placement = Literal["threads", "processes"]
LEARNER_PROCESS = "learner"
# The layout written for stage processes carries this number; a stage of another version
# refuses it (a stage started by hand from another checkout of the project).
LAYOUT_VERSION = 3  # 2: the learner's mesh (learner_mesh); 3: snapshots.full_every

# The learner's share of the cores when they are split automatically: the demo's stage
# times on one pinned core are 23 ms (learn + publish) against 40 ms (rollout + scoring)
# per batch of 32, so the learner gets 23 / 63 ≈ 0.37 of them (at least one core).
LEARNER_SHARE = 0.37
# The same measurement split between sampling and scoring, for scoring processes.
SCORING_SHARE = 0.55
# ``auto`` pins only when every process gets at least this many cores. On this project's
# 2-core machine, pinning the learner and one rollout process to a core each made the demo
# (batch 64) run at 291 samples/s against 558 unpinned: a process on one core loses XLA's
# intra-op parallelism, while unpinned processes take the cores the other stage leaves idle.
MIN_CORES_TO_PIN = 2


class LayoutError(ValueError):
    """A layout file that this version of the project cannot run."""


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """One stage: its role and number, the devices and cores it owns, and its process.

    ``devices``: indices into this host's devices (``()``: see :func:`device_ids`, the one
    place that says what it means). ``cores``: CPU cores its process is pinned to (``()``:
    unpinned).
    """

    role: Role
    index: int
    process: str
    devices: tuple[int, ...] = ()
    cores: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


@dataclasses.dataclass(frozen=True)
class SnapshotChannel:
    """How weights travel from the learner to the rollout stages.

    ``in_memory``: a device-to-device copy inside the learner's process; otherwise
    versioned snapshots under ``directory`` in ``format`` (``orbax``, ``safetensors`` or
    ``objects``), of which ``keep`` are kept; ``temporary``: the directory is removed after
    the run (RAM-backed ``/dev/shm``; the checkpoints are the record); ``full_every``:
    ``objects`` publishes a full version every this many, sparse deltas in between.
    """

    in_memory: bool
    directory: str
    format: str
    keep: int
    temporary: bool
    full_every: int = 1


@dataclasses.dataclass(frozen=True)
class Layout:
    """Every stage of a run and the channels between them (written to a stage process as
    ``exchange/layout.json``: :meth:`to_json` / :meth:`from_json`)."""

    placement: Placement
    stages: tuple[StagePlan, ...]
    snapshots: SnapshotChannel
    group_size: int  # samples per rollout group
    seed: int  # of rollout group i's prompts and keys (with i)
    trace_origin: float  # the clock every process's trace spans count from
    # learner.mesh as (data, fsdp, tensor): how many of its devices the learner's mesh takes
    learner_mesh: tuple[int, int, int] = (-1, 1, 1)
    version: int = LAYOUT_VERSION

    def of_role(self, role: Role) -> tuple[StagePlan, ...]:
        return tuple(s for s in self.stages if s.role == role)

    @property
    def learner(self) -> StagePlan:
        return self.of_role("learner")[0]

    def stage(self, name: str) -> StagePlan:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"no stage {name!r} in this layout; stages: {', '.join(s.name for s in self.stages)}")

    def stage_processes(self) -> tuple[StagePlan, ...]:
        """The stages that run as processes of their own (started by the learner)."""
        return tuple(s for s in self.stages if s.process == s.name)

    def hosted_by(self, process: str) -> tuple[StagePlan, ...]:
        """The stages process ``process`` runs. A stage process started by hand on another
        host (``launch/stage_host.sh``: ``rollout-100``, …) runs what its role's first process
        runs, with no device list: on every device it sees (:func:`device_ids`)."""
        hosted = tuple(s for s in self.stages if s.process == process)
        if hosted or process == LEARNER_PROCESS:
            return hosted
        role = process.rsplit("-", 1)[0]
        first = [s for s in self.stages if s.process == f"{role}-0"]
        if not first:
            raise KeyError(
                f"no stage runs in process {process!r}, and none in {role}-0; processes: "
                f"{', '.join(s.process for s in self.stage_processes())}"
            )
        return tuple(dataclasses.replace(s, process=process, devices=()) for s in first)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str, source: str = "layout") -> Layout:
        data = json.loads(text)
        if data.get("version") != LAYOUT_VERSION:
            raise LayoutError(
                f"{source} has layout version {data.get('version')!r}; this asyncopd reads version "
                f"{LAYOUT_VERSION} (start the stage from the learner's checkout of the project)"
            )
        try:
            stages = tuple(
                StagePlan(**{**s, "devices": tuple(s["devices"]), "cores": tuple(s["cores"])})
                for s in data.pop("stages")
            )
            channel = SnapshotChannel(**data["snapshots"])
            return cls(**{**data, "stages": stages, "snapshots": channel, "learner_mesh": tuple(data["learner_mesh"])})
        except (KeyError, TypeError) as err:
            raise LayoutError(f"{source} is not a layout of this version: {err}") from None


# --- what the config decides ----------------------------------------------------------------


def split_ids(ids: Sequence[int], parts: int) -> list[tuple[int, ...]]:
    """Split ``ids`` into ``parts`` contiguous shares (cycling when there are fewer ids)."""
    if not ids or parts == 0:
        return [()] * parts
    if parts >= len(ids):
        return [(ids[i % len(ids)],) for i in range(parts)]
    bounds = [round(i * len(ids) / parts) for i in range(parts + 1)]
    return [tuple(ids[bounds[i] : bounds[i + 1]]) for i in range(parts)]


def plan_cores(stages: StagesConfig, available: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """The cores of each role (``learner``, ``rollout``, ``scoring``) before they are
    dealt to the processes, from ``stages`` and the cores this process may use.

    ``auto`` gives the learner the first ``⌈LEARNER_SHARE · n⌉`` cores and the rollout (and
    scoring) processes the rest, when that leaves every process ``MIN_CORES_TO_PIN`` cores
    or more; with fewer cores it leaves them all unpinned (the OS balances them).
    """
    available = tuple(sorted(available))
    n = len(available)
    learner_n = min(max(1, math.ceil(LEARNER_SHARE * n)), n)
    rest = available[learner_n:] or available
    scoring_n = math.ceil(SCORING_SHARE * len(rest)) if stages.scoring_processes and len(rest) > 1 else 0
    auto = {
        "learner": available[:learner_n],
        "rollout": rest[: len(rest) - scoring_n] if scoring_n else rest,
        "scoring": rest[len(rest) - scoring_n :] if scoring_n else rest,
    }
    processes = {"learner": 1, "rollout": stages.rollouts, "scoring": stages.scoring_processes}
    if any(len(auto[role]) < MIN_CORES_TO_PIN * count for role, count in processes.items() if count):
        auto = {role: () for role in auto}  # too few cores to split: every "auto" stage unpinned

    configured = {role: stages.cores(role) for role in auto}  # None: auto
    return {role: auto[role] if ids is None else ids for role, ids in configured.items()}


def default_snapshot_dir(run_path: Path) -> Path:
    """RAM-backed ``/dev/shm`` when the host has it (publishing costs a memory copy), else
    ``<run>/snapshots``."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        tag = hashlib.sha1(str(run_path.resolve()).encode()).hexdigest()[:10]  # stable across processes
        return shm / f"asyncopd-{os.getuid()}-{run_path.name}-{tag}"
    return run_path / "snapshots"


def snapshot_channel(cfg: RunConfig, run_path: str | Path, multi_process: bool) -> SnapshotChannel:
    """The weights channel. A version is published once per rollout batch (M optimizer
    steps), so the versions a rollout may still start from span ⌈η / M⌉ + 1; one more is in
    flight. ``run_path``: the run directory, a path or a bucket URL; a run in a bucket keeps
    its snapshots there (its stage processes may share nothing else), as objects."""
    keep = -(-cfg.eta // cfg.learner.mini_batches) + 2
    in_process = cfg.stages.placement == "threads"
    if in_process and cfg.stages.snapshot_in_memory and not multi_process:
        return SnapshotChannel(in_memory=True, directory="", format="", keep=keep, temporary=False)
    configured = cfg.stages.snapshot_dir
    in_bucket = is_url(configured) or (configured == "auto" and is_url(run_path))
    temporary = configured == "auto" and not in_process and not multi_process and not in_bucket
    if temporary:
        directory = str(default_snapshot_dir(Path(run_path)))
    else:
        directory = join(run_path, "snapshots") if configured == "auto" else configured
    fmt = cfg.stages.snapshot_format
    if fmt == "auto":  # objects in a bucket; a flat file when one process holds every parameter; Orbax's shards else
        fmt = "objects" if in_bucket else "orbax" if multi_process else "safetensors"
    return SnapshotChannel(
        in_memory=False,
        directory=directory,
        format=fmt,
        keep=keep,
        temporary=temporary,
        full_every=cfg.stages.snapshot_full_every,
    )


def plan_layout(
    cfg: RunConfig,
    *,
    run_path: str | Path,
    available_cores: Sequence[int],
    multi_process: bool = False,
    trace_origin: float | None = None,
) -> Layout:
    """Every stage of the run: its devices, cores and process; and the weights channel.

    ``available_cores``: the cores this process may use (``os.sched_getaffinity(0)``, read
    before the learner pins itself); ``multi_process``: the learner spans several processes."""
    stages_cfg = cfg.stages
    n_rollout = cfg.rollout_stages
    learner_devices = stages_cfg.devices("learner")
    rollout_devices, scoring_devices = stages_cfg.devices("rollout"), stages_cfg.devices("scoring")
    if cfg.stages.placement == "threads":
        # One process: every stage in it, each on its own devices ("": the learner's).
        plans = [StagePlan("learner", 0, LEARNER_PROCESS, learner_devices)]
        plans += [StagePlan("rollout", i, LEARNER_PROCESS, rollout_devices) for i in range(n_rollout)]
        if cfg.needs_scoring:  # one scoring stage (one teacher) that every rollout thread calls
            plans.append(StagePlan("scoring", 0, LEARNER_PROCESS, scoring_devices))
    else:
        cores = plan_cores(stages_cfg, available_cores)
        plans = [StagePlan("learner", 0, LEARNER_PROCESS, learner_devices, cores["learner"])]
        rollouts = [
            StagePlan("rollout", i, f"rollout-{i}", d, c)
            for i, (c, d) in enumerate(
                zip(split_ids(cores["rollout"], n_rollout), split_ids(rollout_devices, n_rollout))
            )
        ]
        plans += rollouts
        n_scoring = stages_cfg.scoring_processes
        if n_scoring:
            plans += [
                StagePlan("scoring", j, f"scoring-{j}", d, c)
                for j, (c, d) in enumerate(
                    zip(split_ids(cores["scoring"], n_scoring), split_ids(scoring_devices, n_scoring))
                )
            ]
        elif cfg.needs_scoring:  # each rollout process scores its own groups, on its own devices
            plans += [StagePlan("scoring", r.index, r.process, r.devices, r.cores) for r in rollouts]
    return Layout(
        placement=cfg.stages.placement,
        stages=tuple(plans),
        snapshots=snapshot_channel(cfg, run_path, multi_process),
        group_size=cfg.group_size,
        seed=cfg.seed * 1_000_003,
        trace_origin=time.time() if trace_origin is None else trace_origin,
        learner_mesh=(cfg.learner.mesh.data, cfg.learner.mesh.fsdp, cfg.learner.mesh.tensor),
    )


def device_ids(layout: Layout, stage: StagePlan, count: int, platform: str) -> IdList:
    """The devices ``stage`` computes on, as indices into the ``count`` devices of its host
    (``platform``: ``cpu``, ``gpu`` or ``tpu``). The one decision; the plan asks it, and the
    run asks it through :func:`local_device_ids`.

    * ``stages.<role>_devices`` lists them: those.
    * An empty list in the learner's process: the learner's devices for a rollout or
      scoring stage beside it, every device for the learner.
    * An empty list in a process of its own: every device that process sees, which its
      launcher chose (``CUDA_VISIBLE_DEVICES``, the TPU chip variables, or the XLA:CPU
      device count it was started with). Unrestricted on a GPU or TPU host, that is all
      ``count``; on a CPU, the learner starts its stage processes with one CPU device
      (:func:`~asyncopd_jax.pipeline.host_env.stage_process_env`): a stage is one replica,
      not one on each of, say, 8 virtual CPU devices.

    The learner's devices are those its mesh takes: the first of them when ``learner.mesh``
    has explicit sizes that multiply to fewer (``data: 1`` on 8 devices: device 0).
    """
    learners = stage.role == "learner" or (not stage.devices and stage.process == LEARNER_PROCESS)
    owner = layout.learner if learners else stage
    if owner.devices:
        ids = owner.devices
        if max(ids) >= count:
            raise ValueError(
                f"stages.{owner.role}_devices = {','.join(map(str, ids))} names device {max(ids)}; "
                f"there are {count} (0-{count - 1})"
            )
    else:  # every device; one for a CPU stage process of its own
        ids = (0,) if platform == "cpu" and owner.process != LEARNER_PROCESS else tuple(range(count))
    if learners:
        ids = ids[: MeshConfig(*layout.learner_mesh).devices_used(len(ids))]
    return ids


def launcher_chose_devices(layout: Layout, stage: StagePlan, platform: str) -> bool:
    """Whether ``stage``'s process sees exactly the devices it computes on, because they
    were made visible to it before JAX started: a stage process (started by the learner
    with :func:`~asyncopd_jax.pipeline.host_env.stage_process_env`, or by hand by its
    launcher), or, on a GPU or TPU, the learner's process when stage processes hold devices
    of their own (:func:`~asyncopd_jax.pipeline.host_env.prepare_learner_process`)."""
    if stage.process != LEARNER_PROCESS:
        return True
    learner = layout.learner
    return bool(learner.devices) and bool(layout.stage_processes()) and platform != "cpu"


def local_device_ids(layout: Layout, stage: StagePlan, count: int, platform: str) -> IdList:
    """:func:`device_ids` as indices into the ``count`` devices ``stage``'s own process sees:
    all of them where its launcher made only those visible, else the host's ids unchanged."""
    if launcher_chose_devices(layout, stage, platform):
        return tuple(range(count))
    return device_ids(layout, stage, count, platform)


def describe(layout: Layout) -> list[str]:
    """One line per stage: where it runs (printed by ``asyncopd train``)."""
    return [
        f"  {s.name}: process {s.process}, devices {','.join(map(str, s.devices)) or 'default'}, "
        f"cores {','.join(map(str, s.cores)) or 'any'}"
        for s in layout.stages
    ]
