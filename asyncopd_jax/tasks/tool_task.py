"""The built-in tool task seen through a tokenizer (``task.name = tools``): a
:class:`PromptTask` whose answers are multi-turn trajectories with the calculator
(:mod:`asyncopd_jax.tasks.tool_arith`).

Besides a prompt task's parts it gives what a multi-turn rollout needs: a problem's
environment, the ids that open a tool call (those holding ``C``: ``sampling.tool_call_ids``), and the
conversions between a turn's ids and text (:meth:`turns`). Its SFT batches are teacher
trajectories with the observations marked as environment tokens (context, outside the
loss), and its accuracy is measured multi-turn, the calculator answering.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import jax.numpy as jnp
import numpy as np
from transformers import PreTrainedTokenizerBase

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.config import TaskConfig
from asyncopd_jax.environments.pool import EnvironmentPool
from asyncopd_jax.environments.protocol import Environment
from asyncopd_jax.sampling import left_pad
from asyncopd_jax.sampling.episodes import Turns
from asyncopd_jax.tasks.prompt_task import PromptTask
from asyncopd_jax.tasks.tool_arith import CALL, Habit, ToolProblem, environment, sample_problems, verify

SPARE_TURN = 12  # answer slots past the longest teacher trajectory: room for one more call


class ToolTaskData(PromptTask):
    """The tool task through one tokenizer; items are :class:`ToolProblem` s (module docstring).

    ``max_new_tokens`` holds the longest teacher trajectory (the ``steps`` habit at operands
    of ``max_value``, every turn's EOS and both observations) and a spare call's room.
    """

    def __init__(self, task: TaskConfig, tokenizer: PreTrainedTokenizerBase):
        super().__init__(tokenizer)
        self.task = task
        worst = ToolProblem(task.max_value, task.max_value, task.max_value)
        self.prompt_slots = len(self.encode([worst])[0])
        self.max_new_tokens = self._trajectory_ids(worst, "steps")[0].shape[0] + SPARE_TURN
        self.eval_items = sample_problems(
            np.random.default_rng(task.seed + 12345), task.eval_prompts, task.max_value, held_out=True
        )
        # every token that writes the call's mark: ``C`` alone, or merged (``C:``, ``C:1``, …)
        special = set(tokenizer.all_special_ids)
        calls = sorted(i for token, i in tokenizer.get_vocab().items() if CALL[0] in token and i not in special)
        if not calls:
            name = getattr(tokenizer, "name_or_path", "") or "(unnamed)"
            raise ValueError(
                f"task.name = tools: tokenizer {name} has no token holding {CALL[0]!r} "
                "(use the tools or tools_merges tokenizer)"
            )
        # without tools (task.tools = False) no token calls: single-turn, a call ends the answer
        self.tool_call_ids: tuple[int, ...] = tuple(calls) if task.tools else ()

    # --- a prompt task ---

    def prompt_text(self, problem: ToolProblem) -> str:
        return problem.prompt

    def score(self, problem: ToolProblem, response: str) -> float:
        return float(verify(problem, response))

    def train_prompts(self, rng: np.random.Generator, n: int) -> tuple[list[list[int]], list[ToolProblem]]:
        problems = sample_problems(rng, n, self.task.max_value, held_out=False)
        return self.encode(problems), problems

    def fields(self, problem: ToolProblem) -> dict[str, str]:
        """``prompt`` (``Q:a*b+c=``) and ``answer``."""
        return {"prompt": problem.prompt, "answer": str(problem.answer)}

    def bounding_items(self) -> list[ToolProblem]:
        m = self.task.max_value
        return [ToolProblem(m, m, m)]

    def where(self, problems: Sequence[ToolProblem]) -> str:
        return "problems " + ", ".join(p.prompt for p in problems[:3]) + (" …" if len(problems) > 3 else "")

    # --- multi-turn ---

    def environment(self, problem: ToolProblem) -> Environment:
        """The problem's environment: the calculator, ``task.max_turns`` student turns."""
        return environment(self.task.max_turns)

    def turns(self, pool: EnvironmentPool) -> Turns:
        """The multi-turn rollouts' :class:`Turns` over ``pool``: a turn's text without its
        EOS, an observation's text in this tokenizer's ids."""
        return Turns(pool=pool, text=self._text, ids=self.text_ids)

    def _text(self, ids: Sequence[int]) -> str:
        return cast(str, self.tokenizer.decode(list(ids), skip_special_tokens=True))

    # --- data ---

    def _trajectory_ids(self, problem: ToolProblem, habit: Habit) -> tuple[np.ndarray, np.ndarray]:
        """A teacher trajectory's ids (each turn then EOS, each observation) and ``[T]`` True
        on the observations'."""
        ids: list[int] = []
        environment: list[bool] = []
        for turn, observation in problem.trajectory(habit):
            said = self.text_ids(turn) + [self.eos_id]
            heard = self.text_ids(observation) if observation else []
            ids += said + heard
            environment += [False] * len(said) + [True] * len(heard)
        return np.asarray(ids, np.int32), np.asarray(environment, bool)

    def sft_batch(self, rng: np.random.Generator, batch_size: int, habit: Habit | None = None) -> RolloutBatch:
        """Training problems with the teacher's trajectories of ``habit`` (default
        ``task.tool_habit``): the observations are environment tokens."""
        problems = sample_problems(rng, batch_size, self.task.max_value, held_out=False)
        prompts, mask = left_pad(self.encode(problems), self.pad_id, self.prompt_slots)
        tokens = np.full((batch_size, self.max_new_tokens), self.pad_id, np.int32)
        environment = np.zeros(tokens.shape, bool)
        student = np.zeros(tokens.shape, bool)
        for row, problem in enumerate(problems):
            ids, heard = self._trajectory_ids(problem, habit or self.task.tool_habit)
            tokens[row, : len(ids)], environment[row, : len(ids)] = ids, heard
            student[row, : len(ids)] = ~heard
        return RolloutBatch(
            prompt_tokens=jnp.asarray(prompts),
            prompt_mask=jnp.asarray(mask),
            response_tokens=jnp.asarray(tokens),
            response_mask=jnp.asarray(student),
            behavior_logp=jnp.zeros(tokens.shape, jnp.float32),
            token_version=jnp.zeros(tokens.shape, jnp.int32),
            environment_mask=jnp.asarray(environment),
        )
