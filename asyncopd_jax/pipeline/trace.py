"""A thread-safe span recorder that writes a Chrome / Perfetto ``trace.json``.

Open the file at https://ui.perfetto.dev (or chrome://tracing): one row per thread
(rollout workers, learner), spans for rollout, scoring, learning, publishing and eval.
With stage processes each process keeps its own :class:`Tracer` and dumps its events to
a file (:meth:`Tracer.dump`); the learner merges them (``write(path, others=...)``), one
process group per stage process on one timeline. Times are wall-clock seconds since a
shared ``origin`` (``time.time()`` at the run's start), comparable across processes and,
with synchronised clocks, across hosts.

A run of days records millions of spans, so a tracer keeps only the most recent ``keep``
(the timeline of the last hours of a real run) and counts the rest; the per-name totals
(:meth:`Tracer.totals`) are running sums over every span ever recorded.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

from asyncopd_jax.atomic_files import open_atomically

#: Spans a tracer keeps by default: ~8 MB of Python dicts; at a few spans per learner step
#: that is the last several thousand steps.
KEEP_SPANS = 20_000


class Tracer:
    def __init__(self, origin: float | None = None, process: str = "learner", keep: int = KEEP_SPANS) -> None:
        self._events: deque[dict] = deque(maxlen=keep)  # the newest ``keep`` spans
        self._seconds: dict[str, float] = {}  # span name -> seconds over the whole run
        self.dropped = 0  # spans recorded but no longer kept
        self._lock = threading.Lock()
        self.origin = time.time() if origin is None else origin
        self.process = process

    @contextlib.contextmanager
    def span(self, name: str, **args):
        """Record the wall time of the ``with`` body as a complete event on this thread.

        Yields the event's ``args`` dict: the body may add what it learns (e.g. the
        length of what it generated)."""
        start = time.time()
        try:
            yield args
        finally:
            self.record(name, start, time.time(), **args)

    def record(self, name: str, start: float, end: float, **args) -> None:
        """Record a complete event from ``start`` to ``end`` (``time.time()``) on this thread:
        for work that is not one ``with`` body (a group decoding across a stream's chunks)."""
        event = {
            "name": name,
            "ph": "X",
            "pid": self.process,
            "tid": threading.current_thread().name,
            "ts": (start - self.origin) * 1e6,
            "dur": (end - start) * 1e6,
            "args": args,
        }
        with self._lock:
            self.dropped += len(self._events) == self._events.maxlen
            self._events.append(event)
            self._seconds[name] = self._seconds.get(name, 0.0) + end - start

    def totals(self, prefix: str = "") -> dict[str, float]:
        """Seconds spent per span name (names starting with ``prefix``), over every span
        recorded, also those no longer kept."""
        with self._lock:
            return {name: s for name, s in self._seconds.items() if name.startswith(prefix)}

    def events(self) -> list[dict]:
        """The spans kept (the newest ``keep``), oldest first."""
        with self._lock:
            return list(self._events)

    def dump(self, path: str | Path) -> None:
        """This process's kept events, for the learner to merge (written atomically): a
        header line with its name and its count of dropped spans, then one event per line,
        so that :meth:`write` reads them one at a time."""
        with self._lock:
            events, dropped = list(self._events), self.dropped
        with open_atomically(path) as f:
            f.write(json.dumps({"process": self.process, "dropped": dropped}) + "\n")
            for event in events:
                f.write(json.dumps(event) + "\n")

    def write(self, path: str | Path, others: Iterable[Path] = ()) -> None:
        """``trace.json``: this tracer's events and those dumped by other processes; its
        ``otherData.dropped_spans`` says, per process, how many older spans were not kept.

        Streamed, one span at a time: the learner writes it at every checkpoint, and
        building it whole (every process's window parsed, each span copied with numeric
        ids: ~460,000 Python objects at once in the soak) left Python's allocator with more
        partly used arenas after each checkpoint, resident memory that no heap trim gives
        back (the soak's creep, docs/reliability.md)."""
        with self._lock:
            events, dropped = list(self._events), {self.process: self.dropped}
        # Chrome's format wants numeric process and thread ids; a metadata event names each
        # one before its first span.
        pids: dict[str, int] = {}
        tids: dict[tuple[str, str], int] = {}
        with open_atomically(path) as f:
            f.write('{"traceEvents": [')
            separator = ""

            def emit(event: dict) -> None:
                nonlocal separator
                f.write(separator + json.dumps(event))
                separator = ", "

            def pid(process: str) -> int:
                if process not in pids:
                    pids[process] = len(pids)
                    emit({"name": "process_name", "ph": "M", "pid": pids[process], "args": {"name": process}})
                return pids[process]

            pid(self.process)  # the learner is process 0, named even without spans
            for event in itertools.chain(events, *(_dumped_events(Path(other), dropped) for other in others)):
                key = (event["pid"], event["tid"])
                if key not in tids:
                    tids[key] = len(tids)
                    emit(
                        {
                            "name": "thread_name",
                            "ph": "M",
                            "pid": pid(key[0]),
                            "tid": tids[key],
                            "args": {"name": key[1]},
                        }
                    )
                emit({**event, "pid": pid(key[0]), "tid": tids[key]})
            f.write('], "displayTimeUnit": "ms", "otherData": ' + json.dumps({"dropped_spans": dropped}) + "}")


def _dumped_events(path: Path, dropped: dict[str, int]) -> Iterator[dict]:
    """The events of a :meth:`Tracer.dump` file, one at a time, after recording its count
    of dropped spans in ``dropped``. A file without a readable header (a process that never
    dumped) yields nothing; a line that does not parse ends it (dumps are written
    atomically, so neither is expected of a finished dump)."""
    try:
        with path.open() as f:
            header = json.loads(f.readline())
            dropped[header["process"]] = header["dropped"]
            for line in f:
                yield json.loads(line)
    except (OSError, ValueError, KeyError, TypeError):
        return


def load_spans(path: str | Path) -> list[dict]:
    """The complete ("X") events of a ``trace.json``, each with its process's name under
    ``"process"`` and start and duration in seconds under ``"start"`` and ``"seconds"``."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    return [
        {**e, "process": names[e["pid"]], "start": e["ts"] / 1e6, "seconds": e["dur"] / 1e6}
        for e in events
        if e["ph"] == "X"
    ]
