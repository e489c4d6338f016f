"""Tasks: what the student answers and how an answer is scored.

:class:`~asyncopd_jax.tasks.prompt_task.PromptTask` is what every task gives the pipeline;
the built-in arithmetic task (:mod:`asyncopd_jax.tasks.builtin`) and a user's dataset
(:mod:`asyncopd_jax.tasks.dataset_task`) are its two kinds, and :func:`make_task` picks one
by ``task.name``.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from asyncopd_jax.config import TaskConfig
from asyncopd_jax.environments.protocol import Tool
from asyncopd_jax.tasks.builtin import TaskData, new_model, padded_vocab
from asyncopd_jax.tasks.dataset_task import DatasetTask
from asyncopd_jax.tasks.prompt_task import PromptTask
from asyncopd_jax.tasks.tool_task import ToolTaskData


def make_task(
    task: TaskConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_new_tokens: int,
    max_positions: int | None = None,
    tools: Sequence[Tool] = (),
) -> PromptTask:
    """The task ``task.name`` names: the built-in ``arith`` task or a user's ``dataset``.

    ``max_new_tokens`` (``sampling.max_new_tokens``) bounds the rollouts' answers (and a
    dataset task's evaluation answers; the built-in task evaluates with its own longest
    solution). ``max_positions``, the models' context (the smaller of the student's and the
    teacher's), must hold the longest prompt plus
    the answer: a ``ValueError`` (a ``DatasetError`` naming the rows for a dataset) if not,
    since positions past the context the model was trained on give silently degraded answers.
    ``tools``: a dataset task's (``environment.tools``, :func:`~asyncopd_jax.environments.toolbox.make_tools`).
    """
    if task.name == "dataset":
        return DatasetTask(task, tokenizer, max_new_tokens=max_new_tokens, max_positions=max_positions, tools=tools)
    data = sft_data(task, tokenizer)
    answer = max(max_new_tokens, data.max_new_tokens)  # rollouts: sampling.max_new_tokens; evaluation: the task's
    if max_positions is not None and data.prompt_slots + answer > max_positions:
        raise ValueError(
            f"task.name = {task.name}: the longest prompt ({data.prompt_slots} tokens at task.difficulty = "
            f"{task.difficulty}, task.max_value = {task.max_value}) + the answer ({answer} tokens: "
            f"sampling.max_new_tokens = {max_new_tokens}, longest solution {data.max_new_tokens}) is longer than the "
            f"models' context ({max_positions} positions, the smaller max_position_embeddings of the student's and "
            "the teacher's config.json); lower sampling.max_new_tokens, task.difficulty or task.max_value"
        )
    return data


def sft_data(task: TaskConfig, tokenizer: PreTrainedTokenizerBase) -> TaskData | ToolTaskData:
    """The built-in task ``task.name`` names, whose ``sft_batch`` es ``asyncopd sft`` trains on."""
    if task.name == "dataset":
        raise ValueError("asyncopd sft trains on a built-in task: task.name = arith or tools, not dataset")
    return ToolTaskData(task, tokenizer) if task.name == "tools" else TaskData(task, tokenizer)


__all__ = [
    "DatasetTask",
    "PromptTask",
    "TaskData",
    "ToolTaskData",
    "make_task",
    "new_model",
    "padded_vocab",
    "sft_data",
]
