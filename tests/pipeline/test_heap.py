"""Freed heap memory goes back to the kernel: a real fragmented heap shrinks when trimmed,
and the trimmer trims on its schedule."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from asyncopd_jax.pipeline import heap
from asyncopd_jax.pipeline.heap import HeapTrimmer, trim_heap


def _anonymous_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise KeyError("RssAnon")


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not Path("/proc/self/status").is_file(),
    reason="malloc_trim is glibc's; resident memory is read from /proc",
)
def test_a_fragmented_heap_is_given_back_to_the_kernel():
    """256 MiB in 64 KiB blocks (below glibc's mmap threshold: they live in the heap), then
    every block freed but one in 16: the kept blocks pin the heap's top, so free() alone
    cannot shrink it — the freed 240 MiB stay resident until trimmed."""
    blocks = [bytearray(64 * 1024) for _ in range(4096)]  # bytearray zero-fills: every page touched
    kept = blocks[::16]
    del blocks
    before = _anonymous_kb()
    assert trim_heap()
    freed_mib = (before - _anonymous_kb()) / 1024
    assert freed_mib > 128, f"trimming gave back only {freed_mib:.0f} MiB"
    del kept


def test_the_trimmer_trims_once_per_interval():
    now = [0.0]
    calls = []
    trimmer = HeapTrimmer(every_seconds=30, clock=lambda: now[0], trim=lambda: calls.append(now[0]) or True)
    for t in (0, 10, 29.9, 30, 31, 59, 61, 200):
        now[0] = t
        trimmer()
    assert calls == [30, 61, 200] and trimmer.trims == 3


def test_without_malloc_trim_it_does_nothing(monkeypatch):
    monkeypatch.setattr(heap, "_MALLOC_TRIM", None)
    assert trim_heap() is False
