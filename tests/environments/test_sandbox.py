"""The ``python`` tool's sandbox: each limit reached is the call's output and nothing
outside its working directory changes; where the isolation cannot be set up, the tool is
refused in one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncopd_jax.environments import sandbox
from asyncopd_jax.environments.sandbox import PythonSandbox, SandboxLimits, isolation_problem

PROBLEM = isolation_problem()
needs_isolation = pytest.mark.skipif(PROBLEM is not None, reason=f"no sandbox here: {PROBLEM}")
LIMITS = SandboxLimits(cpu_s=1, wall_s=3, memory_mb=256, output_chars=100, disk_mb=1)


def run(code: str) -> str:
    return PythonSandbox(LIMITS)({"code": code})


@needs_isolation
def test_code_runs_and_prints():
    assert run("print(sum(range(10)))") == "45\n"


@needs_isolation
@pytest.mark.parametrize(
    "code, says",
    [
        ("while True: pass", "error: the code used more than 1 s of CPU"),
        ("x = bytearray(1 << 30)", "error: the code used more than 256 MB of memory"),
        ("import time; time.sleep(60)", "error: the code ran past 3 s (wall clock) and was stopped"),
        ("print('y' * 150)", "error: the output has more than 100 characters; kept the first 100"),
        ("print('y' * 10_000)", "error: the code wrote more than 400 bytes (output or a file)"),
        ("open('big', 'wb').write(b'0' * 10_000)", "error: the code wrote more than 400 bytes (output or a file)"),
    ],
)
def test_each_limit_is_the_calls_output(code, says):
    out = run(code)
    assert out.endswith(says), out[-300:]
    assert len(out) <= LIMITS.output_chars + len(says) + 1


@needs_isolation
def test_there_is_no_network():
    connect = "socket.create_connection(('1.1.1.1', 80), timeout=2)"
    out = run(f"import socket\ntry:\n    {connect}\nexcept OSError as e:\n    print(e)")
    assert "Network is unreachable" in out


@needs_isolation
def test_nothing_outside_its_working_directory_changes(tmp_path):
    outside = tmp_path / "keep.txt"
    outside.write_text("before")
    code = (
        "import os\n"
        f"for path in ({str(outside)!r}, {str(tmp_path / 'new.txt')!r}, '/tmp/new.txt'):\n"
        "    try:\n"
        "        open(path, 'w').write('after')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print(e.strerror)\n"
        "open('here.txt', 'w').write('fine')\n"
        "print(os.listdir('.'))\n"
    )
    out = run(code)
    assert out.count("Read-only file system") == 3 and "wrote" not in out and "['here.txt']" in out
    assert outside.read_text() == "before" and sorted(os.listdir(tmp_path)) == ["keep.txt"]
    assert not Path("/tmp/new.txt").exists()


@needs_isolation
def test_each_call_starts_in_a_fresh_directory():
    first = run("open('mark', 'w').write('x'); import os; print(os.getcwd(), os.listdir('.'))")
    assert first.startswith("/tmp/asyncopd-sandbox-") and first.endswith(" ['mark']\n"), first
    assert run("import os; print(os.listdir('.'))") == "[]\n" and not Path(first.split()[0]).exists()


def test_without_isolation_the_tool_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    isolation_problem.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="^the python tool needs util-linux's unshare, which is not on PATH$"):
            PythonSandbox()
    finally:
        monkeypatch.undo()
        isolation_problem.cache_clear()


def test_a_failing_isolation_step_is_named(monkeypatch):
    """Where a namespace cannot be made, the probe's own error is the line (never run unsandboxed)."""
    monkeypatch.setattr(sandbox, "_LAUNCHER", "raise SystemExit('sandbox: mount_setattr read-only failed: EPERM')")
    isolation_problem.cache_clear()
    try:
        problem = isolation_problem()
        assert problem is not None and problem.endswith("sandbox: mount_setattr read-only failed: EPERM"), problem
        with pytest.raises(RuntimeError, match="cannot isolate its code here"):
            PythonSandbox()
    finally:
        monkeypatch.undo()
        isolation_problem.cache_clear()
