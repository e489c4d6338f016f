"""A run's hyperparameters as the sinks record them: the resolved config (flat, dotted
field names), the code version and where the stages run."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import asyncopd_jax
from asyncopd_jax.config import RunConfig, flatten, to_dict


def _scalar(value: Any) -> Any:
    """A value every sink stores: lists and tuples as their text."""
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


def code_version() -> str:
    """The package version, with the git commit (``+dirty`` for local changes) when the
    package runs from a checkout."""
    root = Path(asyncopd_jax.__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty=+dirty"], cwd=root, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return asyncopd_jax.__version__
    found = commit.stdout.strip() if commit.returncode == 0 else ""
    return f"{asyncopd_jax.__version__} ({found})" if found else asyncopd_jax.__version__


def run_hparams(cfg: RunConfig, layout_lines: list[str]) -> dict[str, Any]:
    """``{field: value}``: every config field, ``code.version`` and ``layout``."""
    fields = {k: _scalar(v) for k, v in flatten(to_dict(cfg)).items()}
    return {**fields, "code.version": code_version(), "layout": " | ".join(layout_lines)}
