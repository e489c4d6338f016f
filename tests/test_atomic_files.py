"""Atomic writes: the old content survives a failed write, and no temporary file is left."""

from __future__ import annotations

import errno

import pytest

from asyncopd_jax import atomic_files
from asyncopd_jax.atomic_files import write_text_atomically


def test_replaces_the_content(tmp_path):
    path = tmp_path / "f.json"
    write_text_atomically(path, "old")
    write_text_atomically(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_a_full_disk_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "f.json"
    write_text_atomically(path, "old")

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic_files.os, "fsync", no_space)  # the write fails before the rename
    with pytest.raises(OSError, match="No space left"):
        write_text_atomically(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f.json"]
