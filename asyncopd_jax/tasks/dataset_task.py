"""A user's dataset as a task (``task.name: dataset``): prompts from a JSONL or Parquet file,
rewards from the math-answer grader where the file has reference answers.

Prompts are rendered through the tokenizer's chat template (``models.encode_prompts``),
all of them once at start-up, so the prompt length is known and a prompt too long for the
model fails before training with the rows named. A fixed share of the examples is held out
for the held-out accuracy (``task.eval_fraction``, at most ``task.eval_prompts`` of them).
Without an answer field (distillation needs none) rewards and accuracy are NaN: reported as
"n/a", never trained on.

With tools (``environment.tools``) the answers are multi-turn in the model's own format: a
turn that opens a ``<tool_call>`` and ends on the stop token parks; its calls (Qwen3's
``<tool_call>`` JSON, :func:`~asyncopd_jax.environments.tool_calls.parse_hermes`) run, and
the outputs come back as the chat template's tool turn up to the next assistant turn
(:mod:`asyncopd_jax.environments.chat_turns`). The tokenizer must have ``<tool_call>`` as
one token and a template that writes tool turns: else the task refuses in one line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
from transformers import PreTrainedTokenizerBase

from asyncopd_jax.config import TaskConfig
from asyncopd_jax.environments.chat_turns import observation_text
from asyncopd_jax.environments.pool import EnvironmentPool
from asyncopd_jax.environments.protocol import Environment, Tool
from asyncopd_jax.environments.tool_calls import parse_hermes
from asyncopd_jax.environments.tool_environment import ToolEnvironment
from asyncopd_jax.sampling.episodes import Turns
from asyncopd_jax.tasks.dataset import DatasetError, Example, read_examples, rows_text, split_held_out
from asyncopd_jax.tasks.math_grader import grade
from asyncopd_jax.tasks.prompt_task import PromptTask

TOOL_CALL = "<tool_call>"  # what opens a call in Qwen3's format (its tokenizer: one added token)


class DatasetTask(PromptTask):
    """Items are :class:`~asyncopd_jax.tasks.dataset.Example` s."""

    def __init__(
        self,
        task: TaskConfig,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_new_tokens: int,
        max_positions: int | None = None,
        require_answers: bool = False,
        tools: Sequence[Tool] = (),
    ):
        super().__init__(tokenizer)
        self.path = task.path
        self.tools, self.max_turns = list(tools), task.max_turns
        if self.tools:
            self.tool_call_ids = (self._tool_call_id(),)
            self.stop_text = cast(str, tokenizer.convert_ids_to_tokens(self.eos_id))
            observation_text(tokenizer, ["0"], self.stop_text)  # the template writes tool turns: else its one line
        examples = read_examples(
            task.path, task.prompt_field, task.answer_field or None, require_answers=require_answers
        )
        self.train_items, held = split_held_out(examples, task.eval_fraction)
        self.eval_items = [e for e in held if e.answer is not None][: task.eval_prompts]
        self._ids = dict(zip(examples, super().encode(examples)))  # every prompt tokenized once, here
        self.prompt_slots = max(len(ids) for ids in self._ids.values())
        self.max_new_tokens = max_new_tokens
        if max_positions is not None and self.prompt_slots + max_new_tokens > max_positions:
            too_long = sorted(e.row for e in examples if len(self._ids[e]) + max_new_tokens > max_positions)
            shown = ", ".join(map(str, too_long[:10])) + (
                f" and {len(too_long) - 10} more" if len(too_long) > 10 else ""
            )
            raise DatasetError(
                f"{task.path}: rows {shown}: prompt + sampling.max_new_tokens ({max_new_tokens}) is longer than the "
                f"models' context ({max_positions} positions; longest prompt {self.prompt_slots} tokens), the smaller "
                "max_position_embeddings of the student's and the teacher's config.json; shorten those prompts, drop "
                "them, or lower sampling.max_new_tokens"
            )

    def _tool_call_id(self) -> int:
        """The id of ``<tool_call>``: one token of the tokenizer (a ValueError naming it if not)."""
        ids = self.tokenizer.encode(TOOL_CALL, add_special_tokens=False)
        if len(ids) != 1:
            name = getattr(self.tokenizer, "name_or_path", "") or "(unnamed)"
            raise ValueError(
                f"environment.tools: tokenizer {name} writes {TOOL_CALL} as {len(ids)} tokens, not one; allowed: a "
                "tokenizer with tool calls in Qwen3's format (an added token <tool_call>)"
            )
        return int(ids[0])

    def environment(self, example: Example) -> Environment:
        """The example's tools, called in Qwen3's format, answered in the template's tool turn."""
        return ToolEnvironment(self.tools, self.max_turns, parse=parse_hermes, render=self._tool_turn)

    def _tool_turn(self, outputs: list[str]) -> str:
        return observation_text(self.tokenizer, outputs, self.stop_text)

    def turns(self, pool: EnvironmentPool) -> Turns:
        """A turn's text with its markers kept (``<tool_call>`` may be an added special token),
        an observation's text in this tokenizer's ids."""
        return Turns(pool=pool, text=self._turn_text, ids=self.text_ids)

    def _turn_text(self, ids: Sequence[int]) -> str:
        return cast(str, self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def encode(self, items: Sequence[Example]) -> list[list[int]]:
        return [self._ids[e] for e in items]

    def prompt_text(self, example: Example) -> str:
        return example.prompt

    def score(self, example: Example, response: str) -> float:
        return float("nan") if example.answer is None else grade(response, example.answer)

    def fields(self, example: Example) -> Mapping[str, Any]:
        """The row's own fields, as the file holds them."""
        return example.fields

    def bounding_items(self) -> list[Example]:
        return self.train_items

    def where(self, examples: Sequence[Example]) -> str:
        return f"{self.path}: {rows_text(sorted(e.row for e in examples))}"

    def train_prompts(self, rng: np.random.Generator, n: int) -> tuple[list[list[int]], list[Example]]:
        """``n`` training examples drawn uniformly (without replacement within a batch where
        the dataset is large enough)."""
        picks = rng.choice(len(self.train_items), size=n, replace=len(self.train_items) < n)
        items = [self.train_items[i] for i in picks]
        return self.encode(items), items


__all__ = ["DatasetTask"]
