"""What an environment is to a multi-turn rollout: after each student turn it answers an
:class:`Observation` (the text or token ids that join the context, whether the episode is
done, an optional reward).

A task gives each prompt its own environment (:class:`Environment`); the rollout calls
:meth:`Environment.step` with the student turn's text, off the decode loop, on a worker pool
(:mod:`asyncopd_jax.environments.pool`), so a slot waiting for an observation never stalls
the others. A tool's error, timeout or oversized output is an observation (``error`` set),
never an exception that reaches the run.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One tool call parsed from a student turn: the tool's ``name`` and its ``arguments``."""

    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Observation:
    """What an environment answers after a student turn.

    Attributes:
      text: the text that joins the context (rendered in the model's format by the caller),
        or None where ``ids`` are given.
      ids: token ids that join the context as they are, or None.
      done: the episode ends: no further student turn.
      reward: the episode's reward where it ends with one (RL mode), else None.
      error: what went wrong (a tool's exception, a timeout, output past its limit), or None;
        the observation's text says it to the student too.
      calls: the tool calls the student's turn made (metrics: calls per answer).
    """

    text: str | None = None
    ids: tuple[int, ...] | None = None
    done: bool = False
    reward: float | None = None
    error: str | None = None
    calls: int = 0

    def __post_init__(self) -> None:
        if self.text is not None and self.ids is not None:
            raise ValueError("an observation is text or token ids, not both")


class Environment(Protocol):
    """One prompt's environment (a task makes one per prompt)."""

    def step(self, turn: str) -> Observation:
        """The observation after the student's turn ``turn`` (its text)."""
        ...


class Tool(Protocol):
    """A tool an environment runs: called with a call's arguments, it returns its output text
    or raises (the pool turns an exception into an observation's error)."""

    name: str

    def __call__(self, arguments: dict[str, Any]) -> str: ...
