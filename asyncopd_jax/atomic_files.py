"""Files written atomically: a reader (or a resumed run after a crash) sees the old
content or the new, never a torn file.

The text goes to a temporary sibling, is flushed to disk, and is renamed over the target
(``os.replace`` is atomic within a file system). A full disk or a killed process leaves
the old file intact and at worst a ``*.tmp`` sibling, which the next write replaces.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


@contextlib.contextmanager
def open_atomically(path: str | Path) -> Iterator[TextIO]:
    """A text file to write piece by piece (text too large to hold at once, e.g. a merged
    trace) that replaces ``path`` when the ``with`` body ends; if the body or the write
    fails, ``path`` keeps its old content."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. ENOSPC: keep the old file and no half-written sibling
        raise


def write_text_atomically(path: str | Path, text: str) -> None:
    """Replace ``path``'s content with ``text`` in one step."""
    with open_atomically(path) as f:
        f.write(text)
