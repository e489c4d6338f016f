"""Teacher servers as child processes on loopback: ``asyncopd serve-teacher`` and vLLM's
OpenAI-compatible server, started and waited for until ``/health`` answers.

A run never starts its teacher server (it connects to ``teacher.server.url``); the
benchmark that compares them (``benchmarks/bench_scoring.py``) and the tests that need a
real server do. A server that exits while starting, or does not answer in time, raises
:class:`ServerFailed` with the tail of its log.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

VLLM_START_S = 600  # healthy: 1-6 minutes on 2 cores (its warm-up compile)
SERVE_TEACHER_START_S = 120


class ServerFailed(RuntimeError):
    """A teacher server that did not come up; the message ends with its log's tail."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_teacher_command(model: str, port: int, *extra: str) -> list[str]:
    """``asyncopd serve-teacher --model MODEL`` on 127.0.0.1:``port`` (``extra``: more flags)."""
    return [sys.executable, "-m", "asyncopd_jax.entry", "serve-teacher", "--model", model, "--port", str(port), *extra]


def vllm_command(python: str, model: Path, port: int, max_logprobs: int = 32, *extra: str) -> list[str]:
    """vLLM's OpenAI server for the model directory as it is (``--dtype float32``, as our
    scorer) from the interpreter ``python`` of an environment with vLLM installed
    (``extra``: more flags, e.g. ``--enable-lora``)."""
    return [
        python,
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
        *extra,
    ]


def vllm_env() -> dict[str, str]:
    """The environment vLLM's CPU build starts in here: a 1 GiB KV cache, no JAX platform pin."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("JAX_PLATFORMS", None)
    return env


def start(command: Sequence[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``command`` in a session of its own, its output appended to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            list(command), stdout=out, stderr=subprocess.STDOUT, env=env or dict(os.environ), start_new_session=True
        )


def wait_until_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    """Return once ``url``/health answers 200; :class:`ServerFailed` if the server exits
    or does not come up within ``timeout`` seconds (it is then killed)."""
    import httpx2  # the `served` extra

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerFailed(f"{url}: the server exited with {process.returncode} while starting; {tail(log)}")
        with contextlib.suppress(httpx2.TransportError):
            if httpx2.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    stop(process)
    raise ServerFailed(f"{url}/health did not answer within {timeout:.0f} s; {tail(log)}")


def stop(process: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL after ``timeout`` seconds."""
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def running(
    command: Sequence[str], port: int, log: Path, timeout: float, env: dict[str, str] | None = None
) -> Iterator[str]:
    """The server ``command`` (listening on 127.0.0.1:``port``) until the block ends; yields its URL."""
    process = start(command, log, env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, process, log, timeout)
        yield url
    finally:
        if process.poll() is None:
            stop(process)


def tail(log: Path, lines: int = 40) -> str:
    """The last ``lines`` of ``log``, introduced."""
    text = "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.is_file() else "(no log)"
    return f"its log ({log}) ends:\n{text}"


__all__ = [
    "ServerFailed",
    "free_port",
    "running",
    "serve_teacher_command",
    "start",
    "stop",
    "vllm_command",
    "vllm_env",
    "wait_until_healthy",
]
