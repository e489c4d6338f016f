"""The guide's quick-tour pictures (docs/images/): a demo run logged to TensorBoard, a real
``tensorboard`` serving it on loopback, photographed by headless Chromium, and the run's
own ``report.png``.

    apt-get install chromium              # Debian's; any Chromium or Chrome with --headless
    pip install -e ".[tensorboard]"
    python tools/screenshots.py           # the demo (1,200 steps, ~2 min on 2 cores), then the pictures
    python tools/screenshots.py --steps 100 --out /tmp/images   # a quick look

Writes ``tensorboard.png`` (TensorBoard's scalars of the run: eval/, train/, rollout/) and
``report.png`` into ``--out`` (default ``docs/images``).
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Chromium as a one-shot camera: no sandbox (root in a container), no GPU, nothing fetched
# from the network (the machine may have none), a profile of its own.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--hide-scrollbars",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(run_root: Path, steps: int) -> Path:
    """The demo as ``asyncopd train`` runs it, logged to TensorBoard; its run directory."""
    command = [sys.executable, "-m", "asyncopd_jax.cli", "train", "--no-progress"]
    sets = [
        "name=tour",
        f"output_dir={run_root}",
        f"train.steps={steps}",
        f"train.eval_every={max(steps // 12, 1)}",
        "logging.sinks=[jsonl,tensorboard]",
    ]
    subprocess.run([*command, *(arg for s in sets for arg in ("--set", s))], check=True)
    return run_root / "tour"


def serve(logdir: Path, port: int) -> subprocess.Popen:
    """``tensorboard`` on 127.0.0.1:``port``, once it answers."""
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=2):
                return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise RuntimeError(f"tensorboard did not answer on port {port} within 60 s")


def photograph(chromium: str, url: str, out: Path, size: str, profile: Path) -> None:
    """A screenshot of ``url`` after its scripts had ``--virtual-time-budget`` to draw."""
    subprocess.run(
        [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={size}",
            "--virtual-time-budget=20000",
            f"--screenshot={out}",
            url,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=120,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1200, help="train.steps (the demo's: 1200)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("google-chrome") or "chromium")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        run = train(Path(work) / "runs", args.steps)
        shutil.copyfile(run / "report.png", args.out / "report.png")
        port = free_port()
        server = serve(run / "tensorboard", port)
        try:
            # the scalars dashboard, the grouped names filtered to the three a newcomer reads first
            url = (
                f"http://127.0.0.1:{port}/#scalars&tagFilter=eval%2Faccuracy%7Ctrain%2Floss%7Crollout%2Fstaleness_mean"
            )
            photograph(args.chromium, url, args.out / "tensorboard.png", "1400,900", Path(work) / "profile")
        finally:
            server.kill()
    print(f"wrote {args.out / 'tensorboard.png'} and {args.out / 'report.png'}")


if __name__ == "__main__":
    main()
