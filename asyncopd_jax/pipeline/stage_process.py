"""The main loop of one stage process (``asyncopd stage ROLE --exchange DIR --index I``).

    rollout-i: take a ticket → sample its group from the newest snapshot → score it here
               when a scoring stage shares this process → commit it to scored/ (else sampled/)
    scoring-j: take a sampled group → score it → commit it to scored/

The stages are built from the exchange's config and layout by the same builders the
threads placement uses (:mod:`asyncopd_jax.pipeline.stage`). The process stops when
``STOP`` appears or its parent (the learner) is gone.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from asyncopd_jax.pipeline.heap import HeapTrimmer
from asyncopd_jax.pipeline.placement import pin_this_process
from asyncopd_jax.pipeline.trace import Tracer

if TYPE_CHECKING:
    from asyncopd_jax.pipeline.spool import Claim, Spool

POLL_SECONDS = 0.002  # how often an idle stage looks for work


def run_stage(
    exchange_dir: str | Path,
    role: str,
    index: int,
    cores: Sequence[int] = (),
    parent_pid: int | None = None,
    niceness: int = 0,
) -> int:
    """Run stage process ``role-index`` until the run stops; returns its exit status."""
    if parent_pid is not None:
        # Ctrl-C in a terminal reaches every process of the foreground group. A child of the
        # learner leaves it to the learner, which checkpoints and then stops its stages;
        # exiting here first would race it and end the run as a stage failure instead.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    pin_this_process(cores)
    if niceness:
        os.nice(niceness)
    # Everything that starts JAX comes after the pinning.
    from asyncopd_jax.pipeline.exchange import Exchange

    exchange = Exchange(exchange_dir)
    name = f"{role}-{index}"
    tracer = None
    try:
        cfg, layout = exchange.read()
        tracer = Tracer(origin=layout.trace_origin, process=name)
        work = _StageWork(cfg, layout, name, exchange, tracer)
        devices = sorted(
            {d.id for stage in (work.rollout, work.scoring) if stage is not None for d in stage.mesh.devices.flat}
        )
        print(
            f"{name}: pid {os.getpid()}, niceness {os.nice(0)}, cores {','.join(map(str, cores)) or 'any'}, "
            f"devices {devices}",
            flush=True,
        )

        def should_stop() -> bool:
            return exchange.stopped or (parent_pid is not None and os.getppid() != parent_pid)

        inbox = exchange.tickets if role == "rollout" else exchange.sampled
        outbox = exchange.scored if work.scores else exchange.sampled
        if work.rollout is not None and work.rollout.streams:
            _stream(work, name, inbox, outbox, should_stop, lambda: tracer.dump(exchange.trace_dir / f"{name}.json"))
            return 0
        last_dump = time.monotonic()
        trim_heap = HeapTrimmer()
        while not should_stop():
            trim_heap()
            claim = inbox.claim(name)
            if claim is None:
                time.sleep(POLL_SECONDS)
                continue
            try:
                record = work.process(claim.read())
            except BaseException:
                claim.give_back()  # the group is not lost: a restarted stage takes it again
                raise
            outbox.put(claim.name, record)
            claim.done()
            if time.monotonic() - last_dump > 2.0:
                tracer.dump(exchange.trace_dir / f"{name}.json")
                last_dump = time.monotonic()
        return 0
    except KeyboardInterrupt:
        return 130
    except BaseException:  # noqa: BLE001 - the log is what the learner reports
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    finally:
        if tracer is not None:
            tracer.dump(exchange.trace_dir / f"{name}.json")


def _stream(
    work: _StageWork, name: str, inbox: Spool, outbox: Spool, should_stop: Callable[[], bool], dump: Callable[[], None]
) -> None:
    """A rollout process's continuous engine kept running across tickets
    (:class:`~asyncopd_jax.pipeline.rollout.GroupStreamer`): a ticket is claimed whenever the
    stream has room for more prompts, and each group is scored (when a scoring stage shares
    this process) and committed on a thread of its own while the next chunks decode. A
    claim stays open until its group is committed; on an error every open claim is given
    back, so a restarted stage takes those groups again."""
    from asyncopd_jax.pipeline.rollout import GroupStreamer
    from asyncopd_jax.pipeline.spool import group_to_record
    from asyncopd_jax.pipeline.staleness import PipelineStopped

    assert work.rollout is not None
    rollout = work.rollout
    claims: dict[int, Claim] = {}
    last_dump = [time.monotonic()]
    trim_heap = HeapTrimmer()

    def between_chunks() -> None:
        if should_stop():
            raise PipelineStopped("the run stopped")
        if time.monotonic() - last_dump[0] > 2.0:
            dump()
            last_dump[0] = time.monotonic()
        trim_heap()

    def next_group(block: bool) -> tuple[int, int] | None:
        while True:
            between_chunks()
            claim = inbox.claim(name)
            if claim is not None:
                record = claim.read()
                claims[int(record["index"])] = claim
                return int(record["index"]), int(record.get("min_version", 0))
            if not block:
                return None
            time.sleep(POLL_SECONDS)

    def commit(index: int, group) -> None:
        outbox.put(claims[index].name, group_to_record(rollout.scored(group, index), index))
        claims.pop(index).done()

    try:
        GroupStreamer(rollout.producer).run(next_group, commit, between_chunks, name)
    except PipelineStopped:
        return
    finally:
        for claim in claims.values():
            claim.give_back()


class _StageWork:
    """``process(record) → record`` for the stages hosted by process ``name``."""

    def __init__(self, cfg, layout, name: str, exchange, tracer: Tracer):
        from asyncopd_jax.pipeline import stage
        from asyncopd_jax.pipeline.snapshots import DiskSnapshotStore

        self.seed, self.tracer = layout.seed, tracer
        hosted = [s for s in layout.stages if s.process == name]
        if not hosted:
            # A process started by hand (launch/stage_host.sh: rollout-100, ...) hosts what the
            # role's first process hosts, on every device it sees (its launcher chose them).
            role = name.rsplit("-", 1)[0]
            first = [s for s in layout.stages if s.process == f"{role}-0"]
            if not first:
                raise KeyError(
                    f"no stage runs in process {name!r}, and none in {role}-0; processes: "
                    f"{', '.join(s.process for s in layout.stage_processes())}"
                )
            hosted = [dataclasses.replace(s, process=name, devices=()) for s in first]
        models = stage.run_models(cfg)
        scoring_plan = next((s for s in hosted if s.role == "scoring"), None)
        self.scoring = stage.build_scoring_stage(cfg, layout, scoring_plan, models) if scoring_plan else None
        self.scores = self.scoring is not None
        if (
            scoring_plan is not None
            and self.scoring is not None
            and self.scoring.teacher is not None
            and scoring_plan.index == 0
            and exchange.read_teacher_accuracy() is None
        ):
            from flax import nnx

            exchange.write_teacher_accuracy(models.task.accuracy(*nnx.split(self.scoring.teacher)))
        self.rollout = None
        rollout_plan = next((s for s in hosted if s.role == "rollout"), None)
        if rollout_plan is not None:
            graphdef, abstract = stage.student_graph(cfg, models)
            snapshots = DiskSnapshotStore(
                layout.snapshots.directory,
                stage.with_shardings(abstract, stage.rollout_shardings(cfg, layout, rollout_plan, abstract)),
                read_only=True,
                format=layout.snapshots.format,
            )
            snapshots.wait_for(0, timeout=cfg.stages.startup_timeout)
            self.rollout = stage.build_rollout_stage(
                cfg,
                layout,
                rollout_plan,
                models,
                snapshots=snapshots,
                tracer=tracer,
                scoring=self.scoring,
                graphdef=graphdef,
            )

    def process(self, record: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from asyncopd_jax.pipeline.spool import group_from_record, group_to_record

        if self.rollout is not None:
            index = int(record["index"])
            group = self.rollout.group(index, min_version=int(record.get("min_version", 0)))
            return group_to_record(group, index)
        group, index = group_from_record(record)
        if self.scoring is None:  # not reached: a stage process hosts a rollout stage, a scoring stage or both
            raise RuntimeError("a stage process with neither a rollout nor a scoring stage got a record")
        return group_to_record(self.scoring.score(group, self.seed, index, self.tracer), index)
