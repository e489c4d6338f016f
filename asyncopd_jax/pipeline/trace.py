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
import json
import threading
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path

from asyncopd_jax.atomic_files import write_text_atomically


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
            end = time.time()
            event = {
                "name": name, "ph": "X", "pid": self.process, "tid": threading.current_thread().name,
                "ts": (start - self.origin) * 1e6, "dur": (end - start) * 1e6, "args": args,
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
        """This process's kept events and its count of dropped ones (written atomically),
        for the learner to merge."""
        with self._lock:
            record = {"process": self.process, "events": list(self._events), "dropped": self.dropped}
        write_text_atomically(path, json.dumps(record))

    def write(self, path: str | Path, others: Iterable[Path] = ()) -> None:
        """``trace.json``: this tracer's events and those dumped by other processes; its
        ``otherData.dropped_spans`` says, per process, how many older spans were not kept."""
        events, dropped = self.events(), {self.process: self.dropped}
        for other in others:
            try:
                record = json.loads(Path(other).read_text())
            except (OSError, ValueError):
                continue  # a process that never dumped, or was killed mid-write (dump is atomic)
            events += record["events"]
            dropped[record["process"]] = record["dropped"]
        # Chrome's format wants numeric process and thread ids; name them with metadata events.
        processes = sorted({e["pid"] for e in events} | {self.process}, key=lambda p: (p != self.process, p))
        pids = {name: i for i, name in enumerate(processes)}
        threads = sorted({(e["pid"], e["tid"]) for e in events})
        tids = {key: i for i, key in enumerate(threads)}
        meta = [{"name": "process_name", "ph": "M", "pid": pids[p], "args": {"name": p}} for p in processes]
        meta += [{"name": "thread_name", "ph": "M", "pid": pids[p], "tid": tids[(p, t)], "args": {"name": t}}
                 for p, t in threads]
        body = [{**e, "pid": pids[e["pid"]], "tid": tids[(e["pid"], e["tid"])]} for e in events]
        write_text_atomically(path, json.dumps({"traceEvents": meta + body, "displayTimeUnit": "ms",
                                               "otherData": {"dropped_spans": dropped}}))


def load_spans(path: str | Path) -> list[dict]:
    """The complete ("X") events of a ``trace.json``, each with its process's name under
    ``"process"`` and start and duration in seconds under ``"start"`` and ``"seconds"``."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    return [{**e, "process": names[e["pid"]], "start": e["ts"] / 1e6, "seconds": e["dur"] / 1e6}
            for e in events if e["ph"] == "X"]
