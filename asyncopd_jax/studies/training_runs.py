"""Training runs for the studies: one ``Trainer`` run per setting, kept on disk so that an
interrupted study continues where it stopped (a finished run with the same settings is
read back instead of trained again)."""

from __future__ import annotations

import json
import shutil
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncopd_jax.config import load_config

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def fixed_lag_sets(*, seed: int, lag: int, learning_rate: float, batch_size: int, steps: int,
                   diagnostics_every: int, probe_prompts: int, eval_prompts: int) -> list[str]:
    """The overrides every study run shares: exact staleness ``lag``, a constant learning
    rate, no periodic eval or checkpoint (one held-out eval at the end), probe diagnostics."""
    return [f"seed={seed}", "schedule.mode=fixed_lag", f"schedule.lag={lag}", f"optim.learning_rate={learning_rate}",
            "optim.warmup_steps=0", "optim.schedule=constant", f"learner.batch_size={batch_size}",
            f"train.steps={steps}", f"train.eval_every={10**6}", f"train.checkpoint_every={10**6}",
            f"train.diagnostics_every={diagnostics_every}", f"train.diagnostic_prompts={probe_prompts}",
            f"task.eval_prompts={eval_prompts}"]


def run_training(work: Path, name: str, sets: Sequence[str]) -> dict[str, Any]:
    """Train ``configs/demo.yaml`` with ``sets`` (``--set`` style overrides) as run ``name``.

    Returns ``{"sets", "records" (metrics.jsonl), "summary" (summary.json), "error"}``;
    a run that raises is recorded with its error (the study goes on).
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
    cfg = load_config(DEMO, [f"name={name}", f"output_dir={work}", *sets])
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
