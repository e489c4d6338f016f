"""Accelerators a run can be planned for: each chip's capacity and peak rates, and the
devices of a topology that does not exist on this machine.

A TPU topology (``v5e-16``, ``v6e-8``, ``v5p-8``) comes from libtpu's own description of
that slice (``jax.experimental.topologies.get_topology_desc``): XLA's TPU compiler then
compiles for those chips on a CPU-only machine, and its memory and cost analyses are the
chip's. A GPU node (``h100-8``) has no such description here: its devices are XLA:CPU
devices standing in for the GPUs (``--xla_force_host_platform_device_count``), so its
figures are XLA:CPU's (which overstate a TPU's memory about 2x), stated as a proxy.

Peak rates are the vendors' dense bf16 matmul throughput, HBM bandwidth and chip-to-chip
interconnect bandwidth (ICI on TPUs, NVLink on GPUs: the figure of a chip's links in both
directions together); HBM is what XLA may use (v5e: 15.75 GiB of the 16 GiB, as its
compiler reports).
"""

from __future__ import annotations

import dataclasses
import os
import re

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator: what a plan compares its figures with."""

    name: str
    hbm_bytes: float  # memory XLA may allocate on one chip
    peak_flops: float  # dense bf16 matmul FLOP/s
    hbm_bytes_per_s: float
    interconnect_bytes_per_s: float  # chip-to-chip, both directions together (vendor's figure)

    @property
    def copy_bytes_per_s(self) -> float:
        """What one chip receives (or sends) per second over its links: half the vendor's
        both-directions figure, the rate of a one-way copy such as a weight hand-over."""
        return self.interconnect_bytes_per_s / 2


CHIPS: dict[str, Chip] = {
    # ICI: 1,600 / 3,584 / 4,800 Gbit/s per chip (Cloud TPU's v5e, v6e and v5p pages);
    # NVLink 4: 900 GB/s per GPU
    "v5e": Chip("TPU v5e", 15.75 * GIB, 197e12, 819e9, 200e9),
    "v6e": Chip("TPU v6e", 31.25 * GIB, 918e12, 1640e9, 448e9),
    "v5p": Chip("TPU v5p", 95.0e9, 459e12, 2765e9, 600e9),
    "h100": Chip("NVIDIA H100 SXM 80 GB", 80.0e9, 989e12, 3350e9, 900e9),
    "h200": Chip("NVIDIA H200 141 GB", 141.0e9, 989e12, 4800e9, 900e9),
}

# Cloud TPU names count chips (v5e, v6e) or TensorCores (v5p: two per chip).
_CORES_PER_CHIP = {"v5e": 1, "v6e": 1, "v5p": 2}
_TPU_TOPOLOGY_NAME = {"v5e": "v5e", "v6e": "v6e", "v5p": "v5p"}  # libtpu's names of the chips


@dataclasses.dataclass(frozen=True)
class Topology:
    """A named slice: its chip, its devices, and whether they are the chips themselves
    (``compiler`` says whose compiler produced a plan's figures)."""

    name: str
    chip: Chip
    devices: tuple  # jax.Device of the slice (TPU) or XLA:CPU stand-ins (GPU)
    compiler: str  # "XLA:TPU (libtpu)" or "XLA:CPU (a proxy for the GPUs)"

    @property
    def proxy(self) -> bool:
        return not self.compiler.startswith("XLA:TPU")

    @property
    def platform(self) -> str:
        """What a run on these chips would detect: ``tpu``, or ``gpu`` for the GPU proxies."""
        return "gpu" if self.proxy else "tpu"


# The chip grids libtpu names slices by: 2-D for v5e / v6e, 3-D for v5p.
_GRIDS_2D = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_GRIDS_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8"}


def parse_topology(name: str) -> tuple[str, int]:
    """``"v5e-16"`` → ``("v5e", 16 chips)``; ``"v5p-8"`` → ``("v5p", 4)``; ``"h100-8"`` → ``("h100", 8)``."""
    match = re.fullmatch(r"([a-z0-9]+)-(\d+)", name.strip().lower())
    if match is None or match.group(1) not in CHIPS:
        raise ValueError(f"--topology {name!r}: expected <chip>-<count> with chip one of {sorted(CHIPS)} (e.g. v5e-16)")
    kind, count = match.group(1), int(match.group(2))
    cores = _CORES_PER_CHIP.get(kind, 1)
    if count % cores:
        raise ValueError(f"--topology {name!r}: {kind} slices are named by TensorCores, {cores} per chip")
    return kind, count // cores


def proxy_devices_needed(name: str) -> int:
    """XLA:CPU devices this process must have to stand in for topology ``name`` (0: a TPU
    slice, compiled by libtpu). Set before JAX starts its CPU client."""
    kind, chips = parse_topology(name)
    return 0 if kind in _TPU_TOPOLOGY_NAME else chips


def get_topology(name: str) -> Topology:
    """The devices of slice ``name`` for ahead-of-time compilation.

    TPU slices need libtpu (``pip install "asyncopd-jax[tpu]"``) and nothing else: no TPU
    is touched. GPU nodes need that many XLA:CPU devices in this process
    (``XLA_FLAGS=--xla_force_host_platform_device_count=N``, which ``asyncopd plan`` sets).
    """
    import jax

    kind, chips = parse_topology(name)
    if kind in _TPU_TOPOLOGY_NAME:
        from jax.experimental import topologies

        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no cloud metadata server to ask
        # compiling touches no chip: let two plans (or a plan and a test) load libtpu at once
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        grids = _GRIDS_3D if kind == "v5p" else _GRIDS_2D
        if chips not in grids:
            raise ValueError(f"--topology {name!r}: a {kind} slice of {sorted(grids)} chips")
        grid = grids[chips]
        try:
            desc = topologies.get_topology_desc(platform="tpu", topology_name=f"{_TPU_TOPOLOGY_NAME[kind]}:{grid}")
        except Exception as err:  # noqa: BLE001 - libtpu missing or refusing: one line that says which
            raise ValueError(
                f"--topology {name}: XLA's TPU compiler is not available ({str(err).splitlines()[0][:160]}); "
                'install libtpu with pip install "asyncopd-jax[tpu]"'
            ) from None
        return Topology(name, CHIPS[kind], tuple(desc.devices), "XLA:TPU (libtpu)")
    devices = jax.devices("cpu")
    if len(devices) < chips:
        raise ValueError(
            f"--topology {name}: needs {chips} XLA:CPU devices standing in for the GPUs, this process has "
            f"{len(devices)} (set XLA_FLAGS=--xla_force_host_platform_device_count={chips} before JAX starts)"
        )
    return Topology(name, CHIPS[kind], tuple(devices[:chips]), "XLA:CPU (a proxy for the GPUs)")


def libtpu_available() -> bool:
    """Whether XLA's TPU compiler can be loaded (libtpu installed)."""
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None
