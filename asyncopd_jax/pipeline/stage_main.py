"""The main loop of one stage process (``asyncopd stage ROLE --exchange DIR --index I``).

    rollout-i: take a ticket → sample its group from the newest snapshot → score it here
               when a scoring stage shares this process → commit it to scored/ (else sampled/)
    scoring-j: take a sampled group → score it → commit it to scored/

The stages are built from the exchange's config and layout by the run's composition root
(:func:`~asyncopd_jax.pipeline.compose.build_process`), as in the learner's process, and a
rollout stage runs the same rollout loop as a rollout thread
(:class:`~asyncopd_jax.pipeline.rollout_loop.RolloutLoop`). The process stops when ``STOP``
appears or its parent (the learner) is gone.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from asyncopd_jax.config import RunConfig
from asyncopd_jax.pipeline.compose import RunProcess, build_process
from asyncopd_jax.pipeline.exchange import Exchange
from asyncopd_jax.pipeline.heap import HeapTrimmer
from asyncopd_jax.pipeline.host_env import pin_this_process
from asyncopd_jax.pipeline.layout import Layout
from asyncopd_jax.pipeline.probes import teacher_accuracies
from asyncopd_jax.pipeline.rollout_loop import RolloutLoop
from asyncopd_jax.pipeline.spool import Claim, Spool, group_from_record, group_to_record
from asyncopd_jax.pipeline.staleness import PipelineStopped, RolloutGroup
from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.storage.records import Backoff
from asyncopd_jax.storage.store import StorageError


def run_stage(
    exchange_dir: str | Path,
    role: str,
    index: int,
    cores: Sequence[int] = (),
    parent_pid: int | None = None,
    niceness: int = 0,
    wait_s: float = 0.0,
) -> int:
    """Run stage process ``role-index`` until the run stops; returns its exit status.
    ``wait_s``: how long to wait for the learner to set the exchange up (a stage started
    by hand, perhaps before the learner)."""
    if parent_pid is not None:
        # Ctrl-C in a terminal reaches every process of the foreground group. A child of the
        # learner leaves it to the learner, which checkpoints and then stops its stages;
        # exiting here first would race it and end the run as a stage failure instead.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Before anything starts JAX's runtime here: XLA sizes its CPU thread pool to the cores
    # the process may use (importing JAX starts nothing; build_process below does).
    pin_this_process(cores)
    if niceness:
        os.nice(niceness)
    try:
        exchange = Exchange(exchange_dir)
    except StorageError as err:  # a bucket missing, no credentials, no storage extra: one line
        print(f"asyncopd stage: {err}", file=sys.stderr, flush=True)
        return 2
    name = f"{role}-{index}"
    tracer = None
    try:
        cfg, layout = _read_when_set_up(exchange, wait_s)
        # A process of this name starting means the last one of it is gone: what it had
        # claimed goes back now rather than when its leases expire.
        for spool in (exchange.tickets, exchange.sampled):
            for claim in spool.claims_of(name):
                claim.give_back()
        tracer = Tracer(origin=layout.trace_origin, process=name)
        process = build_process(cfg, layout, name, tracer=tracer)
        _write_teacher_accuracy(process, exchange)
        devices = sorted(
            {
                d.id
                for stage in (*process.rollouts, process.scoring)
                if stage is not None
                for d in stage.mesh.devices.flat
            }
        )
        print(
            f"{name}: pid {os.getpid()}, niceness {os.nice(0)}, cores {','.join(map(str, cores)) or 'any'}, "
            f"devices {devices}",
            flush=True,
        )
        beat = _Heartbeat(exchange, name, tracer, parent_pid)
        outbox = exchange.scored if process.scoring is not None else exchange.sampled
        if process.rollouts:
            _roll_out(process, exchange.tickets, outbox, beat)
        else:
            _score(process, exchange.sampled, outbox, beat)
        return 0
    except KeyboardInterrupt:
        return 130
    except BaseException as err:  # noqa: BLE001 - the log is what the learner reports
        if exchange.stopped:
            # The run ended under it (a stage started by hand outlives the learner's join,
            # which then removes the snapshot directory): what it was doing is not wanted.
            print(f"{name}: the run stopped ({type(err).__name__} after the stop: {err})", flush=True)
            return 0
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    finally:
        if tracer is not None:
            exchange.dump_trace(tracer, name)


# A stage process writes its trace this often to a bucket (each write is a billed request).
TRACE_EVERY_S_REMOTE = 30.0


def _read_when_set_up(exchange: Exchange, wait_s: float) -> tuple[RunConfig, Layout]:
    """The exchange's config and layout, waiting up to ``wait_s`` seconds for them."""
    deadline, backoff = time.monotonic() + wait_s, Backoff(exchange.store, local_s=1.0)
    while True:
        try:
            return exchange.read()
        except FileNotFoundError:
            if time.monotonic() >= deadline or exchange.stopped:
                raise
            backoff.wait()


