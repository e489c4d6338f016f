"""Shared pytest set-up: a CPU run, and small random problems for the estimator tests."""

from __future__ import annotations

import os

# Tests run on the CPU; the mesh tests ask for 8 virtual devices before JAX starts.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
