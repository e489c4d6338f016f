"""The sampler benchmark still runs against today's sampler (it reaches into the prefill, a
private method: the benchmark broke unnoticed once when the sampler was rewritten)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_sampler_runs_at_a_tiny_size():
    args = ["--batch", "2", "--prompt", "4", "--new", "4", "--vocab", "64", "--repeats", "1"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_sampler.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ours: prefill only" in done.stdout and "decode throughput ratio" in done.stdout
