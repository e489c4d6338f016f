"""The host side of multi-turn rollouts: each stream row's episode, between the turns the
continuous engine samples.

A turn that called a tool parks on the device (:mod:`~asyncopd_jax.sampling.schedule`); the
stream hands its text to the row's environment on the worker pool
(:class:`~asyncopd_jax.environments.EnvironmentPool`) and keeps decoding the other slots.
When the observation is ready its ids join the trajectory, which goes back to the device's
queue as a *continuation*: the whole context so far and the answer column the next turn
starts at (the device prefills only what its parked pages lack). The episode ends when the
environment says done, or when the observation leaves no room for another student token
in the answer's ``T`` columns (``truncated``).

A trajectory's answer columns hold every turn and observation in order::

    prompt | turn 1 … <call>…<stop> | observation 1 | turn 2 … <stop>
             student tokens          environment     student tokens

``environment`` marks the observation's columns: context for the student and the
teacher, outside every loss (:attr:`~asyncopd_jax.cache.RolloutBatch.environment_mask`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from asyncopd_jax.environments.pool import EnvironmentPool
from asyncopd_jax.environments.protocol import Environment, Observation


@dataclasses.dataclass(frozen=True)
class Turns:
    """What a stream needs to run multi-turn episodes: the pool that runs the environments'
    steps, a student turn's tokens as text, and an observation's text as token ids (in the
    student's format: for a chat model, the template's tool turn). The pool serves one
    stream at a time: its steps are keyed by the stream's rows."""

    pool: EnvironmentPool
    text: Callable[[Sequence[int]], str]
    ids: Callable[[str], list[int]]

    def observation_ids(self, observation: Observation) -> list[int]:
        """The ids an observation adds to the context."""
        if observation.ids is not None:
            return list(observation.ids)
        return self.ids(observation.text or "")


@dataclasses.dataclass
class Episode:
    """One stream row's episode so far."""

    environment: Environment
    begin: int = 0  # the answer column the next turn starts at
    turns: int = 0  # student turns ended
    tool_calls: int = 0
    tool_errors: int = 0
    observation_tokens: int = 0
    truncated: bool = False  # an observation left no room for another turn
    asked: float = 0.0  # when the last turn went to the environment (time.monotonic)
    seconds: float = 0.0  # environment time, summed over its steps
    waited_when_asked: float = 0.0  # the stream's waiting_seconds when the last turn went out
    blocked_seconds: float = 0.0  # of ``seconds``, those the stream waited with nothing to decode


@dataclasses.dataclass
class EpisodeStats:
    """What a stream's episodes did (:attr:`~asyncopd_jax.sampling.EngineStats.episodes`)."""

    episodes: int = 0  # ended
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    observation_tokens: int = 0
    truncated: int = 0
    environment_seconds: float = 0.0  # summed over steps (steps run at once count each)
    waiting_seconds: float = 0.0  # the stream blocked on environments with nothing to decode
    overlapped_seconds: float = 0.0  # decode calls run while environment steps were pending

    def add(self, episode: Episode) -> None:
        self.episodes += 1
        self.turns += episode.turns
        self.tool_calls += episode.tool_calls
        self.tool_errors += episode.tool_errors
        self.observation_tokens += episode.observation_tokens
        self.truncated += episode.truncated
        self.environment_seconds += episode.seconds


def record_step(episode: Episode, observation: Observation, waited: float) -> None:
    """An observation's figures into its episode (``waited``: the stream's
    :attr:`EpisodeStats.waiting_seconds` now)."""
    episode.seconds += time.monotonic() - episode.asked
    episode.blocked_seconds += waited - episode.waited_when_asked
    episode.tool_calls += observation.calls
    episode.tool_errors += observation.error is not None
