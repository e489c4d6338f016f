"""Models shipped with the package for the built-in task, made by ``asyncopd sft``.

``builtin:teacher`` and ``builtin:student`` name the directories here (Hugging Face
layout: ``config.json``, ``model.safetensors``, tokenizer files); any other model path is
a local directory.
"""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).parent
BUILTIN_PREFIX = "builtin:"


def resolve_model_path(path: str) -> Path:
    """``builtin:NAME`` → the shipped directory; anything else → ``Path(path)``."""
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX):]
        directory = ASSETS / name
        if not directory.is_dir():
            shipped = sorted(p.name for p in ASSETS.iterdir() if p.is_dir() and not p.name.startswith("_"))
            raise FileNotFoundError(f"no built-in model {name!r}; shipped: {', '.join(shipped) or 'none'}")
        return directory
    if not path:
        raise FileNotFoundError("no model path given (set student.path / teacher.path, e.g. builtin:teacher)")
    return Path(path)
