"""How long a test lets the pipeline wait before it fails: at most a minute, so that a hang
fails in seconds rather than after a real run's patience.

The package's defaults are sized for real runs: a rollout waits up to 600 s for the policy
version it must start from (``stages.startup_timeout``, ``GroupProducer(version_timeout=)``),
a snapshot store 300 s (``wait_for``), the processes of a distributed learner 300 s for each
other (``distributed.initialization_timeout``). A test that hung on one of them would wait
it out before failing (or be cut by the per-test limit, ``timeout`` in pyproject.toml,
with no error message of its own). Every test that starts the pipeline passes these instead.
Healthy, these waits take seconds in a test: the longest is a ``sync`` rollout waiting for
the learner's first step, compilation included.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Sequence

WAIT_S = 60  # seconds: the longest a test waits on a version, a snapshot or a peer process

# As config overrides: ``load_config(path, [*SHORT_WAIT_SETS, ...])`` or ``{**SHORT_WAITS, ...}``.
SHORT_WAITS = {"stages.startup_timeout": WAIT_S, "distributed.initialization_timeout": WAIT_S}
SHORT_WAIT_SETS = tuple(f"{k}={v}" for k, v in SHORT_WAITS.items())


def communicate_all(procs: Sequence[subprocess.Popen], timeout: float) -> list[str]:
    """The output of each of ``procs`` (started with ``stdout=PIPE``) once all have exited.
    Processes that wait for each other (the processes of one distributed learner) would wait
    for a peer that died until their own timeouts: as soon as one exits with an error, or at
    ``timeout``, the others are killed."""
    outputs = [""] * len(procs)

    def read(i: int) -> None:
        outputs[i] = procs[i].communicate()[0].decode(errors="replace")

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for r in readers:
        r.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for r in readers:
        r.join(timeout=30)
    return outputs
