"""The disk fills at checkpoint time: the run stops with one line naming the last good
checkpoint, nothing half-written is left, and --resume continues from that checkpoint.

The fault is real: a running ``asyncopd train`` gets a file-size limit (``prlimit``,
RLIMIT_FSIZE) below the size of its checkpoint but above its logs, so the kernel refuses
the checkpoint's writes (EFBIG, "File too large") as it would refuse them on a full disk
(ENOSPC); Python ignores SIGXFSZ, so the write fails instead of killing the process.
"""

from __future__ import annotations

import re
import resource
import sys
import time

import pytest

from asyncopd_jax.config import save_config
from asyncopd_jax.pipeline.run_outputs import RunDir
from tests.pipeline.test_trainer import _config, models  # noqa: F401
from tests.scenarios.test_kill_resume import _cli, _steps

pytestmark = pytest.mark.e2e  # a scenario: the end-to-end step (-m e2e)

LIMIT = 400_000  # bytes: a checkpoint of the tiny student and its Adam moments is ~1.2 MB


@pytest.mark.slow  # ~2 min on 2 cores (two CLI runs); keeps CI under 30 minutes
@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and hasattr(resource, "prlimit")),
    reason="sets another process's file-size limit with prlimit (Linux)",
)
def test_a_full_disk_at_checkpoint_time_keeps_the_last_good_checkpoint(models, tmp_path):  # noqa: F811
    cfg = _config(
        models, tmp_path, name="full", **{"schedule.mode": "sync", "train.steps": 30, "train.checkpoint_every": 3}
    )
    config_file = tmp_path / "config.yaml"
    save_config(cfg, config_file)
    run = tmp_path / "full"
    proc = _cli("--config", str(config_file))
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None and not (run / "checkpoints" / "3").is_dir():
            time.sleep(0.02)
        assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))
        output = proc.communicate(timeout=300)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]  # Orbax's logged traceback went to the log file
    last_line = output.strip().splitlines()[-1]
    said = re.search(
        r"saving the checkpoint of step (\d+) failed \(File too large\); the last good checkpoint is "
        r"step (\d+) in (\S+); free space",
        last_line,
    )
    assert said, output[-3000:]
    failed, good = int(said.group(1)), int(said.group(2))
    assert good >= 3 and failed > good and said.group(3) == str(run.resolve() / "checkpoints" / str(good))
    leftovers = [p.name for p in (run / "checkpoints").iterdir() if "tmp" in p.name]
    assert not leftovers, leftovers
    assert RunDir(run).latest_checkpoint() == good

    resumed = _cli("--resume", str(run))
    output = resumed.communicate(timeout=600)[0].decode(errors="replace")
    assert resumed.returncode == 0, output[-3000:]
    assert _steps(run) == list(range(1, 31))  # from the good checkpoint on, every step once
