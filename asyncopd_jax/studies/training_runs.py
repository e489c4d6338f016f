"""Training runs for the studies: one ``Trainer`` run per setting, kept so that a study
continues where it stopped, on this machine or another.

A finished run is kept twice:

- its whole run directory, ``<work>/<name>/`` (metrics, trace, student, ``study.json``),
  on this machine only (``runs/`` is not versioned);
- one line of the study's **ledger**, ``docs/study/<study>/runs.jsonl``, next to the
  report and versioned with it: the run's settings, summary, error and, as columns, the
  per-step metrics the reports read (``LEDGER_KEYS``, 4 significant digits). A study
  skips every run its ledger already holds with the same settings, so a study of a few
  hundred runs can be spread over several sittings or machines, and its report can be
  rebuilt from the ledger without training anything.

``run_trainings`` runs what is missing ``jobs`` at a time, each in its own process pinned
to its own share of the cores (several small runs side by side use a small machine better
than one run over every core: two one-core runs on this project's 2-core machine finish
1.45× more runs per minute than one two-core run at a time).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import shutil
import time
import traceback
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from asyncopd_jax import configs
from asyncopd_jax.config import load_config

DEMO, RL = configs.DEMO, configs.RL

# The per-step metrics a ledger keeps (the rest stays in the run directory).
LEDGER_KEYS = (
    "step",
    "loss",
    "grad_norm",
    "zero_grad_fraction",
    "importance_ratio_max",
    "staleness_mean",
    "staleness_max",
    "rollout_accuracy",
    "probe_reverse_kl",
    "probe_forward_kl",
    "probe_drift_kl",
)


def fixed_lag_sets(
    *,
    seed: int,
    lag: int,
    learning_rate: float,
    batch_size: int,
    steps: int,
    diagnostics_every: int,
    probe_prompts: int,
    eval_prompts: int,
    warmup_steps: int = 0,
) -> list[str]:
    """The overrides every study run shares: exact staleness ``lag``, a constant learning
    rate after ``warmup_steps`` of linear warm-up, no periodic eval or checkpoint (one
    held-out eval at the end), probe diagnostics."""
    return [
        f"seed={seed}",
        "schedule.mode=fixed_lag",
        f"schedule.lag={lag}",
        f"optim.learning_rate={learning_rate}",
        f"optim.warmup_steps={warmup_steps}",
        "optim.schedule=constant",
        f"learner.batch_size={batch_size}",
        f"train.steps={steps}",
        f"train.eval_every={10**6}",
        f"train.checkpoint_every={10**6}",
        f"train.diagnostics_every={diagnostics_every}",
        f"train.diagnostic_prompts={probe_prompts}",
        f"task.eval_prompts={eval_prompts}",
    ]


def mean_curve(results: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], np.ndarray]:
    """``(steps, mean)``: the logged metric ``key`` against the step, averaged over the runs
    (one per seed) that logged it at the same steps as the first; ``([], [])`` if it did not."""
    curves = [[(r["step"], r[key]) for r in result["records"] if key in r] for result in results]
    steps = [step for step, _ in curves[0]] if curves else []
    same = [[value for _, value in c] for c in curves if [step for step, _ in c] == steps]
    return steps, (np.nanmean(same, axis=0) if steps else np.array([]))


# --- held-out accuracy of runs keyed (arm, seed) -------------------------------------------------


def accuracy_curve(result: dict) -> tuple[np.ndarray, np.ndarray]:
    """(eval steps, held-out accuracy) of a run."""
    points = [(r["step"], r["eval_accuracy"]) for r in result["records"] if "eval_accuracy" in r]
    return np.array([p[0] for p in points]), np.array([p[1] for p in points], float)


def final_accuracy(results: dict, arm: str, seeds: int) -> np.ndarray:
    """Each seed's final held-out accuracy of ``arm``."""
    return np.array([results[arm, seed]["summary"].get("student_after", np.nan) for seed in range(seeds)], float)


def mean_accuracy(results: dict, arm: str, seeds: int) -> tuple[np.ndarray, np.ndarray]:
    """(eval steps, mean held-out accuracy over the seeds) of ``arm``."""
    curves = [accuracy_curve(results[arm, seed]) for seed in range(seeds)]
    steps = curves[0][0]
    return steps, np.mean([c[1] for c in curves if len(c[1]) == len(steps)], axis=0)


def steps_to(results: dict, arm: str, seeds: int, target: float) -> float:
    """The first evaluation step at which ``arm``'s mean accuracy reaches ``target`` (NaN: never)."""
    steps, accuracy = mean_accuracy(results, arm, seeds)
    hit = np.flatnonzero(accuracy >= target)
    return float(steps[hit[0]]) if hit.size else np.nan


