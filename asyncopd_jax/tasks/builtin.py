"""The built-in task wired to models and tokenizers: presets, batches, held-out accuracy.

The task itself (:mod:`asyncopd_jax.tasks.arith`) is text; here it meets token ids.
Prompts go through the run's tokenizer (its chat template if it has one), responses are
decoded and checked by the verifier, so the same task runs with the built-in character
tokenizer or with a Hugging Face model's own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers import PreTrainedTokenizerBase

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.config import TaskConfig
from asyncopd_jax.models import Decoder, DecoderConfig, encode_prompts
from asyncopd_jax.sampling import Sampler, SamplingParams, left_pad
from asyncopd_jax.tasks.arith import Problem, random_solution, sample_problems, verify
from asyncopd_jax.tasks.tokenizer import EOS_ID, PAD_ID

VOCAB_SIZE = 32  # the character tokenizer's 19 tokens, padded


def model_config(size: str) -> DecoderConfig:
    """``"teacher"`` or ``"student"``: small Qwen3-style decoders for the built-in task."""
    dims = {"teacher": (128, 4, 384, 32), "student": (64, 2, 192, 16)}
    if size not in dims:
        raise ValueError(f"built-in model {size!r} is invalid; allowed: {', '.join(dims)}")
    hidden, layers, mlp, head_dim = dims[size]
    return DecoderConfig(
        model_type="qwen3", vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=mlp,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        tie_word_embeddings=True, max_position_embeddings=128, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        rope_theta=10_000.0,
    )


def new_model(size: str, seed: int) -> Decoder:
    return Decoder(model_config(size), rngs=nnx.Rngs(seed))


class TaskData:
    """The built-in task seen through one tokenizer."""

    def __init__(self, task: TaskConfig, tokenizer: PreTrainedTokenizerBase):
        self.task, self.tokenizer = task, tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else PAD_ID
        self.eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else EOS_ID
        worst = Problem((task.max_value,) * task.difficulty)
        self.prompt_slots = len(self.encode([worst])[0])
        self.max_new_tokens = len(tokenizer.encode(worst.solution(tuple(range(task.difficulty))))) + 1
        self.eval_problems = sample_problems(
            np.random.default_rng(task.seed + 12345), task.eval_prompts, task.difficulty, task.max_value, held_out=True
        )

    def encode(self, problems: list[Problem]) -> list[list[int]]:
        return encode_prompts(self.tokenizer, [p.prompt for p in problems])

    def train_prompts(self, rng: np.random.Generator, n: int) -> tuple[list[list[int]], list[Problem]]:
        problems = sample_problems(rng, n, self.task.difficulty, self.task.max_value, held_out=False)
        return self.encode(problems), problems

    def decode(self, batch: RolloutBatch) -> list[str]:
        tokens, mask = np.asarray(batch.response_tokens), np.asarray(batch.response_mask)
        return [self.tokenizer.decode([int(t) for t in row[m] if t != self.eos_id], skip_special_tokens=True)
                for row, m in zip(tokens, mask)]

    def rewards(self, problems: list[Problem], batch: RolloutBatch) -> list[bool]:
        return [verify(p, r) for p, r in zip(problems, self.decode(batch))]

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
            prompt_tokens=jnp.asarray(prompts), prompt_mask=jnp.asarray(mask),
            response_tokens=jnp.asarray(responses), response_mask=jnp.asarray(response_mask),
            behavior_logp=jnp.zeros(responses.shape, jnp.float32), token_version=jnp.zeros(responses.shape, jnp.int32),
        )

    def accuracy(self, graphdef: nnx.GraphDef, params: nnx.State, *, seed: int = 0) -> float:
        """Fraction of the held-out problems solved with greedy decoding by ``(graphdef, params)``."""
        greedy = SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens, stop_token_ids=(self.eos_id,),
                                chunk_steps=self.max_new_tokens)
        sampler = _cached_sampler(graphdef, greedy, self.pad_id)
        batch = sampler.generate(params, self.encode(self.eval_problems), jax.random.key(seed),
                                 prompt_slots=self.prompt_slots)
        return float(np.mean(self.rewards(self.eval_problems, batch)))


_SAMPLERS: dict = {}


def _cached_sampler(graphdef, params: SamplingParams, pad_id: int) -> Sampler:
    """One compiled evaluation sampler per (architecture, parameters)."""
    key = (graphdef, params, pad_id)
    if key not in _SAMPLERS:
        _SAMPLERS[key] = Sampler(graphdef, params, pad_id=pad_id)
    return _SAMPLERS[key]


__all__ = ["TaskData", "VOCAB_SIZE", "model_config", "new_model"]
