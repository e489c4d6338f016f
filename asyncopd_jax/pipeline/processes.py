"""Stage placement ``processes``: rollout sampling, teacher scoring and the learner as
separate OS processes, each with its own JAX runtime on its own cores or devices.

    learner process (the trainer)                           stage processes
    ─────────────────────────────                           ───────────────
    dispatcher: buffer.acquire(G), then a ticket ─▶ tickets/ ─▶ rollout-i: sample group
                                                                 from the newest snapshot
                                                 sampled/ ◀──── (only with scoring processes)
                                                         └────▶ scoring-j: teacher scores
    collector: buffer.put(group) ◀──────────────── scored/ ◀──── rollout-i or scoring-j
    learner: buffer.take → train → publish ──▶ snapshots/<version> ──────▶ rollout-i
    monitor: a stage process that exits stops the run with its log (or is restarted)

The processes share one *exchange* directory, ``<run>/exchange/``: ``config.yaml`` (the
config every stage runs with), ``layout.json`` (where the snapshots are, the seed and
the group size), three :class:`~asyncopd_jax.pipeline.spool.Spool` s (``tickets/``,
``sampled/``, ``scored/``), ``trace/`` and ``logs/`` (one file per process) and, at the
end, ``STOP``. A stage process needs nothing else, so the same stage can be started by
hand on another host that mounts the directory (``asyncopd stage``; see ``launch/``).

The staleness rules stay where they were, in the learner's
:class:`~asyncopd_jax.pipeline.staleness.StalenessBuffer`: a ticket is issued only after
``buffer.acquire`` (AReaL's capacity rule) and every scored group goes through
``buffer.put`` / ``buffer.take`` (η per consumed token, stale and future groups dropped
and counted). A scored record stays in ``scored/`` until a checkpoint that includes the
step which consumed it is saved, so a learner killed and resumed finds every group that
was committed after its last checkpoint (they are offered again, and dropped as "future"
if newer than the restored policy).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from asyncopd_jax.config import RunConfig, StagesConfig, load_config, parse_cpu_list, save_config
from asyncopd_jax.pipeline.heap import HeapTrimmer
from asyncopd_jax.pipeline.spool import Spool, group_from_record, read_record
from asyncopd_jax.pipeline.staleness import PipelineStopped, RolloutGroup, StalenessBuffer
from asyncopd_jax.pipeline.trace import Tracer

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
POLL_SECONDS = 0.002  # how often an idle stage looks for work


class StageFailed(RuntimeError):
    """A stage process exited while the run needed it."""


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """One stage process: its role, number, CPU cores (empty: unpinned) and devices."""

    role: str  # "rollout" or "scoring"
    index: int
    cores: tuple[int, ...] = ()
    devices: str = ""

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


# --- where each process runs ---------------------------------------------------------------


def split_cores(cores: Sequence[int], processes: int) -> list[tuple[int, ...]]:
    """Split ``cores`` into ``processes`` contiguous shares (cycling if there are fewer cores)."""
    if not cores or processes == 0:
        return [()] * processes
    if processes >= len(cores):
        return [(cores[i % len(cores)],) for i in range(processes)]
    bounds = [round(i * len(cores) / processes) for i in range(processes + 1)]
    return [tuple(cores[bounds[i]:bounds[i + 1]]) for i in range(processes)]


def plan_stages(stages: StagesConfig, available: Sequence[int]) -> tuple[tuple[int, ...], list[StageSpec]]:
    """The learner's cores and the stage processes to start, from ``stages`` and the cores
    this process may use (``os.sched_getaffinity(0)``).

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
        "scoring": rest[len(rest) - scoring_n:] if scoring_n else rest,
    }
    processes = {"learner": 1, "rollout": stages.rollout_processes, "scoring": stages.scoring_processes}
    if any(len(auto[role]) < MIN_CORES_TO_PIN * count for role, count in processes.items() if count):
        auto = {role: () for role in auto}  # too few cores to split: every "auto" stage unpinned

    def cores(role: str) -> tuple[int, ...]:
        spec = getattr(stages, f"{role}_cores")
        return auto[role] if spec == "auto" else parse_cpu_list(spec)

    specs = [StageSpec("rollout", i, c, stages.rollout_devices)
             for i, c in enumerate(split_cores(cores("rollout"), stages.rollout_processes))]
    specs += [StageSpec("scoring", i, c, stages.scoring_devices)
              for i, c in enumerate(split_cores(cores("scoring"), stages.scoring_processes))]
    return cores("learner"), specs


