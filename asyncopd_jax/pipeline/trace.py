"""A thread-safe span recorder that writes a Chrome / Perfetto ``trace.json``.

Open the file at https://ui.perfetto.dev (or chrome://tracing): one row per thread
(rollout workers, learner), spans for rollout, scoring, learning, publishing and eval.
With stage processes each process keeps its own :class:`Tracer` and dumps its events to
a file (:meth:`Tracer.dump`); the learner merges them (``write(path, others=...)``), one
process group per stage process on one timeline. Times are wall-clock seconds since a
shared ``origin`` (``time.time()`` at the run's start), comparable across processes and,
with synchronised clocks, across hosts.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from asyncopd_jax.atomic_files import write_text_atomically


class Tracer:
    def __init__(self, origin: float | None = None, process: str = "learner") -> None:
        self._events: list[dict] = []
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
                self._events.append(event)

    def totals(self, prefix: str = "") -> dict[str, float]:
        """Seconds spent per span name (names starting with ``prefix``)."""
        out: dict[str, float] = {}
        with self._lock:
            for e in self._events:
                if e["name"].startswith(prefix):
                    out[e["name"]] = out.get(e["name"], 0.0) + e["dur"] / 1e6
        return out

    def events(self) -> list[dict]:
        with self._lock:
            return list(self._events)

    def dump(self, path: str | Path) -> None:
        """This process's raw events (written atomically), for the learner to merge."""
        write_text_atomically(path, json.dumps(self.events()))

    def write(self, path: str | Path, others: Iterable[Path] = ()) -> None:
        """``trace.json``: this tracer's events and those dumped by other processes."""
        events = self.events()
        for other in others:
            try:
                events += json.loads(Path(other).read_text())
            except (OSError, ValueError):
                continue  # a process that never dumped, or was killed mid-write (dump is atomic)
        # Chrome's format wants numeric process and thread ids; name them with metadata events.
        processes = sorted({e["pid"] for e in events} | {self.process}, key=lambda p: (p != self.process, p))
        pids = {name: i for i, name in enumerate(processes)}
        threads = sorted({(e["pid"], e["tid"]) for e in events})
        tids = {key: i for i, key in enumerate(threads)}
        meta = [{"name": "process_name", "ph": "M", "pid": pids[p], "args": {"name": p}} for p in processes]
        meta += [{"name": "thread_name", "ph": "M", "pid": pids[p], "tid": tids[(p, t)], "args": {"name": t}}
                 for p, t in threads]
        body = [{**e, "pid": pids[e["pid"]], "tid": tids[(e["pid"], e["tid"])]} for e in events]
        write_text_atomically(path, json.dumps({"traceEvents": meta + body, "displayTimeUnit": "ms"}))


def load_spans(path: str | Path) -> list[dict]:
    """The complete ("X") events of a ``trace.json``, each with its process's name under
    ``"process"`` and start and duration in seconds under ``"start"`` and ``"seconds"``."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    return [{**e, "process": names[e["pid"]], "start": e["ts"] / 1e6, "seconds": e["dur"] / 1e6}
            for e in events if e["ph"] == "X"]
