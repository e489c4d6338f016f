"""Shared pytest set-up: a CPU run, a time limit for the slow tests, and small random
problems for the estimator tests."""

from __future__ import annotations

import os

import pytest

from tests.xla_flags import host_devices

# The storage servers and a store on each backend, for every test that asks (tests/storage/fixtures.py).
pytest_plugins = ["tests.storage.fixtures"]

# Tests run on the CPU; the mesh tests ask for 8 virtual devices before JAX starts, and XLA
# compiles without LLVM's optimisation passes (tests/xla_flags.py says why).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "XLA_FLAGS" not in os.environ:  # a test worker inherits its session's
    os.environ["XLA_FLAGS"] = host_devices(8)

# One persistent XLA compilation cache per test session, shared with the stage processes the
# tests start (they inherit the environment): the end-to-end tests build the same models and
# step functions over and over, and most of their time is compilation. The cache is new for each
# session (nothing carries over from another run or JAX version) and removed at its end; it
# is keyed by the computation, so a changed function never hits a stale entry.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and not os.environ.get("MUTANT_UNDER_TEST"):
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="asyncopd-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    # Every program, the trivial eager ops included: both test workers dispatch many of the
    # same ones, and reading one back takes ~6 ms where compiling it takes ~13-20 (the
    # suite's test time fell by 13 % against a 0.1 s floor, 2026-11-27).
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# Under mutation testing (tools/mutation.sh) a failing property test need not be shrunk to
# a minimal example: the failure alone kills the mutant, and shrinking costs minutes.
if os.environ.get("MUTANT_UNDER_TEST"):
    import jax
    from hypothesis import Phase, settings

    settings.register_profile("mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate])
    settings.load_profile("mutation")
    # Every mutant's test process compiles the same unmutated functions again: a persistent
    # compilation cache (keyed by the computation, so a mutated function never hits it)
    # makes a mutant's tests ~2.5x faster.
    jax.config.update(
        "jax_compilation_cache_dir", os.environ.get("MUTATION_JAX_CACHE", "/tmp/asyncopd-mutation-jax-cache")
    )
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# Every test has a time limit (pyproject.toml: `timeout`, sized for the fast suite). The tests
# marked slow run for minutes by design: unless one sets its own (@pytest.mark.timeout), each
# gets an hour, so that a hang in `-m slow` fails too instead of stalling the run.
SLOW_TIMEOUT_S = 3600


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("timeout"):  # pytest-timeout not installed
        return
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
