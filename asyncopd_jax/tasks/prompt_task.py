"""What every task gives the pipeline: prompts as token ids, a reward per response, and the
held-out accuracy of a model.

A task is text (problems, a verifier); here it meets one tokenizer. Prompts go through the
tokenizer's chat template when it has one, responses are decoded and scored by the
task's ``score`` (1 correct, 0 wrong, NaN where the task has no reference to check).
:class:`asyncopd_jax.tasks.builtin.TaskData` (the built-in arithmetic task) and
:class:`asyncopd_jax.tasks.dataset_task.DatasetTask` (a user's JSONL/Parquet file) are
the two kinds; :func:`asyncopd_jax.tasks.make_task` picks by ``task.name``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np
from flax import nnx
from transformers import PreTrainedTokenizerBase

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.environments.pool import EnvironmentPool
from asyncopd_jax.environments.protocol import Environment
from asyncopd_jax.models import encode_prompts
from asyncopd_jax.sampling import Engine, SamplingParams, make_sampler, run_stream
from asyncopd_jax.sampling.episodes import Turns
from asyncopd_jax.tasks.tokenizer import EOS_ID, PAD_ID

EVAL_SLOTS = 32  # slots of a multi-turn task's evaluation stream


class PromptTask:
    """The shared half of a task. A subclass sets ``prompt_slots``, ``max_new_tokens``
    and ``eval_items``, and implements ``prompt_text``, ``score`` and ``train_prompts``."""

    prompt_slots: int
    max_new_tokens: int
    eval_items: Sequence[Any]
    #: the ids that open a tool call (``sampling.tool_call_ids``): a multi-turn task's; () single-turn
    tool_call_ids: tuple[int, ...] = ()

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else PAD_ID
        self.eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else EOS_ID

    # --- what a task defines ---

    def prompt_text(self, item: Any) -> str:
        raise NotImplementedError

    def score(self, item: Any, response: str) -> float:
        """1.0 if ``response`` solves ``item``, 0.0 if not, NaN if it cannot be checked."""
        raise NotImplementedError

    def train_prompts(self, rng: np.random.Generator, n: int) -> tuple[list[list[int]], list[Any]]:
        raise NotImplementedError

    def fields(self, item: Any) -> Mapping[str, Any]:
        """The named fields of ``item`` a teacher-only prompt's template fills
        (:mod:`asyncopd_jax.teacher.prompts`) and a teacher routing field is read from."""
        raise NotImplementedError

    def bounding_items(self) -> Sequence[Any]:
        """Every training item, or items whose fields are at least as long as any the task
        draws: what a teacher prompt's width is measured on, and routing is checked on."""
        raise NotImplementedError

    def where(self, items: Sequence[Any]) -> str:
        """``items`` named for an error message."""
        raise NotImplementedError

    def environment(self, item: Any) -> Environment:
        """A multi-turn task: ``item``'s environment, fresh for each answer."""
        raise NotImplementedError(f"{type(self).__name__} is single-turn: it has no environments")

    def turns(self, pool: EnvironmentPool) -> Turns:
        """A multi-turn task: how its rollouts' turns and observations convert, over ``pool``."""
        raise NotImplementedError(f"{type(self).__name__} is single-turn: it has no environments")

    # --- shared ---

    def encode(self, items: Sequence[Any]) -> list[list[int]]:
        return encode_prompts(self.tokenizer, [self.prompt_text(i) for i in items])

    def text_ids(self, text: str) -> list[int]:
        """``text``'s ids as they continue a sequence (no special tokens added): a multi-turn
        task's observations and turns."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, batch: RolloutBatch) -> list[str]:
        tokens, mask = np.asarray(batch.response_tokens), np.asarray(batch.response_mask)
        # one sequence in, one string out (decode's type also covers a batch: a list)
        return [
            cast(str, self.tokenizer.decode([int(t) for t in row[m] if t != self.eos_id], skip_special_tokens=True))
            for row, m in zip(tokens, mask)
        ]

    def rewards(self, items: Sequence[Any], batch: RolloutBatch) -> list[float]:
        return [self.score(i, r) for i, r in zip(items, self.decode(batch))]

    def accuracy(
        self,
        graphdef: nnx.GraphDef,
        params: nnx.State,
        *,
        items: Sequence[Any] | None = None,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> float:
        """Mean score of the answers of ``(graphdef, params)`` on ``items`` (default: the
        held-out items), greedy or sampled at ``temperature`` with key ``seed`` (NaN if none
        can be checked)."""
        items = self.eval_items if items is None else items
        if not items:
            return float("nan")
        batch = self.rollout(graphdef, params, items, temperature, seed)
        scores = np.asarray(self.rewards(items, batch), np.float64)
        return float(np.nanmean(scores)) if np.isfinite(scores).any() else float("nan")

    def rollout(
        self, graphdef: nnx.GraphDef, params: nnx.State, items: Sequence[Any], temperature: float, seed: int
    ) -> RolloutBatch:
        """The answers :meth:`accuracy` scores: one per item; a multi-turn task's through a
        continuous stream of :data:`EVAL_SLOTS` slots, its environments answering."""
        if not self.tool_call_ids:
            sampling = SamplingParams(
                temperature=temperature,
                max_new_tokens=self.max_new_tokens,
                stop_token_ids=(self.eos_id,),
                chunk_steps=self.max_new_tokens,
            )
            sampler = evaluation_sampler(graphdef, sampling, self.pad_id)
            return sampler.generate(params, self.encode(items), jax.random.key(seed), prompt_slots=self.prompt_slots)
        sampler = evaluation_sampler(graphdef, self.multi_turn_sampling(temperature), self.pad_id)
        pool = EnvironmentPool(workers=4, timeout_s=30)
        try:
            stream = sampler.open_stream(
                params, version=0, prompt_slots=self.prompt_slots, slots=EVAL_SLOTS, turns=self.turns(pool)
            )
            keys = jax.random.split(jax.random.key(seed), len(items))
            stream.submit(None, self.encode(items), keys, [self.environment(i) for i in items])
            ((_, batch),) = run_stream(stream)
        finally:
            pool.close()
        return batch

    def multi_turn_sampling(self, temperature: float) -> SamplingParams:
        """A multi-turn task's evaluation sampling: on the continuous engine, its turns calling."""
        return SamplingParams(
            temperature=temperature,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=(self.eos_id,),
            tool_call_ids=self.tool_call_ids,
            engine="continuous",
            slots=EVAL_SLOTS,
            chunk_steps=16,
        )


_SAMPLERS: dict = {}


def evaluation_sampler(graphdef: nnx.GraphDef, params: SamplingParams, pad_id: int) -> Engine:
    """One compiled evaluation sampler per (architecture, parameters): the engine
    ``params.engine`` names."""
    key = (graphdef, params, pad_id)
    if key not in _SAMPLERS:
        _SAMPLERS[key] = make_sampler(graphdef, params, pad_id=pad_id)
    return _SAMPLERS[key]


__all__ = ["PromptTask"]
