"""The built-in task's models and batches: presets, tokenisation, evaluation with the verifier."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.config import TaskConfig
from asyncopd_jax.models import Decoder, DecoderConfig
from asyncopd_jax.sampling import Sampler, SamplingParams, left_pad
from asyncopd_jax.tasks.arith import Problem, max_response_chars, random_solution, sample_problems, verify
from asyncopd_jax.tasks.tokenizer import EOS_ID, PAD_ID, build_tokenizer

VOCAB_SIZE = 32  # 19 tokens, padded


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


def prompt_slots(task: TaskConfig) -> int:
    return len(Problem((task.max_value,) * task.difficulty).prompt)


def max_new_tokens(task: TaskConfig) -> int:
    return max_response_chars(task.difficulty, task.max_value) + 1  # + <eos>


def encode(problems: list[Problem]) -> list[list[int]]:
    tokenizer = build_tokenizer()
    return [tokenizer.encode(p.prompt) for p in problems]


def sft_batch(rng: np.random.Generator, task: TaskConfig, batch_size: int) -> RolloutBatch:
    """Training problems with uniformly random solution orders, as a RolloutBatch."""
    tokenizer = build_tokenizer()
    problems = sample_problems(rng, batch_size, task.difficulty, task.max_value, held_out=False)
    prompts, mask = left_pad(encode(problems), PAD_ID, prompt_slots(task))
    t = max_new_tokens(task)
    responses = np.full((batch_size, t), PAD_ID, np.int32)
    response_mask = np.zeros((batch_size, t), bool)
    for row, p in enumerate(problems):
        ids = tokenizer.encode(random_solution(rng, p)) + [EOS_ID]
        responses[row, : len(ids)] = ids
        response_mask[row, : len(ids)] = True
    zeros = np.zeros((batch_size, t), np.float32)
    return RolloutBatch(
        prompt_tokens=jnp.asarray(prompts), prompt_mask=jnp.asarray(mask), response_tokens=jnp.asarray(responses),
        response_mask=jnp.asarray(response_mask), behavior_logp=jnp.asarray(zeros),
        token_version=jnp.zeros((batch_size, t), jnp.int32),
    )


def eval_problems(task: TaskConfig) -> list[Problem]:
    return sample_problems(np.random.default_rng(task.seed + 12345), task.eval_prompts, task.difficulty,
                           task.max_value, held_out=True)


def responses_text(batch: RolloutBatch) -> list[str]:
    tokenizer = build_tokenizer()
    tokens, mask = np.asarray(batch.response_tokens), np.asarray(batch.response_mask)
    return [tokenizer.decode([int(t) for t in row[m] if t != EOS_ID]) for row, m in zip(tokens, mask)]


def accuracy(model: Decoder, task: TaskConfig, *, temperature: float = 0.0, seed: int = 0,
             problems: list[Problem] | None = None) -> float:
    """Fraction of held-out problems the model solves (greedy by default)."""
    problems = eval_problems(task) if problems is None else problems
    graphdef, state = nnx.split(model)
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens(task), stop_token_ids=(EOS_ID,),
                            chunk_steps=max_new_tokens(task))
    batch = Sampler(graphdef, params, pad_id=PAD_ID).generate(
        state, encode(problems), jax.random.key(seed), prompt_slots=prompt_slots(task))
    return float(np.mean([verify(p, r) for p, r in zip(problems, responses_text(batch))]))


