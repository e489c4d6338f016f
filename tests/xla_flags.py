"""The XLA flags of test processes: ``tests/conftest.py`` sets them for the test session
(and the stage processes it starts, which inherit them); tests that start JAX processes of
their own with another device count pass :func:`host_devices` on."""

from __future__ import annotations

# Most of a test's time is XLA compiling tiny models (tests/sampling/test_sampler.py: 85 s
# of 137 s in 541 compilations), little is running them: LLVM's optimisation passes are
# skipped, which cuts the suite's CPU time by about a quarter. Values are unchanged (no
# fast-math either way); speed is measured by the benchmarks, never by tests.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def host_devices(n: int) -> str:
    """``XLA_FLAGS`` for a CPU process with ``n`` virtual devices, compiling fast."""
    return f"--xla_force_host_platform_device_count={n} {FAST_COMPILE}"
