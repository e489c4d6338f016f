"""What the learner reports per step: the metrics record's throughput and the progress bar."""

from __future__ import annotations

import time
from typing import Any

from asyncopd_jax.pipeline.learner_stage import teacher_metric, teacher_names


class Throughput:
    """Samples and tokens trained on since the run (or resume) started."""

    def __init__(self) -> None:
        self.start, self.samples, self.tokens = time.perf_counter(), 0, 0

    def add(self, samples: int, tokens: int) -> dict[str, float]:
        """Count a step; the rates since the start and the seconds elapsed (``time``)."""
        self.samples += samples
        self.tokens += tokens
        elapsed = time.perf_counter() - self.start
        return {"samples_per_s": self.samples / elapsed, "tokens_per_s": self.tokens / elapsed, "time": elapsed}


class ProgressBar:
    """A tqdm bar showing loss, KL signal, staleness and accuracy (silent when disabled)."""

    def __init__(self, start: int, total: int, enabled: bool):
        self.bar = None
        self.last_eval: float | None = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(self, record: dict[str, Any]) -> None:
        if self.bar is None:
            return
        self.last_eval = record.get("eval_accuracy", self.last_eval)
        post = {
            "loss": f"{record['loss']:.4f}",
            "kl": f"{record.get('reverse_kl_signal', 0.0):.3f}",
            "stale": f"{record['staleness_mean']:.2f}",
        }
        names = teacher_names(record)
        if len(names) > 1:  # several teachers: each one's KL on its rows of this batch
            post.update(
                {
                    f"kl_{n}": f"{record[teacher_metric(n, 'kl')]:.3f}"
                    for n in names
                    if teacher_metric(n, "kl") in record
                }
            )
        if "rollout_accuracy" in record:
            post["acc"] = f"{record['rollout_accuracy']:.2f}"
        if "tool_calls_per_answer" in record:  # multi-turn: the tool calls an answer makes
            post["calls"] = f"{record['tool_calls_per_answer']:.2f}"
        if "environment_overlap" in record:  # and the share of tool time the engine kept decoding
            post["overlap"] = f"{record['environment_overlap']:.2f}"
        if self.last_eval is not None:
            post["eval"] = f"{self.last_eval:.2f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