def pin_this_process(cores: Sequence[int]) -> None:
    """Restrict this process to ``cores`` (call before JAX starts: XLA sizes its CPU thread
    pool to the cores the process may use)."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))


# --- the exchange directory --------------------------------------------------------------------


class Exchange:
    """The directory the stage processes and the learner share (see the module docstring)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.tickets = Spool(self.root / "tickets")
        self.sampled = Spool(self.root / "sampled")
        self.scored = Spool(self.root / "scored")
        self.trace_dir = self.root / "trace"
        self.log_dir = self.root / "logs"
        for d in (self.trace_dir, self.log_dir):
            d.mkdir(exist_ok=True)
        self.stop_file = self.root / "STOP"
        self.config_file = self.root / "config.yaml"
        self.layout_file = self.root / "layout.json"

    def write(self, cfg: RunConfig, layout: dict[str, Any]) -> None:
        save_config(cfg, self.config_file)
        self.layout_file.write_text(json.dumps(layout, indent=2))

    def read(self) -> tuple[RunConfig, dict[str, Any]]:
        if not self.layout_file.is_file():
            raise FileNotFoundError(f"{self.layout_file} does not exist: is {self.root} a run's exchange directory?")
        return load_config(self.config_file), json.loads(self.layout_file.read_text())

    @property
    def stopped(self) -> bool:
        return self.stop_file.exists()


