"""The progress bar's figures: a multi-turn run shows its calls an answer and the share of
tool time the engine kept decoding."""

from __future__ import annotations

from asyncopd_jax.pipeline.progress import ProgressBar


def test_a_multi_turn_step_shows_its_calls_and_overlap():
    bar = ProgressBar(0, 10, enabled=True)
    assert bar.bar is not None
    record = {"loss": 0.5, "staleness_mean": 1.0, "tool_calls_per_answer": 1.25, "environment_overlap": 0.875}
    bar.update(record)
    shown = bar.bar.postfix
    bar.close()
    assert "calls=1.25" in shown and "overlap=0.88" in shown
    single = ProgressBar(0, 10, enabled=True)
    single.update({"loss": 0.5, "staleness_mean": 1.0})
    assert "calls" not in single.bar.postfix and "overlap" not in single.bar.postfix
    single.close()