class _Heartbeat:
    """What a stage process does between units of work: stop once the run stopped or the
    learner is gone, write its trace every 2 s, give freed memory back to the OS."""

    def __init__(self, exchange: Exchange, name: str, tracer: Tracer, parent_pid: int | None):
        self.exchange, self.name, self.tracer, self.parent_pid = exchange, name, tracer, parent_pid
        self.last_dump = time.monotonic()
        self.trim_heap = HeapTrimmer()

    def __call__(self) -> None:
        """Raise :class:`PipelineStopped` once the run stopped."""
        if self.exchange.stopped or (self.parent_pid is not None and os.getppid() != self.parent_pid):
            raise PipelineStopped("the run stopped")
        if time.monotonic() - self.last_dump > (TRACE_EVERY_S_REMOTE if self.exchange.store.remote else 2.0):
            self.exchange.dump_trace(self.tracer, self.name)
            self.last_dump = time.monotonic()
        self.trim_heap()


def _roll_out(process: RunProcess, tickets: Spool, outbox: Spool, beat: _Heartbeat) -> None:
    """A rollout process: the rollout loop (:class:`~asyncopd_jax.pipeline.rollout_loop.RolloutLoop`)
    with groups granted by the tickets the learner issues. A ticket is claimed whenever the
    stream wants prompts, and each group is scored (when a scoring stage shares this process)
    and committed on a thread of its own while the next chunks decode. A claim stays open
    until its group is committed; on an error every open claim is given back, so a
    restarted stage takes those groups again."""
    rollout = process.rollouts[0]
    # the first policy: published by the learner as it starts
    rollout.producer.snapshots.wait_for(0, timeout=process.cfg.stages.startup_timeout)
    claims: dict[int, Claim] = {}
    backoff = Backoff(tickets.store)

    def next_group(block: bool) -> tuple[int, int] | None:
        while True:
            beat()
            claim = tickets.claim(beat.name)
            if claim is not None:
                backoff.reset()
                record = claim.read()
                claims[int(record["index"])] = claim
                return int(record["index"]), int(record.get("min_version", 0))
            if not block:
                return None
            backoff.wait()

    def commit(index: int, group: RolloutGroup) -> None:
        _commit(outbox, claims[index].name, group_to_record(rollout.scored(group, index), index), beat.name)
        claims.pop(index).done()

    try:
        RolloutLoop(rollout.producer).run(next_group, commit, beat, beat.name)
    except PipelineStopped:
        return
    finally:
        for claim in claims.values():
            claim.give_back()


def _score(process: RunProcess, sampled: Spool, outbox: Spool, beat: _Heartbeat) -> None:
    """A scoring process: take each sampled group, score it, commit it (a claim given back
    on an error: the group is not lost, a restarted stage takes it again)."""
    scoring = process.scoring
    if scoring is None:  # not reached: a stage process hosts a rollout stage, a scoring stage or both
        raise RuntimeError(f"stage process {beat.name} has neither a rollout nor a scoring stage")
    backoff = Backoff(sampled.store)
    try:
        while True:
            beat()
            claim = sampled.claim(beat.name)
            if claim is None:
                backoff.wait()
                continue
            backoff.reset()
            try:
                group, index = group_from_record(claim.read())
                record = group_to_record(scoring.score(group, process.layout.seed, index, process.tracer), index)
            except BaseException:
                claim.give_back()
                raise
            _commit(outbox, claim.name, record, beat.name)
            claim.done()
    except PipelineStopped:
        return


def _commit(outbox: Spool, name: str, record: dict, stage: str) -> None:
    """Commit a group's output; a refused commit means another consumer, which took this
    group's claim over while this one was slow, committed it first: it is not sent twice."""
    if not outbox.put(name, record):
        print(f"{stage}: group {name} was already committed by a stage that took its claim over", flush=True)


def _write_teacher_accuracy(process: RunProcess, exchange: Exchange) -> None:
    """The in-process teachers' held-out accuracies, for the learner's summary: measured
    once, by the first scoring stage (every scoring stage holds every teacher)."""
    scoring = process.scoring
    if (
        scoring is not None
        and scoring.models
        and scoring.plan.index == 0
        and exchange.read_teacher_accuracies() is None
    ):
        exchange.write_teacher_accuracies(teacher_accuracies(process.cfg, process.models, scoring))
