"""The XLA flags of test processes: ``tests/conftest.py`` sets them for the test session
(and the stage processes it starts, which inherit them); tests that start JAX processes of
their own with another device count pass :func:`host_devices` on."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

# Most of a test's time is XLA compiling tiny models (tests/sampling/test_sampler.py: 85 s
# of 137 s in 541 compilations), little is running them: LLVM's optimisation passes are
# skipped, which cuts the suite's CPU time by about a quarter. And XLA:CPU's older elemental
# emitters replace its MLIR fusion emitters (`--xla_cpu_use_fusion_emitters=false`): they
# compile a trivial op in ~13 ms instead of ~21, and the tests dispatch hundreds of eager ops
# each (tests/learner/test_step.py: 50 s -> 32 s; the README's command 7 min 11 s -> 4 min
# 42 s, 2026-11-27). Values are unchanged (no fast-math either way; the suite passes under
# both); speed is measured by the benchmarks, never by tests, and runs compile with XLA's
# defaults.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
EMITTERS = "--xla_cpu_use_fusion_emitters=false"


@functools.cache
def _fast_compile() -> str:
    """:data:`FAST_COMPILE`, and :data:`EMITTERS` where the installed XLA takes it: XLA aborts
    a process on a flag it does not know, and the base install's floor (JAX 0.4.34, CI's
    oldest-JAX step) predates this one. Asked once, of a throwaway CPU client, unless the
    flag is already in this process's ``XLA_FLAGS`` (a test worker inherits its session's)."""
    if EMITTERS in os.environ.get("XLA_FLAGS", ""):
        return f"{FAST_COMPILE} {EMITTERS}"
    probe = "import jax; jax.devices()"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": EMITTERS}
    known = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0
    return f"{FAST_COMPILE} {EMITTERS}" if known else FAST_COMPILE


def host_devices(n: int) -> str:
    """``XLA_FLAGS`` for a CPU process with ``n`` virtual devices, compiling fast."""
    return f"--xla_force_host_platform_device_count={n} {_fast_compile()}"
