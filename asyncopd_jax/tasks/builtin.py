"""The built-in task wired to models and tokenizers: model presets, SFT batches, and the
task seen through a tokenizer (:class:`TaskData`, a :class:`PromptTask`).

The task itself (:mod:`asyncopd_jax.tasks.arith`) is text; here it meets token ids.
Prompts go through the run's tokenizer (its chat template if it has one), responses are
decoded and checked by the verifier, so the same task runs with the built-in character
tokenizer or with a Hugging Face model's own.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers import PreTrainedTokenizerBase

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.config import TaskConfig
from asyncopd_jax.models import Decoder, DecoderConfig
from asyncopd_jax.sampling import left_pad
from asyncopd_jax.tasks.arith import Problem, random_solution, sample_problems, verify
from asyncopd_jax.tasks.prompt_task import PromptTask
from asyncopd_jax.tasks.tokenizer import EOS_ID, PAD_ID

VOCAB_SIZE = 32  # the character tokenizer's 19 tokens, padded


def model_config(size: str) -> DecoderConfig:
    """``"teacher"`` or ``"student"``: small Qwen3-style decoders for the built-in task."""
    dims = {"teacher": (128, 4, 384, 32), "student": (64, 2, 192, 16)}
    if size not in dims:
        raise ValueError(f"built-in model {size!r} is invalid; allowed: {', '.join(dims)}")
    hidden, layers, mlp, head_dim = dims[size]
    return DecoderConfig(
        model_type="qwen3",
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        tie_word_embeddings=True,
        max_position_embeddings=128,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        rope_theta=10_000.0,
    )


def new_model(size: str, seed: int) -> Decoder:
    return Decoder(model_config(size), rngs=nnx.Rngs(seed))


class TaskData(PromptTask):
    """The built-in task seen through one tokenizer; items are :class:`Problem` s."""

    def __init__(self, task: TaskConfig, tokenizer: PreTrainedTokenizerBase):
        super().__init__(tokenizer)
        self.task = task
        worst = Problem((task.max_value,) * task.difficulty)
        self.prompt_slots = len(self.encode([worst])[0])
        self.max_new_tokens = len(tokenizer.encode(worst.solution(tuple(range(task.difficulty))))) + 1
        self.eval_items = sample_problems(
            np.random.default_rng(task.seed + 12345), task.eval_prompts, task.difficulty, task.max_value, held_out=True
        )

    def prompt_text(self, problem: Problem) -> str:
        return problem.prompt

    def score(self, problem: Problem, response: str) -> float:
        return float(verify(problem, response))

    def train_prompts(self, rng: np.random.Generator, n: int) -> tuple[list[list[int]], list[Problem]]:
        problems = sample_problems(rng, n, self.task.difficulty, self.task.max_value, held_out=False)
        return self.encode(problems), problems

    def sft_batch(self, rng: np.random.Generator, batch_size: int) -> RolloutBatch:
        """Training problems with uniformly random solution orders (teacher SFT data)."""
        problems = sample_problems(rng, batch_size, self.task.difficulty, self.task.max_value, held_out=False)
        prompts, mask = left_pad(self.encode(problems), self.pad_id, self.prompt_slots)
        responses = np.full((batch_size, self.max_new_tokens), self.pad_id, np.int32)
        response_mask = np.zeros(responses.shape, bool)
        for row, p in enumerate(problems):
            ids = self.tokenizer.encode(random_solution(rng, p)) + [self.eos_id]
            responses[row, : len(ids)] = ids
            response_mask[row, : len(ids)] = True
        return RolloutBatch(
            prompt_tokens=jnp.asarray(prompts),
            prompt_mask=jnp.asarray(mask),
            response_tokens=jnp.asarray(responses),
            response_mask=jnp.asarray(response_mask),
            behavior_logp=jnp.zeros(responses.shape, jnp.float32),
            token_version=jnp.zeros(responses.shape, jnp.int32),
        )


__all__ = ["TaskData", "VOCAB_SIZE", "model_config", "new_model"]
