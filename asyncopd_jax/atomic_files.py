"""Files written atomically: a reader (or a resumed run after a crash) sees the old
content or the new, never a torn file.

The text goes to a temporary sibling, is flushed to disk, and is renamed over the target
(``os.replace`` is atomic within a file system). A full disk or a killed process leaves
the old file intact and at worst a ``*.tmp`` sibling, which the next write replaces.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_text_atomically(path: str | Path, text: str) -> None:
    """Replace ``path``'s content with ``text`` in one step."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. ENOSPC: keep the old file and no half-written sibling
        raise
