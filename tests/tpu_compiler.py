"""The mark of a test that compiles for TPU chips with XLA's TPU compiler (libtpu) on this
CPU machine: it skips where libtpu is absent (the README's test command), and CI installs
libtpu and runs every such test (``pytest -m tpu_compiler``)."""

from __future__ import annotations

import pytest

from asyncopd_jax.scale.chips import libtpu_available

REASON = "XLA's TPU compiler needs libtpu (pip install 'asyncopd-jax[tpu]'; CI installs it and runs -m tpu_compiler)"


def needs_libtpu(test):
    """Mark ``test`` (a function or class) as compiling for TPU chips."""
    return pytest.mark.tpu_compiler(pytest.mark.skipif(not libtpu_available(), reason=REASON)(test))
