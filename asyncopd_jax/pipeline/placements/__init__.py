"""What the learner asks of the rollout and scoring stages, wherever they run: the
:class:`Stages` protocol.

Its implementations, one per way the stages can be placed:
:class:`~asyncopd_jax.pipeline.placements.threads.RolloutPool` (rollout threads in the learner's
process), :class:`~asyncopd_jax.pipeline.placements.stage_processes.StageProcesses` (stage processes),
:class:`~asyncopd_jax.pipeline.placements.fixed_lag.FixedLagRollouts` (the ``fixed_lag`` schedule's
batches sampled on demand), and the multi-process learner's views of the leader's
(:mod:`asyncopd_jax.pipeline.placements.multihost`). :func:`asyncopd_jax.pipeline.compose.start_stages`
picks one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from asyncopd_jax.pipeline.staleness import RolloutGroup


class Stages(Protocol):
    """The rollout and scoring stages as the learner sees them."""

    @property
    def groups_started(self) -> int:
        """Index of the last rollout group started (numbered from the run's start)."""
        ...

    def start(self) -> None: ...

    def take(self, version: int) -> list[RolloutGroup]:
        """The groups of the next batch, for the learner at ``version``."""
        ...

    def consumed(self, taken: list[RolloutGroup]) -> None:
        """The learner trained on ``taken``."""
        ...

    def unlearned(self) -> list[int]:
        """Groups started that the learner has not trained on yet. A checkpoint keeps them:
        of the groups an earlier incarnation committed, a resumed run takes only these and
        later ones (any other was learned before the checkpoint)."""
        ...

    def checkpointed(self) -> None:
        """A checkpoint covering every batch consumed so far was saved."""
        ...

    def join(self, timeout: float = 60.0) -> None: ...

    def trace_files(self) -> list[Path]:
        """Trace files the stages wrote in other processes."""
        ...
