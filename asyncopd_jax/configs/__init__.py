"""The run configurations shipped inside the package (so a wheel install has them too).

``asyncopd train --config NAME`` takes a bundled name (``demo``, ``rl``, …) as well as a
path: :func:`resolve` prefers an existing file and falls back to the bundled config.
"""

from __future__ import annotations

from pathlib import Path

DIRECTORY = Path(__file__).resolve().parent


def names() -> list[str]:
    """The bundled configs, by name (file name without ``.yaml``)."""
    return sorted(p.stem for p in DIRECTORY.glob("*.yaml"))


def bundled(name: str) -> Path:
    """The path of bundled config ``name`` (``demo``, ``rl``, …)."""
    path = DIRECTORY / f"{name}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no bundled config {name!r}; bundled: {', '.join(names())}")
    return path


def resolve(path_or_name: str | Path) -> Path:
    """``path_or_name`` if it is a file, else the bundled config of that name (with or
    without ``.yaml``); a clear error naming both when it is neither."""
    path = Path(path_or_name)
    if path.is_file():
        return path
    name = path.name.removesuffix(".yaml")
    if path.parent == Path(".") and (DIRECTORY / f"{name}.yaml").is_file():
        return DIRECTORY / f"{name}.yaml"
    raise FileNotFoundError(
        f"config file not found: {path} (a path to a YAML file, or a bundled config: {', '.join(names())})"
    )


DEMO = DIRECTORY / "demo.yaml"
RL = DIRECTORY / "rl.yaml"
