"""Dynamic batching: the learner step on long-tailed response lengths, padded vs packed.

One mini-batch of B rollouts whose response lengths are long-tailed (log-normal, capped
at T), as reasoning answers are. The plain step pads every row to P + T slots; the packed
step (``learner.token_budget``) sorts rows by length into token-budget micro-batches
trimmed to their own longest row. Both take the same optimizer step (the token mean is
exact, tested in tests/learner/test_step.py; here the losses are printed side by side).
Time is the median of ``--repeats`` steps after a warm-up that compiles every shape;
ratios are measured in the same run.

    python benchmarks/bench_packing.py             # B=64, P=32, T=512, budget 8192
    python benchmarks/bench_packing.py --small     # a quick smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncopd_jax.cache import RolloutBatch, TeacherScoreCache
from asyncopd_jax.config import EstimatorConfig, OptimConfig
from asyncopd_jax.learner import (
    LearnerBatch,
    PolicyLoss,
    create_train_state,
    make_optimizer,
    make_packed_train_step,
    make_train_step,
)
from asyncopd_jax.learner.packing import plan_micro_batches
from asyncopd_jax.models import Decoder, DecoderConfig


def long_tailed_batch(B: int, P: int, T: int, vocab: int, seed: int = 0) -> LearnerBatch:
    """B rows: prompts of 8..P tokens (left-padded), responses log-normal in length (median
    T/8, a tail to T), random tokens and log-probs."""
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(8, P + 1, B)
    response_len = np.clip(rng.lognormal(np.log(T / 8), 0.9, B).astype(int), 4, T)
    prompt_mask = np.arange(P)[None, :] >= (P - prompt_len)[:, None]
    response_mask = np.arange(T)[None, :] < response_len[:, None]
    logp = -rng.exponential(1.0, (B, T)).astype(np.float32)
    rollout = RolloutBatch(
        prompt_tokens=jnp.asarray(rng.integers(0, vocab, (B, P)), jnp.int32),
        prompt_mask=jnp.asarray(prompt_mask),
        response_tokens=jnp.asarray(rng.integers(0, vocab, (B, T)), jnp.int32),
        response_mask=jnp.asarray(response_mask),
        behavior_logp=jnp.asarray(logp),
        token_version=jnp.zeros((B, T), jnp.int32),
    )
    cache = TeacherScoreCache(token_logp=jnp.asarray(logp - rng.exponential(0.5, (B, T)).astype(np.float32)))
    return LearnerBatch(rollout, cache)


def timed(step, state, batch, repeats: int) -> tuple[float, dict, object]:
    state, metrics = step(state, batch)  # warm-up: compiles every shape
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return statistics.median(times), jax.device_get(metrics), state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=512)
    parser.add_argument("--budget", type=int, default=8192)
    parser.add_argument("--bucket", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="B=16, T=128, budget 1024")
    args = parser.parse_args()
    if args.small:
        args.batch, args.response, args.budget, args.bucket, args.repeats = 16, 128, 1024, 16, 2

    config = DecoderConfig(
        model_type="qwen3",
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=args.prompt + args.response,
        eos_token_id=1,
        pad_token_id=0,
    )
    batch = long_tailed_batch(args.batch, args.prompt, args.response, config.vocab_size)
    loss = PolicyLoss(EstimatorConfig("reverse_kl_pg"))
    optimizer = make_optimizer(OptimConfig(learning_rate=1e-4, warmup_steps=0, schedule="constant"), 100)

    def fresh():
        return create_train_state(Decoder(config, rngs=nnx.Rngs(0)), optimizer)

    graphdef, state = fresh()
    plain_s, plain_m, _ = timed(make_train_step(graphdef, optimizer, loss), state, batch, args.repeats)
    graphdef, state = fresh()
    packed_step = make_packed_train_step(graphdef, optimizer, loss, token_budget=args.budget, bucket=args.bucket)
    packed_s, packed_m, _ = timed(packed_step, state, batch, args.repeats)

    rollout = batch.rollout
    real = int(np.asarray(rollout.prompt_mask).sum() + np.asarray(rollout.response_mask).sum())
    slots = args.batch * (args.prompt + args.response)
    plans = plan_micro_batches(
        np.asarray(rollout.prompt_mask).sum(1),
        np.asarray(rollout.response_mask).sum(1),
        prompt_slots=args.prompt,
        response_slots=args.response,
        token_budget=args.budget,
        bucket=args.bucket,
    )
    packed_slots = sum(p.padded_tokens for p in plans)
    lengths = np.asarray(rollout.response_mask).sum(1)
    print(
        f"batch {args.batch} x ({args.prompt} + {args.response}) slots; response lengths median "
        f"{int(np.median(lengths))}, p90 {int(np.percentile(lengths, 90))}, max {lengths.max()}; "
        f"budget {args.budget}, bucket {args.bucket}: {len(plans)} micro-batches"
    )
    print(
        f"slots computed: padded {slots} ({1 - real / slots:.1%} padding), packed {packed_slots} "
        f"({1 - real / packed_slots:.1%} padding): {slots / packed_slots:.2f}x fewer"
    )
    print(
        f"loss (first step, the same update): padded {float(plain_m['loss']):.6f}, packed {float(packed_m['loss']):.6f}"
    )
    print(
        f"step time: padded {plain_s * 1e3:.0f} ms, packed {packed_s * 1e3:.0f} ms: "
        f"packed speed-up {plain_s / packed_s:.2f}x"
    )


if __name__ == "__main__":
    main()