def run_training(work: Path, name: str, sets: Sequence[str], base: Path = DEMO) -> dict[str, Any]:
    """Train the config ``base`` with ``sets`` (``--set`` style overrides) as run ``name``.

    Returns ``{"sets", "records" (metrics.jsonl), "summary" (summary.json), "error"}``;
    a run that raises is recorded with its error (the study goes on). A run already
    finished under ``work`` with the same settings is read back, not trained again.
    """
    from asyncopd_jax.pipeline.trainer import Trainer

    run_dir = work / name
    done = run_dir / "study.json"
    sets = list(sets)
    if done.is_file():
        saved = json.loads(done.read_text())
        if saved["sets"] == sets:
            return saved
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config(base, [f"name={name}", f"output_dir={work}", *sets])
    error = None
    try:
        Trainer(cfg, progress=False).run()
    except Exception as err:  # noqa: BLE001 - a diverged or failed run is a result
        error = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    metrics = run_dir / "metrics.jsonl"
    summary = run_dir / "summary.json"
    result = {
        "sets": sets,
        "records": [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else [],
        "summary": json.loads(summary.read_text()) if summary.is_file() else {},
        "error": error,
    }
    done.write_text(json.dumps(result))
    return result


# --- the ledger ----------------------------------------------------------------------------------


def _round(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value) and value != 0.0:
        return float(f"{value:.4g}")
    return value


def compact(name: str, result: Mapping[str, Any], keys: Sequence[str] = LEDGER_KEYS) -> dict[str, Any]:
    """A run's ledger line: settings, summary, error and the ``keys`` columns: a list
    with one value per step, or, for a key most steps lack (the probe KLs, logged every few
    steps), ``{"at": [record indices], "values": [...]}``."""
    records = result["records"]
    columns: dict[str, Any] = {}
    for key in keys:
        at = [i for i, r in enumerate(records) if key in r]
        values = [_round(records[i][key]) for i in at]
        if len(at) == len(records):
            columns[key] = values
        elif at:
            columns[key] = {"at": at, "values": values}
    return {
        "name": name,
        "sets": list(result["sets"]),
        "summary": result["summary"],
        "error": result["error"],
        "columns": columns,
        "steps": len(records),
    }


def expand(line: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`compact`: ``{"sets", "records", "summary", "error"}`` with one
    record per step holding the ledger's keys that step has."""
    steps = line.get("steps")
    if steps is None:  # ledgers written before sparse columns: every column a full list
        steps = len(next(iter(line["columns"].values()), []))
    records: list[dict[str, Any]] = [{} for _ in range(steps)]
    for key, column in line["columns"].items():
        pairs = zip(column["at"], column["values"]) if isinstance(column, dict) else enumerate(column)
        for i, value in pairs:
            if value is not None:
                records[i][key] = value
    return {"sets": line["sets"], "records": records, "summary": line["summary"], "error": line["error"]}


def read_ledger(path: Path) -> dict[str, dict[str, Any]]:
    """name → ledger line (a later line for the same name replaces an earlier one)."""
    if not path.is_file():
        return {}
    lines = (json.loads(text) for text in path.read_text().splitlines() if text.strip())
    return {line["name"]: line for line in lines}


def _append(path: Path, line: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:  # one write of one line: a killed study leaves whole lines
        f.write(json.dumps(line, separators=(",", ":")) + "\n")


# --- running what is missing -------------------------------------------------------------------


def _pin_from(cores: Any) -> None:
    """Pool initializer: take this worker's share of the cores before JAX starts."""
    from asyncopd_jax.pipeline.host_env import pin_this_process

    pin_this_process(cores.get())


def train(
    work: Path, name: str, sets: list[str], base: Path = DEMO, keys: Sequence[str] = LEDGER_KEYS
) -> tuple[dict[str, Any], float]:
    """Train one run (:func:`run_training`); return its ledger line (``keys`` as columns) and
    the seconds it took. ``functools.partial`` of it, with another ``base`` or ``keys``, is
    what a study passes to :func:`run_trainings` (the pool's workers import it)."""
    start = time.perf_counter()
    return compact(name, run_training(work, name, sets, base), keys), time.perf_counter() - start


def sft_arm(
    name: str,
    sets: list[str],
    model: Any,
    batches: Iterator,
    cfg: Any,
    accuracy: Callable[[Any, Any], float],
    teacher_accuracy: float,
    fields: Mapping[str, str],
) -> dict[str, Any]:
    """A study's SFT arm: ``model`` trained by :func:`~asyncopd_jax.learner.sft.train_sft`
    on ``batches`` for ``cfg.train.steps`` steps with ``cfg.optim``, its held-out
    ``accuracy(graphdef, params)`` before, every ``cfg.train.eval_every`` steps and at the
    end. Returns its ledger line: each step's ``loss``, each record key of ``fields`` from
    the step's metric it names (NaN where a step has none), and ``eval_accuracy``."""
    from flax import nnx

    from asyncopd_jax.learner.sft import train_sft

    steps = cfg.train.steps
    before = accuracy(*nnx.split(model))
    records: list[dict[str, Any]] = []

    def on_step(step: int, metrics: dict, graphdef: Any, params: Any) -> None:
        record: dict[str, Any] = {"step": step, "loss": metrics["loss"]}
        record.update({key: metrics.get(metric, np.nan) for key, metric in fields.items()})
        if step % cfg.train.eval_every == 0 or step == steps:
            record["eval_accuracy"] = accuracy(graphdef, params)
        records.append(record)

    train_sft(model, batches, steps, cfg.optim, on_step=on_step)
    summary = {
        "student_before": before,
        "student_after": records[-1]["eval_accuracy"],
        "teacher_accuracy": teacher_accuracy,
        "steps": steps,
    }
    result = {"sets": sets, "records": records, "summary": summary, "error": None}
    return compact(name, result, ("step", "loss", *fields, "eval_accuracy"))


def default_jobs() -> int:
    """One run per core this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


K = TypeVar("K", bound=Hashable)


def run_trainings(
    work: Path,
    ledger: Path,
    runs: Mapping[K, tuple[str, Sequence[str]]],
    *,
    jobs: int = 1,
    shared: Sequence[Path] = (),
    train: Callable[[Path, str, list[str]], tuple[dict[str, Any], float]] = train,
) -> dict[K, dict[str, Any]]:
    """Every run of ``runs`` (key → (name, overrides)), from the ledger where it is there,
    else copied from a ``shared`` ledger (another study's) that holds a run with exactly the
    same overrides, else trained (``jobs`` at a time, each pinned to its own cores); each
    run lands in the ledger.

    ``train(work, name, sets) -> (ledger line, seconds)`` trains one run (a module-level
    function: the workers import it). Returns key → ``{"sets", "records", "summary",
    "error"}`` (records: the ledger's keys).
    """
    if jobs < 1:
        raise ValueError(f"jobs = {jobs} is invalid; allowed: >= 1")
    names = [name for name, _ in runs.values()]
    if len(set(names)) != len(names):
        raise ValueError("run names must be unique within a study")
    have = read_ledger(ledger)
    todo = [(name, list(sets)) for name, sets in runs.values() if name not in have or have[name]["sets"] != list(sets)]
    elsewhere = {json.dumps(line["sets"]): line for path in shared for line in read_ledger(path).values()}
    for name, sets in [t for t in todo if json.dumps(t[1]) in elsewhere]:
        _append(ledger, {**elsewhere[json.dumps(sets)], "name": name})
        todo.remove((name, sets))
    if todo:
        print(
            f"{len(runs) - len(todo)} of {len(runs)} runs in {ledger}; training {len(todo)}, {jobs} at a time",
            flush=True,
        )
    done = 0

    def record(line: dict[str, Any], seconds: float) -> None:
        nonlocal done
        done += 1
        _append(ledger, line)
        after = line["summary"].get("student_after")
        outcome = f"error: {line['error']}" if line["error"] else f"accuracy {after:.1%}" if after is not None else ""
        print(f"[{done}/{len(todo)}] {line['name']}: {outcome} ({seconds:.0f} s)", flush=True)

    if jobs == 1 or len(todo) <= 1:
        for name, sets in todo:
            record(*train(work, name, sets))
    elif todo:
        from asyncopd_jax.pipeline.layout import split_ids

        # spawn: JAX is not fork-safe once started; each worker starts its own runtime after pinning
        context = multiprocessing.get_context("spawn")
        cores = context.Queue()
        workers = min(jobs, len(todo))
        for share in split_ids(sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [], workers):
            cores.put(share)
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_pin_from, initargs=(cores,)) as pool:
            futures = [pool.submit(train, work, name, sets) for name, sets in todo]
            try:
                for future in as_completed(futures):
                    record(*future.result())
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
    have = read_ledger(ledger)
    return {key: expand(have[name]) for key, (name, _) in runs.items()}
