"""The KV cache's precision (``sampling.kv_dtype``): what a bf16 cache under fp32 compute
costs in fidelity and saves in bytes and time, on the long-tailed task.

The continuous engine answers ``--prompts`` of the long-tailed task's training prompts with
``--model`` (default the shipped ``builtin:teacher_long``, fp32) through ``--slots`` slots,
once with an fp32 cache and once with a bf16 one, the same per-prompt keys, timed in turn
round after round (``--repeats``, after a warm-up each). Reported per cache dtype: answer
tokens/s, the cache's bytes per token, and the gap between the recorded behaviour log-probs
and the learner's: the fp32 model's log-prob of each sampled answer token from one plain
forward over prompt + answer (what the learner computes at the sampling weights), over every
answer token: mean, 99th percentile and largest ``|Δ|``. An fp32 cache's gap is the
arithmetic's (cache vs no cache); a bf16 cache's adds the rounding of the keys and values.

    JAX_PLATFORMS=cpu python benchmarks/bench_kv_precision.py
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncopd_jax.alignment import response_hidden
from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.config import load_config
from asyncopd_jax.models import Decoder
from asyncopd_jax.pipeline.model_loading import load_model_and_tokenizer
from asyncopd_jax.sampling import ContinuousSampler, SamplingParams, prompt_keys
from asyncopd_jax.tasks.builtin import TaskData


def learner_gap(model: Decoder, batch: RolloutBatch) -> np.ndarray:
    """``|behaviour log-prob − the fp32 model's log-prob|`` of every answer token."""
    hidden = response_hidden(model, batch)  # [B, T, H]: row t predicts answer token t
    logp = jax.nn.log_softmax(jnp.einsum("bth,hv->btv", hidden, model.lm_head_weight()).astype(jnp.float32), -1)
    learner = jnp.take_along_axis(logp, batch.response_tokens[..., None], axis=-1)[..., 0]
    mask = np.asarray(batch.response_mask)
    return np.abs(np.asarray(batch.behavior_logp) - np.asarray(learner))[mask]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:teacher_long")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    cfg = load_config("long_tailed")
    model, tokenizer = load_model_and_tokenizer(args.model, "float32")
    task = TaskData(cfg.task, tokenizer)
    prompts, _ = task.train_prompts(np.random.default_rng(0), args.prompts)
    keys = prompt_keys(jax.random.key(0), len(prompts))
    graphdef, state = nnx.split(model)
    base = SamplingParams(
        temperature=1.0,
        max_new_tokens=task.max_new_tokens,
        stop_token_ids=(task.eos_id,),
        chunk_steps=16,
        engine="continuous",
        slots=args.slots,
    )
    engines = {
        dtype: ContinuousSampler(graphdef, dataclasses.replace(base, kv_dtype=dtype), pad_id=task.pad_id)
        for dtype in ("float32", "bfloat16")
    }

    def answer(dtype: str) -> RolloutBatch:
        batch = engines[dtype].generate(state, prompts, None, keys=keys, prompt_slots=task.prompt_slots)
        return jax.block_until_ready(batch)

    batches = {dtype: answer(dtype) for dtype in engines}  # warm-up: compiles
    seconds: dict[str, list[float]] = {dtype: [] for dtype in engines}
    for _ in range(args.repeats):
        for dtype in engines:
            start = time.perf_counter()
            batches[dtype] = answer(dtype)
            seconds[dtype].append(time.perf_counter() - start)

    c = model.config
    print(
        f"long-tailed task, {args.model} (fp32, H={c.hidden_size} L={c.num_hidden_layers} N_kv={c.num_key_value_heads} "
        f"D={c.head_dim}), {len(prompts)} prompts through {args.slots} slots, temperature 1 | jax {jax.__version__} "
        f"({jax.devices()[0].platform}) | medians of {args.repeats} interleaved runs"
    )
    header = ("tokens", 8), ("answer tokens/s", 17), ("KV bytes/token", 16), ("|Δ| mean", 11), ("p99", 10), ("max", 10)
    print(f"{'kv_dtype':<10}" + "".join(f"{name:>{width}}" for name, width in header))
    rates = {}
    for dtype, batch in batches.items():
        tokens = int(np.asarray(batch.response_mask).sum())
        rates[dtype] = tokens / statistics.median(seconds[dtype])
        per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * jnp.dtype(dtype).itemsize
        gap = learner_gap(model, batch)
        print(
            f"{dtype:<10}{tokens:>8}{rates[dtype]:>17,.0f}{per_token:>16,}{gap.mean():>11.2e}"
            f"{np.quantile(gap, 0.99):>10.2e}{gap.max():>10.2e}"
        )
    print(f"answer tokens/s, a bf16 cache over an fp32 one: {rates['bfloat16'] / rates['float32']:.2f}x")


if __name__ == "__main__":
    main()
