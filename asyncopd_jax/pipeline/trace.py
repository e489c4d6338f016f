"""A thread-safe span recorder that writes a Chrome / Perfetto ``trace.json``.

Open the file at https://ui.perfetto.dev (or chrome://tracing): one row per thread
(rollout workers, learner), spans for rollout, scoring, learning, publishing and eval.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path


class Tracer:
    def __init__(self) -> None:
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._pid = os.getpid()

    @contextlib.contextmanager
    def span(self, name: str, **args):
        """Record the wall time of the ``with`` body as a complete event on this thread."""
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            event = {
                "name": name, "ph": "X", "pid": self._pid, "tid": threading.current_thread().name,
                "ts": (start - self._t0) * 1e6, "dur": (end - start) * 1e6, "args": args,
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

    def write(self, path: str | Path) -> None:
        with self._lock:
            events = list(self._events)
        # Chrome's format wants numeric thread ids; name them with metadata events.
        names = sorted({e["tid"] for e in events})
        tids = {name: i for i, name in enumerate(names)}
        meta = [{"name": "thread_name", "ph": "M", "pid": self._pid, "tid": tids[n], "args": {"name": n}} for n in names]
        body = [{**e, "tid": tids[e["tid"]]} for e in events]
        Path(path).write_text(json.dumps({"traceEvents": meta + body, "displayTimeUnit": "ms"}))
