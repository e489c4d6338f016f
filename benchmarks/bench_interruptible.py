"""Interruptible generation on long-tailed response lengths: throughput and staleness.

A rollout worker (the pipeline's ``GroupProducer``) samples groups of B prompts while a
stand-in learner thread publishes a new policy version every ``period`` seconds (one
group's sampling time without swaps, measured first, divided by ``--updates``: that many
updates land inside a group). Two ways to meet an update:

* **interruptible** (``sampling.chunk_steps``; AReaL's interruptible generation): between
  decode chunks the worker swaps in the newest weights, recomputes the KV cache under
  them and decodes on;
* **finish in flight**: a group is finished on the weights it started with; the next
  group starts from the newest.

Response lengths are long-tailed because the student is freshly initialised: its end
token is one of V nearly equally likely tokens, so lengths are geometric with mean ≈ V,
capped at T (the built-in models answer every problem in ~19 tokens, and no task setting
makes their answers long). Reported per mode, alternating modes over ``--rounds``:
response tokens per second, the mean staleness of the tokens when their group is handed
to the learner (newest version − the version that sampled the token), swaps per group,
and the slot utilisation of the lockstep batch (response tokens / (B × the longest
response's steps)): a batch decodes until its longest row ends, the cost continuous
batching (refilling finished rows) would remove.

    python benchmarks/bench_interruptible.py            # B=32, T=256, V=64, 3 rounds of 4 groups, 4 updates/group
    python benchmarks/bench_interruptible.py --updates 1
    python benchmarks/bench_interruptible.py --small    # a quick smoke run
    python benchmarks/bench_interruptible.py --engine continuous --group 128   # 128 prompts a group through 32 slots

``--engine continuous`` samples each group with the continuous-batching engine, ``--batch``
slots for the group's ``--group`` prompts (default: as many as slots): its slot utilisation
is the engine's own count (answer tokens / slot-steps decoded).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
from flax import nnx

from asyncopd_jax.models import Decoder, DecoderConfig
from asyncopd_jax.pipeline.producer import GroupProducer
from asyncopd_jax.pipeline.reward_stage import RewardStage
from asyncopd_jax.pipeline.snapshots import InMemorySnapshotStore
from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.sampling import SamplingParams, make_sampler


def fresh_student(vocab: int, positions: int) -> Decoder:
    config = DecoderConfig(
        model_type="qwen3",
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
        max_position_embeddings=positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return Decoder(config, rngs=nnx.Rngs(0))


class Publisher:
    """A stand-in learner: publishes version v + 1 (the same weights) every ``period`` s."""

    def __init__(self, store: InMemorySnapshotStore, params: nnx.State, period: float):
        self.store, self.params, self.period = store, params, period
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            self.store.publish(self.store.latest_version() + 1, self.params)

    def __enter__(self) -> Publisher:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def run_mode(
    producer: GroupProducer,
    store: InMemorySnapshotStore,
    params: nnx.State,
    *,
    interruptible: bool,
    groups: int,
    period: float,
    first_index: int,
) -> dict[str, float]:
    producer.interruptible = interruptible
    tokens, staleness, swaps, utilisation = 0, [], 0, []
    tracer_before = len(producer.tracer.events())
    with Publisher(store, params, period):
        start = time.perf_counter()
        for index in range(first_index, first_index + groups):
            group = producer.sample(index)
            mask = np.asarray(group.batch.response_mask)
            versions = np.asarray(group.batch.token_version)[mask]
            lengths = mask.sum(axis=1)
            tokens += int(lengths.sum())
            staleness.append(float(np.mean(store.latest_version() - versions)))
            stats = getattr(producer.sampler, "last_stats", None)  # the continuous engine counts its own
            lockstep = float(lengths.sum() / (lengths.size * max(int(lengths.max()), 1)))
            utilisation.append(stats.utilisation if stats is not None else lockstep)
        seconds = time.perf_counter() - start
    swaps = sum(1 for e in producer.tracer.events()[tracer_before:] if e["name"] == "swap_weights")
    return {
        "tokens_per_s": tokens / seconds,
        "group_seconds": seconds / groups,
        "staleness": float(np.mean(staleness)),
        "swaps": swaps / groups,
        "utilisation": float(np.mean(utilisation)),
        "mean_length": tokens / (groups * producer.group_size),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new", type=int, default=256, help="T, the longest response")
    parser.add_argument("--vocab", type=int, default=64, help="V: lengths are geometric with mean ≈ V")
    parser.add_argument("--chunk", type=int, default=16, help="decode steps between checks for new weights")
    parser.add_argument("--groups", type=int, default=4, help="groups per mode per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--updates",
        type=float,
        default=4.0,
        help="weight updates published per group-sampling time (measured without swaps)",
    )
    parser.add_argument("--small", action="store_true", help="B=8, T=64, V=16, 2 groups, 1 round")
    parser.add_argument("--engine", choices=["static", "continuous"], default="static")
    parser.add_argument("--group", type=int, default=0, help="prompts per group (default: --batch)")
    args = parser.parse_args()
    if args.small:
        args.batch, args.new, args.vocab, args.groups, args.rounds = 8, 64, 16, 2, 1

    prompt_len = 8
    model = fresh_student(args.vocab, prompt_len + args.new)
    graphdef, params = nnx.split(model)
    store = InMemorySnapshotStore(keep=64)
    store.publish(0, params)
    continuous = args.engine == "continuous"
    sampler = make_sampler(
        graphdef,
        SamplingParams(
            temperature=1.0,
            max_new_tokens=args.new,
            chunk_steps=args.chunk,
            stop_token_ids=(2,),
            engine=args.engine,
            slots=args.batch if continuous else 0,
        ),
    )

    def prompts(rng: np.random.Generator, n: int):
        return rng.integers(3, args.vocab, (n, prompt_len)).tolist(), [None] * n

    def no_reward(problems, batch):
        return np.zeros(len(problems), np.float32)

    producer = GroupProducer(
        sampler=sampler,
        snapshots=store,
        prompts=prompts,
        reward=RewardStage(no_reward),
        group_size=args.group or args.batch,
        seed=0,
        prompt_slots=prompt_len,
        tracer=Tracer(),
    )
    # warm-up: compiles prefill, decode and the cache recomputes (a swap at every chunk);
    # then one group without swaps sets the period
    for index in range(2):
        producer.interruptible = True
        with Publisher(store, params, 1e-3):
            producer.sample(index)
    producer.interruptible = False
    start = time.perf_counter()
    producer.sample(2)
    period = (time.perf_counter() - start) / args.updates

    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    index = 3
    for _ in range(args.rounds):
        for interruptible in (False, True):
            results[interruptible].append(
                run_mode(
                    producer,
                    store,
                    params,
                    interruptible=interruptible,
                    groups=args.groups,
                    period=period,
                    first_index=index,
                )
            )
            index += args.groups

    def median(mode: bool, key: str) -> float:
        return statistics.median(r[key] for r in results[mode])

    print(
        f"workload: fresh Qwen3 student H=128 L=2 V={args.vocab}, {args.engine} engine, {args.batch} slots, groups "
        f"of {args.group or args.batch} prompts, up to {args.new} new tokens "
        f"(mean {median(False, 'mean_length'):.0f}), chunks of {args.chunk} steps; a new version every "
        f"{period:.2f} s ({args.updates:g} per group); medians over {args.rounds} rounds of {args.groups} groups"
    )
    for mode, name in ((False, "finish in flight"), (True, "interruptible")):
        print(
            f"{name:18} {median(mode, 'tokens_per_s'):8.0f} response tokens/s | {median(mode, 'group_seconds'):5.2f} "
            f"s/group | staleness at hand-over {median(mode, 'staleness'):5.2f} versions | "
            f"{median(mode, 'swaps'):4.1f} swaps/group | slot utilisation {median(mode, 'utilisation'):.2f}"
        )
    extra = median(True, "group_seconds") - median(False, "group_seconds")
    print(
        f"cost of a swap (KV recompute + weight load): ~{1e3 * extra / max(median(True, 'swaps'), 1e-9):.0f} ms "
        f"= {extra / max(median(True, 'swaps'), 1e-9) / median(False, 'group_seconds'):.2f} of a group's sampling"
    )
    print(
        f"throughput ratio interruptible / finish in flight: "
        f"{median(True, 'tokens_per_s') / median(False, 'tokens_per_s'):.3f}x; staleness ratio "
        f"{median(True, 'staleness') / max(median(False, 'staleness'), 1e-9):.2f}x"
    )


if __name__ == "__main__":
    main()
