"""Studies: experiments that measure the AsyncOPD, AReaL and EffOPD findings on the built-in
task and write a report to ``docs/study/<name>.md`` (``asyncopd study NAME``).

Each study is a module whose ``run`` is a :class:`Study`, ``run(out_dir, work_dir, *, quick,
seeds, jobs, command) -> Path``: it trains or evaluates what it needs, writes its tables and
plots through :class:`asyncopd_jax.studies.report.Report` and returns the report's path. ``--quick``
shrinks every study to minutes (the test suite runs it, so study code cannot rot); its
numbers are not the study's findings. ``jobs`` training runs go side by side where a
study trains many (``training_runs.run_trainings``); a study that measures time ignores it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol

# name → module (imported on demand: a study pulls in the trainer and matplotlib)
STUDIES: dict[str, str] = {
    "kl_direction": "asyncopd_jax.studies.kl_direction",
    "stabilisers": "asyncopd_jax.studies.stabilisers",
    "cache_bias_variance": "asyncopd_jax.studies.cache_bias_variance",
    "throughput": "asyncopd_jax.studies.throughput",
    "rl_staleness": "asyncopd_jax.studies.rl_staleness",
    "extrapolation": "asyncopd_jax.studies.extrapolation",
    "cross_tokenizer": "asyncopd_jax.studies.cross_tokenizer",
    "multi_turn": "asyncopd_jax.studies.multi_turn",
    "lora": "asyncopd_jax.studies.lora",
}


class Study(Protocol):
    """The ``run`` of a study module: writes the report under ``out_dir`` (the runs it trains
    under ``work_dir``) and returns the report's path."""

    def __call__(
        self,
        out_dir: str | Path,
        work_dir: str | Path,
        *,
        quick: bool = ...,  # every study has its own defaults
        seeds: int = ...,
        jobs: int = ...,
        command: str = ...,
    ) -> Path: ...


def get_study(name: str) -> Study:
    """The ``run`` function of study ``name``, or a ValueError naming the allowed ones."""
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; allowed: {', '.join(sorted(STUDIES))}")
    return importlib.import_module(STUDIES[name]).run


__all__ = ["STUDIES", "Study", "get_study"]
