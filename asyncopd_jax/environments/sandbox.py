"""The built-in ``python`` tool: a student's code run in a sandbox.

Each call is a fresh process started by ``exec`` (never a ``fork`` that runs Python code in
the child of a process with JAX's threads), through ``unshare`` into new user, network,
mount and PID namespaces; before the code runs, the sandbox's own launcher
(:data:`_LAUNCHER`, in the child):

* makes every mount read-only, recursively (``mount_setattr``), and mounts a fresh, empty
  ``tmpfs`` as the working directory: nothing outside it can be written, and it is gone after;
* sets its limits: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``), bytes a file
  may hold (``RLIMIT_FSIZE``: its output too, which goes to a file of the caller's), open
  files, processes;
* has no network: the new network namespace has only its loopback, down.

The caller adds a wall-clock limit (the process group is killed past it). Each limit reached
is the call's output (an observation: "error: …"), and the run goes on. Where the isolation
cannot be set up (no ``unshare``, user namespaces off, no ``mount_setattr``),
:func:`isolation_problem` says what is missing in one line and :class:`PythonSandbox`
refuses to be made: the code is never run unsandboxed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any

#: Runs in the sandbox's process, then the student's code: argv = [limits as JSON, workdir, program].
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
limits, workdir, program = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
libc = ctypes.CDLL(None, use_errno=True)
MS_REC, MS_PRIVATE, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 0x4000, 0x40000, 0x8000, 0x1
def check(result, what):
    if result != 0:
        raise SystemExit(f"sandbox: {what} failed: {os.strerror(ctypes.get_errno())}")
check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "making mounts private")
class MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("set", "clr", "propagation", "userns")]
attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
AT_FDCWD = -100
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (Linux 5.12+)
done = libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr))
check(done, "mount_setattr read-only")
size = f"size={limits['disk_bytes']}".encode()
check(libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", 0, size), "the working directory's tmpfs")
os.chdir(workdir)
import signal
def out_of_cpu(*_):
    os.write(2, f"\nsandbox: the code used more than {limits['cpu_s']} s of CPU\n".encode())
    os._exit(152)
signal.signal(signal.SIGXCPU, out_of_cpu)  # the soft limit; the hard one, a second later, kills
resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
for name, value in (("RLIMIT_AS", limits["memory_bytes"]), ("RLIMIT_FSIZE", limits["file_bytes"]),
                    ("RLIMIT_NOFILE", 64), ("RLIMIT_NPROC", 64)):
    resource.setrlimit(getattr(resource, name), (value, value))
import runpy
sys.argv = ["main.py"]
runpy.run_path(program, run_name="__main__")  # the student's code, read-only, outside the working directory
"""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """What one call may use: CPU seconds, wall-clock seconds, memory (address space),
    output (characters returned; bytes written to a file, stdout included, at most
    ``output_chars`` · 4), and the working directory's size."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    output_chars: int = 4096
    disk_mb: int = 16


@functools.cache
def isolation_problem() -> str | None:
    """What this machine lacks for the sandbox, in one line, or None (checked once: a
    sandbox that does nothing runs through every step of the isolation)."""
    if shutil.which("unshare") is None:
        return "the python tool needs util-linux's unshare, which is not on PATH"
    done = _run("pass", SandboxLimits(wall_s=30.0))
    if done.returncode != 0:
        why = (done.stderr or done.stdout or f"exit status {done.returncode}").strip().splitlines()[-1:]
        return f"the python tool cannot isolate its code here (user, network and mount namespaces): {' '.join(why)}"
    return None


class PythonSandbox:
    """The ``python`` tool: ``{"code": "print(2 ** 10)"}`` → ``"1024"`` (what it printed,
    stdout then stderr), in the sandbox of the module docstring.

    Raises:
      RuntimeError: at construction, where the isolation cannot be set up (its one line).
    """

    name = "python"

    def __init__(self, limits: SandboxLimits = SandboxLimits()):
        problem = isolation_problem()
        if problem is not None:
            raise RuntimeError(problem)
        self.limits = limits

    def __call__(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ValueError('python takes {"code": "<a Python program>"}')
        done = _run(code, self.limits)
        output = (done.stdout + done.stderr)[: self.limits.output_chars]
        problem = _limit_reached(done, self.limits)
        return f"{output}\nerror: {problem}" if problem else output


def _run(code: str, limits: SandboxLimits) -> subprocess.CompletedProcess:
    """``code`` run once in a fresh sandbox; past ``wall_s`` its processes are killed
    (``returncode`` -9 and ``stderr`` saying so)."""
    workdir = tempfile.mkdtemp(prefix="asyncopd-sandbox-")
    program = os.path.join(tempfile.mkdtemp(prefix="asyncopd-program-"), "main.py")
    with open(program, "w") as file:
        file.write(code)
    settings = {
        "cpu_s": limits.cpu_s,
        "memory_bytes": limits.memory_mb << 20,
        "file_bytes": limits.output_chars * 4,
        "disk_bytes": limits.disk_mb << 20,
    }
    command = [
        "unshare", "--user", "--map-root-user", "--net", "--mount", "--pid", "--fork", "--kill-child",
        sys.executable, "-I", "-c", _LAUNCHER, json.dumps(settings), workdir, program,
    ]  # fmt: skip
    try:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                env={"PATH": "/usr/bin:/bin"},
            )
            try:
                process.wait(timeout=limits.wall_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                timed_out = True
            out.seek(0)
            err.seek(0)
            stdout = out.read(limits.output_chars * 4 + 1).decode(errors="replace")
            stderr = err.read(limits.output_chars * 4 + 1).decode(errors="replace")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(os.path.dirname(program), ignore_errors=True)
    if timed_out:
        stderr += f"\nthe code ran past {limits.wall_s:g} s (wall clock) and was stopped"
    return subprocess.CompletedProcess(command, -9 if timed_out else process.returncode, stdout, stderr)


def _limit_reached(done: subprocess.CompletedProcess, limits: SandboxLimits) -> str | None:
    """Which limit stopped the code, in a line, or None (it ended on its own; an exception of
    its own is in its output already)."""
    lines = done.stderr.strip().splitlines()
    if done.returncode == -9 and "wall clock" in done.stderr:
        return f"the code ran past {limits.wall_s:g} s (wall clock) and was stopped"
    if "File too large" in done.stderr or done.returncode in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ):
        return f"the code wrote more than {limits.output_chars * 4} bytes (output or a file)"
    if "MemoryError" in done.stderr:
        return f"the code used more than {limits.memory_mb} MB of memory"
    if lines and lines[-1].startswith("sandbox: "):  # the launcher's own: CPU, or isolation that failed
        return lines[-1].removeprefix("sandbox: ")
    if lines and lines[-1].startswith("unshare: "):  # killed by a signal unshare could not pass on
        return f"the code was killed (its CPU ({limits.cpu_s} s) or memory ({limits.memory_mb} MB) limit)"
    if len(done.stdout + done.stderr) > limits.output_chars:
        return f"the output has more than {limits.output_chars} characters; kept the first {limits.output_chars}"
    return None
