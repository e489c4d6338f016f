"""Ctrl-C stops a run even when its signal is handled inside JAX's garbage-collection hook.

JAX puts a Python function in ``gc.callbacks`` (``jax._src.lib._xla_gc_callback``), and
CPython discards an exception raised in a gc callback (an "unraisable" exception). A
SIGINT that arrives while the main thread is in C code that allocates (JAX's C++ pytree
and dispatch code, tracing) is often handled at the first Python code that runs next:
that callback. The default handler's KeyboardInterrupt was then lost and the run went on
(docs/reliability.md); the trainer's own handler only sets a flag, which nothing can lose.
"""

from __future__ import annotations

import gc
import signal
import threading
from typing import Any

import pytest

from asyncopd_jax.pipeline.run_outputs import RunDir
from asyncopd_jax.pipeline.trainer import Trainer
from tests.pipeline.test_trainer import _config, models  # noqa: F401 - fixture

pytestmark = pytest.mark.e2e  # a scenario: the end-to-end step (-m e2e)

STEPS = 40


def test_ctrl_c_handled_inside_a_gc_callback_stops_the_run_at_the_step_reached(models, tmp_path):  # noqa: F811
    cfg = _config(models, tmp_path, **{"train.steps": STEPS, "train.checkpoint_every": STEPS})
    trainer = Trainer(cfg, progress=False)
    metrics = tmp_path / "t" / "metrics.jsonl"
    fired: list[bool] = []

    def ctrl_c_in_gc(phase: str, info: dict[str, Any]) -> None:
        # Once the first step is logged, SIGINT from inside a gc callback of the main thread:
        # the Python-level handler runs right here, as it does in JAX's callback when Ctrl-C
        # lands while C code allocates. (Registered first, so it runs before JAX's.)
        if fired or threading.current_thread() is not threading.main_thread() or not metrics.is_file():
            return
        fired.append(True)
        signal.raise_signal(signal.SIGINT)

    gc.callbacks.insert(0, ctrl_c_in_gc)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.run()
    finally:
        gc.callbacks.remove(ctrl_c_in_gc)
    assert fired, "no garbage collection ran in the main thread after the first step"
    steps = [r["step"] for r in RunDir(tmp_path / "t").read_metrics()]
    assert steps[-1] < STEPS  # stopped, not trained to the end
    assert RunDir(tmp_path / "t").latest_checkpoint() == steps[-1]  # the step reached, saved on Ctrl-C
