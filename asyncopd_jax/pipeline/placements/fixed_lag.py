"""The ``fixed_lag`` schedule: every optimizer step trains on rollouts exactly k versions old.

The other schedules bound staleness (η) but let it vary with timing. For studies of how
estimators behave under staleness, ``fixed_lag`` makes it a controlled variable: the
learner at policy version t (after t optimizer steps) trains on a batch sampled, whole
and without weight swaps, by the policy of version ``max(v₀, t − k)`` (v₀ = 0 in a fresh
run: the first k steps are clamped to the initial policy). Sampling and scoring run in
the learner's thread, one batch per step, so the run is a deterministic function of the
seed: batch t's prompts and sampling key depend on (seed, t) only.

A resumed run restores only version v₀ = the checkpoint's step (older policies are not
checkpointed), so its first k steps after the resume are clamped to v₀ and less stale
than k; ``staleness_max`` in metrics.jsonl shows it.
"""

from __future__ import annotations

from pathlib import Path

from asyncopd_jax.pipeline.rollout_stage import RolloutStage
from asyncopd_jax.pipeline.staleness import RolloutGroup


class FixedLagRollouts:
    """Produces each step's batch on demand from the policy ``lag`` versions back (a
    :class:`~asyncopd_jax.pipeline.placements.Stages` with nothing in the background). The
    snapshot store of ``stage`` must keep ``lag + 1`` versions."""

    def __init__(self, *, stage: RolloutStage, lag: int, first_version: int):
        self.stage, self.lag = stage, lag
        self.first_version = first_version  # the oldest policy this run holds
        self._index = first_version

    def take(self, version: int) -> list[RolloutGroup]:
        """The batch for the step taken at policy ``version``: one group of the whole batch,
        sampled by version ``max(first_version, version − lag)`` and scored."""
        behaviour = max(self.first_version, version - self.lag)
        self._index = version + 1  # group numbers follow steps: the same in every run
        return [self.stage.group(self._index, version=behaviour)]

    def start(self) -> None:
        """Nothing runs in the background."""

    def join(self, timeout: float = 60.0) -> None:
        """Nothing runs in the background."""

    @property
    def groups_started(self) -> int:
        return self._index

    def consumed(self, taken: list[RolloutGroup]) -> None:
        """Nothing to do: groups never leave this process."""

    def unlearned(self) -> list[int]:
        """None: groups never outlive this process."""
        return []

    def checkpointed(self) -> None:
        """Nothing to do: groups never leave this process."""

    def trace_files(self) -> list[Path]:
        return []
