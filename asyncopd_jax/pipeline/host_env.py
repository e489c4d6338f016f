"""A process's devices and cores, set before JAX starts in it.

The layout (:mod:`asyncopd_jax.pipeline.layout`) decides which devices and cores each stage
owns; this module turns that into what a process is started with: the platform's own
device-visibility variables (``CUDA_VISIBLE_DEVICES``, libtpu's chip variables, the XLA:CPU
device count) and a CPU affinity. Nothing here starts JAX.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from asyncopd_jax.pipeline.layout import Layout, StagePlan, device_ids

# TPU chips of one process, as libtpu's ``TPU_CHIPS_PER_PROCESS_BOUNDS`` (x, y, z).
TPU_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
TPU_BASE_PORT = 8476  # libtpu's default; a stage process with chips of its own gets the next ones
_CPU_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=\d+")


def detect_platform() -> str:
    """``tpu``, ``gpu`` or ``cpu``, without starting JAX: ``JAX_PLATFORMS`` when set, else
    the accelerator device files of this host."""
    configured = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if configured:
        return "gpu" if configured in ("cuda", "rocm", "gpu") else configured
    dev = Path("/dev")
    if any(dev.glob("accel[0-9]*")) or any(p.name.isdigit() for p in (dev / "vfio").glob("*")):
        return "tpu"
    if (dev / "nvidia0").exists():
        return "gpu"
    return "cpu"


def cpu_device_flags(count: int, flags: str = "") -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with the XLA:CPU device count set to ``count``
    (every other flag kept)."""
    setting = f"--xla_force_host_platform_device_count={count}"
    if _CPU_DEVICE_COUNT.search(flags):
        return _CPU_DEVICE_COUNT.sub(setting, flags)
    return f"{flags} {setting}".strip()


def device_env(platform: str, devices: Sequence[int], port: int = TPU_BASE_PORT) -> dict[str, str]:
    """The environment that gives a new process exactly ``devices`` of this host.

    GPU: ``CUDA_VISIBLE_DEVICES``. TPU: the chip-visibility variables of libtpu for an
    independent process (its own one-process "slice": ``TPU_PROCESS_BOUNDS=1,1,1``) over
    1, 2, 4 or 8 chips, with its own port. CPU: ``XLA_FLAGS`` (the inherited flags) with as
    many XLA:CPU devices as ``devices`` lists (a process's CPU devices are its own; its
    cores are pinned instead). ``()``: nothing (every device visible).
    """
    if not devices:
        return {}
    ids = ",".join(map(str, devices))
    if platform == "cpu":
        return {"XLA_FLAGS": cpu_device_flags(len(devices), os.environ.get("XLA_FLAGS", ""))}
    if platform == "gpu":
        return {"CUDA_VISIBLE_DEVICES": ids}
    if platform == "tpu":
        if len(devices) not in TPU_CHIP_BOUNDS:
            raise ValueError(f"a TPU stage process holds 1, 2, 4 or 8 chips, not {len(devices)} ({ids})")
        return {
            "TPU_VISIBLE_CHIPS": ids,
            "TPU_PROCESS_BOUNDS": "1,1,1",
            "TPU_CHIPS_PER_PROCESS_BOUNDS": TPU_CHIP_BOUNDS[len(devices)],
            "TPU_PROCESS_PORT": str(port),
            "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
            "CLOUD_TPU_TASK_ID": "0",
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
        }
    raise ValueError(f"unknown platform {platform!r}; known: cpu, gpu, tpu")


def stage_port(index: int) -> int:
    """The libtpu port of the stage process at ``index`` (each its own, past the learner's)."""
    return TPU_BASE_PORT + 1 + index


def stage_process_env(layout: Layout, stage: StagePlan, platform: str, local_count: int) -> dict[str, str]:
    """The device variables of ``stage``'s own process, started by the learner's process
    (which sees ``local_count`` devices): on a GPU or TPU its listed devices made visible
    (none listed: every device), on a CPU as many XLA:CPU devices as :func:`device_ids`
    gives it (one when none are listed)."""
    if platform == "cpu":
        return device_env(platform, device_ids(layout, stage, local_count, platform))
    return device_env(platform, stage.devices, stage_port(layout.stages.index(stage)))


def pin_this_process(cores: Sequence[int]) -> None:
    """Restrict this process to ``cores`` (call before JAX starts: XLA sizes its CPU thread
    pool to the cores the process may use)."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))


def prepare_learner_process(layout: Layout, platform: str) -> None:
    """Before JAX starts in the learner's process: pin it, and when stage processes hold
    devices of their own, make only the learner's devices visible to it (a GPU or TPU; a
    CPU process's devices are its own: :func:`~asyncopd_jax.pipeline.layout.launcher_chose_devices`)."""
    learner = layout.learner
    pin_this_process(learner.cores)
    if layout.stage_processes() and platform != "cpu":
        os.environ.update(device_env(platform, learner.devices))