def default_snapshot_dir(run_path: Path) -> Path:
    """RAM-backed ``/dev/shm`` when the host has it (publishing costs a memory copy), else
    ``<run>/snapshots``."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        tag = hashlib.sha1(str(run_path.resolve()).encode()).hexdigest()[:10]  # stable across processes
        return shm / f"asyncopd-{os.getuid()}-{run_path.name}-{tag}"
    return run_path / "snapshots"


# --- the stage processes (children) ---------------------------------------------------------------


def run_stage(exchange_dir: str | Path, role: str, index: int, cores: Sequence[int] = (),
              parent_pid: int | None = None, niceness: int = 0) -> int:
    """The main loop of one stage process; returns its exit status.

    ``rollout``: take a ticket, sample its group from the newest snapshot, score it here
    when there are no scoring processes, commit it. ``scoring``: take a sampled group,
    score it, commit it. Stops when ``STOP`` appears or the parent process is gone.
    """
    if parent_pid is not None:
        # Ctrl-C in a terminal reaches every process of the foreground group. A child of the
        # learner leaves it to the learner, which checkpoints and then stops its stages;
        # exiting here first would race it and end the run as a stage failure instead.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    pin_this_process(cores)
    # Everything that starts JAX comes after the pinning.
    from asyncopd_jax.pipeline.stage_worker import StageWorker

    exchange = Exchange(exchange_dir)
    name = f"{role}-{index}"
    tracer = None
    try:
        cfg, layout = exchange.read()
        tracer = Tracer(origin=layout["origin"], process=name)
        worker = StageWorker(cfg, layout, role, tracer)

        def should_stop() -> bool:
            return exchange.stopped or (parent_pid is not None and os.getppid() != parent_pid)

        inbox = exchange.tickets if role == "rollout" else exchange.sampled
        outbox = exchange.scored if (role == "scoring" or not layout["scoring_processes"]) else exchange.sampled
        last_dump = time.monotonic()
        trim_heap = HeapTrimmer()
        while not should_stop():
            trim_heap()
            claim = inbox.claim(name)
            if claim is None:
                time.sleep(POLL_SECONDS)
                continue
            try:
                record = worker.process(claim.read())
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


# --- the learner's side: start, feed, watch --------------------------------------------------


class StageProcesses:
    """Starts the stage processes and joins them to the learner's staleness buffer.

    The same interface as :class:`~asyncopd_jax.pipeline.rollout.RolloutPool`
    (``start``, ``join``, ``groups_started``) plus :meth:`consumed` and
    :meth:`checkpointed`, which decide when a scored record may be deleted.
    """

    def __init__(self, *, cfg: RunConfig, exchange: Exchange, buffer: StalenessBuffer, specs: list[StageSpec],
                 group_size: int, first_index: int, layout: dict[str, Any], tracer: Tracer,
                 stage_command: Sequence[str] | None = None):
        self.cfg, self.exchange, self.buffer, self.specs = cfg, exchange, buffer, specs
        self.group_size, self.tracer = group_size, tracer
        self.restarts_left = cfg.stages.restarts
        self.stage_command = list(stage_command or [sys.executable, "-m", "asyncopd_jax.cli", "stage"])
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, Any] = {}
        self._admitted: set[int] = set()  # groups whose capacity was acquired here
        self._seen: set[str] = set()
        self._offered: deque[str] = deque()  # records put into the buffer, in order
        self._consumed: list[str] = []  # records taken or dropped by the learner, not yet checkpointed
        exchange.stop_file.unlink(missing_ok=True)
        # Tickets of a previous incarnation are void (their capacity was never acquired
        # here); sampled and scored records are committed work and are kept.
        exchange.tickets.clear()
        for spool in (exchange.sampled, exchange.scored):
            for p in spool.claimed.iterdir():
                os.rename(p, spool.root / (p.name.rsplit("@", 1)[0] + ".npz"))
        # Committed by an earlier incarnation of this run: they count against the capacity
        # like groups started now, and are admitted (in order) before any new ticket.
        self._leftovers = sorted(int(n) for s in (exchange.sampled, exchange.scored) for n in s.names())
        self._counter = max([first_index, *self._leftovers])
        exchange.write(cfg, {**layout, "scoring_processes": sum(s.role == "scoring" for s in specs)})
        self._threads = [threading.Thread(target=self._guard(f), name=n, daemon=True)
                         for n, f in (("dispatcher", self._dispatch), ("collector", self._collect),
                                      ("monitor", self._monitor))]

    # --- life cycle --------------------------------------------------------------------------

    def start(self) -> None:
        for spec in self.specs:
            self._spawn(spec)
        for t in self._threads:
            t.start()

    def _spawn(self, spec: StageSpec) -> None:
        env = dict(os.environ)
        if spec.devices:
            env["CUDA_VISIBLE_DEVICES"] = spec.devices
        log = open(self.exchange.log_dir / f"{spec.name}.log", "ab")  # noqa: SIM115 - closed in join
        command = [*self.stage_command, spec.role, "--exchange", str(self.exchange.root), "--index",
                   str(spec.index), "--cores", ",".join(map(str, spec.cores)), "--parent-pid", str(os.getpid()),
                   "--niceness", str(self.cfg.stages.rollout_niceness)]
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
        self.exchange.stop_file.touch()
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
        return sorted(self.exchange.trace_dir.glob("*.json"))

    # --- bookkeeping of scored records -------------------------------------------------------

    def consumed(self, taken: list[RolloutGroup]) -> None:
        """The learner took ``taken``: they and every record offered before them (dropped
        by the buffer, which hands groups over in order) are consumed."""
        if not taken:
            return
        last = taken[-1].info["record"]
        with self._lock:
            while self._offered:
                name = self._offered.popleft()
                self._consumed.append(name)
                if name == last:
                    break

    def checkpointed(self) -> None:
        """A checkpoint covering every consumed record was saved: delete them."""
        with self._lock:
            done, self._consumed = self._consumed, []
        for name in done:
            self.exchange.scored.path(name).unlink(missing_ok=True)
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
            self.buffer.acquire(self.group_size)
            with self._lock:
                self._counter += 1
                index = self._counter
                self._admitted.add(index)
            self.exchange.tickets.put(f"{index:010d}", {"index": np.asarray(index), "size": np.asarray(self.group_size)})

    def _collect(self) -> None:
        scored = self.exchange.scored
        while not self._stopping.is_set():
            with self._lock:
                fresh = [n for n in scored.names() if n not in self._seen and int(n) in self._admitted]
            if not fresh:
                time.sleep(POLL_SECONDS)
                continue
            for name in fresh:
                with self.tracer.span("receive"):
                    group, _ = group_from_record(read_record(scored.path(name)))
                group.info["record"] = name
                with self._lock:
                    self._seen.add(name)
                    self._offered.append(name)
                self.buffer.put(group)

    def _monitor(self) -> None:
        while not self._stopping.wait(0.1):
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
                    print(f"asyncopd: {name} exited with code {code}; restarting it "
                          f"({self.restarts_left} restart(s) left)", file=sys.stderr)
                    self._spawn(spec)
                    continue
                raise StageFailed(f"stage process {name} (pid {proc.pid}) exited with code {code}"
                                  f"{_describe_exit(code)}; the end of its log "
                                  f"{self.exchange.log_dir / (name + '.log')}:\n{self._log_tail(name)}")

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


__all__ = ["Exchange", "StageFailed", "StageProcesses", "StageSpec", "default_snapshot_dir", "pin_this_process",
           "plan_stages", "run_stage"]
