"""The learner's side of the ``processes`` placement: start the stage processes, feed
them tickets, collect their scored groups, watch them.

    learner process (the trainer)                           stage processes
    ─────────────────────────────                           ───────────────
    dispatcher: buffer.acquire(G), then a ticket ─▶ tickets/ ─▶ rollout-i: sample group
                                                                 from snapshot ≥ the ticket's
                                                 sampled/ ◀──── (only with scoring processes)
                                                         └────▶ scoring-j: teacher scores
    collector: buffer.put(group) ◀──────────────── scored/ ◀──── rollout-i or scoring-j
    learner: buffer.take → train → publish ──▶ snapshots/<version> ──────▶ rollout-i
    monitor: a stage process that exits stops the run with its log (or is restarted)

The staleness rules stay in the learner's
:class:`~asyncopd_jax.pipeline.staleness.StalenessBuffer`: a ticket is issued only after
``buffer.acquire`` (AReaL's capacity rule), carries the oldest policy version the group
may start from (so a synchronous schedule never drops a group because the newest
snapshot was still being written), and every scored group goes through ``buffer.put`` /
``buffer.take`` (η per consumed token, stale and future groups dropped and counted). A
scored record stays in ``scored/`` until a checkpoint that includes the step which
consumed it is saved, so a learner killed and resumed finds every group that was
committed after its last checkpoint (they are offered again, and dropped as "future" if
newer than the restored policy).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import jax
import numpy as np

from asyncopd_jax.config import RunConfig
from asyncopd_jax.pipeline.exchange import Exchange
from asyncopd_jax.pipeline.host_env import detect_platform, stage_process_env
from asyncopd_jax.pipeline.layout import Layout, StagePlan
from asyncopd_jax.pipeline.spool import group_from_record
from asyncopd_jax.pipeline.staleness import PipelineStopped, RolloutGroup, StalenessBuffer
from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.storage.records import Backoff


class StageFailed(RuntimeError):
    """A stage process exited while the run needed it, or (started by hand) never came."""


#: With ``stages.start_processes: false``, how often the learner says what it waits for
#: until the first group arrives.
WAITING_REPORT_S = 60.0


class StageProcesses:
    """Starts the stage processes of ``layout`` and joins them to the learner's staleness
    buffer (a :class:`~asyncopd_jax.pipeline.placements.Stages`; :meth:`consumed` and
    :meth:`checkpointed` decide when a scored record may be deleted)."""

    def __init__(
        self,
        *,
        cfg: RunConfig,
        layout: Layout,
        exchange: Exchange,
        buffer: StalenessBuffer,
        first_index: int,
        tracer: Tracer,
        unlearned: Sequence[int] | None = None,
        stage_command: Sequence[str] | None = None,
    ):
        self.cfg, self.layout, self.exchange, self.buffer = cfg, layout, exchange, buffer
        # stages.start_processes false: every stage process is started by hand, elsewhere
        self.specs = layout.stage_processes() if cfg.stages.start_processes else ()
        self.by_hand = () if cfg.stages.start_processes else layout.stage_processes()
        self._started_at = time.time()
        # each hand-started stage's trace as this learner found it (None: none yet)
        self._traces_at_start = {spec.name: exchange.trace_generation(spec.name) for spec in self.by_hand}
        self._first_group = threading.Event()
        self.group_size, self.tracer = layout.group_size, tracer
        self.platform = detect_platform()
        self.restarts_left = cfg.stages.restarts
        self.stage_command = list(stage_command or [sys.executable, "-m", "asyncopd_jax.cli", "stage"])
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, IO[bytes]] = {}
        self._admitted: set[int] = set()  # groups whose capacity was acquired here
        self._seen: set[str] = set()
        self._offered: deque[str] = deque()  # records put into the buffer, in order
        self._consumed: list[str] = []  # records taken or dropped by the learner, not yet checkpointed
        exchange.clear_stop()
        # Tickets of a previous incarnation are void (their capacity was never acquired
        # here); sampled and scored records are committed work and are kept.
        exchange.tickets.clear()
        for spool in (exchange.sampled, exchange.scored):
            spool.release_all()
        # Committed by an earlier incarnation of this run: they count against the capacity
        # like groups started now, and are admitted (in order) before any new ticket --
        # except those its checkpoint had learned (``unlearned``: the groups started up to
        # ``first_index`` and not learned then; None: a checkpoint that does not say), left
        # by a crash between a checkpoint and the deletion of what it covers, or committed
        # again by a stage whose lease had been taken over.
        found = sorted(int(n) for s in (exchange.sampled, exchange.scored) for n in s.names())
        keep = set(unlearned) if unlearned is not None else set(found)
        learned = [n for n in found if n <= first_index and n not in keep]
        for n in learned:
            exchange.sampled.delete(f"{n:010d}")
            exchange.scored.delete(f"{n:010d}")
        self._leftovers = [n for n in found if n not in learned]
        self._counter = max([first_index, *self._leftovers])
        exchange.write(cfg, layout)
        self._threads = [
            threading.Thread(target=self._guard(f), name=n, daemon=True)
            for n, f in (("dispatcher", self._dispatch), ("collector", self._collect), ("monitor", self._monitor))
        ]

    # --- life cycle --------------------------------------------------------------------------

    def start(self) -> None:
        for spec in self.specs:
            self._spawn(spec)
        for t in self._threads:
            t.start()

    def take(self, version: int) -> list[RolloutGroup]:
        return self.buffer.take(version)

    def _spawn(self, spec: StagePlan) -> None:
        env = {**os.environ, **stage_process_env(self.layout, spec, self.platform, jax.local_device_count())}
        log = open(self.exchange.log_dir / f"{spec.name}.log", "ab")  # noqa: SIM115 - closed in join
        command = [
            *self.stage_command,
            spec.role,
            "--exchange",
            self.exchange.url,
            "--index",
            str(spec.index),
            "--cores",
            ",".join(map(str, spec.cores)),
            "--parent-pid",
            str(os.getpid()),
            "--niceness",
            str(self.cfg.stages.rollout_niceness),
        ]
        # No preexec_fn: it would make Python fork this multithreaded (JAX) process.
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        with self._lock:
            self._procs[spec.name] = proc
            self._logs[spec.name] = log

    @property
    def pids(self) -> dict[str, int]:
        with self._lock:
            return {name: p.pid for name, p in self._procs.items()}

    def join(self, timeout: float = 60.0) -> None:
        """Stop every stage process (``STOP``, then SIGTERM, then SIGKILL) and the threads."""
        self._stopping.set()
        self.exchange.stop()
        deadline = time.monotonic() + timeout
        with self._lock:
            procs = dict(self._procs)
        for proc in procs.values():
            try:
                proc.wait(max(0.1, min(10.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for t in self._threads:
            if t.is_alive():
                t.join(max(0.1, deadline - time.monotonic()))
        for log in self._logs.values():
            log.close()

    @property
    def groups_started(self) -> int:
        """Index of the last rollout group issued (groups are numbered from the run's start)."""
        with self._lock:
            return self._counter

    def trace_files(self) -> list[Path]:
        return self.exchange.trace_files()

    # --- bookkeeping of scored records -------------------------------------------------------

    def consumed(self, taken: list[RolloutGroup]) -> None:
        """The learner took ``taken``: they and every record offered before them (dropped
        by the buffer, which hands groups over in order) are consumed."""
        if not taken:
            return
        last = taken[-1].record
        with self._lock:
            while self._offered:
                name = self._offered.popleft()
                self._consumed.append(name)
                if name == last:
                    break

    def unlearned(self) -> list[int]:
        with self._lock:
            return sorted(self._admitted - {int(name) for name in self._consumed})

    def checkpointed(self) -> None:
        """A checkpoint covering every consumed record was saved: delete them."""
        with self._lock:
            done, self._consumed = self._consumed, []
        for name in done:
            self.exchange.scored.delete(name)
        with self._lock:  # deleted: never listed again, so forget them (the sets stay bounded)
            self._seen.difference_update(done)
            self._admitted.difference_update(int(name) for name in done)

    # --- the three threads ------------------------------------------------------------------

    def _guard(self, loop):
        def run() -> None:
            try:
                loop()
            except PipelineStopped:
                return
            except BaseException as err:  # noqa: BLE001 - forwarded to the learner
                self.buffer.fail(err)

        return run

    def _dispatch(self) -> None:
        for index in self._leftovers:
            self.buffer.acquire(self.group_size)
            with self._lock:
                self._admitted.add(index)
        while not self._stopping.is_set():
            min_version = self.buffer.acquire(self.group_size)
            with self._lock:
                self._counter += 1
                index = self._counter
                self._admitted.add(index)
            self.exchange.tickets.put(
                f"{index:010d}",
                {
                    "index": np.asarray(index),
                    "min_version": np.asarray(min_version),
                },
            )

    def _collect(self) -> None:
        scored = self.exchange.scored
        backoff = Backoff(scored.store)
        while not self._stopping.is_set():
            with self._lock:
                fresh = [n for n in scored.names() if n not in self._seen and int(n) in self._admitted]
            if not fresh:
                backoff.wait()
                continue
            backoff.reset()
            for name in fresh:
                with self.tracer.span("receive"):
                    arrays = scored.read(name)
                if arrays is None:
                    continue  # not reached: only the learner deletes scored records
                group, _ = group_from_record(arrays)
                group.record = name
                with self._lock:
                    self._seen.add(name)
                    self._offered.append(name)
                self.buffer.put(group)
                self._first_group.set()

    def _monitor(self) -> None:
        next_report = time.monotonic() + WAITING_REPORT_S
        while not self._stopping.wait(0.1):
            if self.by_hand and not self._first_group.is_set():
                next_report = self._wait_for_hand_started(next_report)
            with self._lock:
                procs = dict(self._procs)
            for name, proc in procs.items():
                code = proc.poll()
                if code is None or self._stopping.is_set():
                    continue
                spec = next(s for s in self.specs if s.name == name)
                if self.restarts_left > 0:
                    self.restarts_left -= 1
                    for spool in (self.exchange.tickets, self.exchange.sampled):
                        for claim in spool.claims_of(name):
                            claim.give_back()
                    print(
                        f"asyncopd: {name} exited with code {code}; restarting it "
                        f"({self.restarts_left} restart(s) left)",
                        file=sys.stderr,
                    )
                    self._spawn(spec)
                    continue
                raise StageFailed(
                    f"stage process {name} (pid {proc.pid}) exited with code {code}"
                    f"{_describe_exit(code)}; the end of its log "
                    f"{self.exchange.log_dir / (name + '.log')}:\n{self._log_tail(name)}"
                )

    def _wait_for_hand_started(self, next_report: float) -> float:
        """Until the first group arrives from stage processes started by hand: say every
        :data:`WAITING_REPORT_S` what the learner waits for; past ``stages.startup_timeout``,
        stop the run in one line. Returns when to report next."""
        waited = time.time() - self._started_at
        absent = self._not_started()
        what = (
            f"the stage processes started by hand (stages.start_processes: false) to commit a group to "
            f"{self.exchange.url}; none has started yet for {', '.join(absent)} (on its host: asyncopd stage "
            f"ROLE --exchange {self.exchange.url} --index I)"
            if absent
            else f"the stage processes started by hand (stages.start_processes: false; all have started) to commit "
            f"a group to {self.exchange.url}"
        )
        if waited > self.cfg.stages.startup_timeout:
            raise StageFailed(
                f"no rollout group arrived within stages.startup_timeout = {self.cfg.stages.startup_timeout:g} s "
                f"from {what}"
            )
        if time.monotonic() >= next_report:
            print(f"asyncopd: waiting {waited:.0f} s for {what}", file=sys.stderr, flush=True)
            return time.monotonic() + WAITING_REPORT_S
        return next_report

    def _not_started(self) -> list[str]:
        """The hand-started stage processes with no sign of life since this learner started:
        a stage process rewrites its trace while it runs, so one whose trace has not changed
        since then (compared by generation, not by the hosts' clocks) has not started."""
        return [
            spec.name
            for spec in self.by_hand
            if self.exchange.trace_generation(spec.name) in (None, self._traces_at_start.get(spec.name))
        ]

    def _log_tail(self, name: str, lines: int = 15) -> str:
        path = self.exchange.log_dir / f"{name}.log"
        try:
            text = path.read_text(errors="replace").rstrip().splitlines()
        except OSError:
            return "(no log)"
        return "\n".join("    " + line for line in text[-lines:]) or "    (empty)"


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f" (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f" (killed by signal {-code})"
    return ""
