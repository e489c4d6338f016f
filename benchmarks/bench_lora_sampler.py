"""A LoRA student's sampler: adapters merged into the base at the swap against unmerged in
the decode (``student.lora.sampler``), same weights, same prompts.

For each shape, rank ``--rank`` on every projection:

* swap: seconds from a version's adapters on the sampler's device to weights the stream can
  decode with: unmerged, joined with the base (nothing computed); merged,
  :class:`~asyncopd_jax.pipeline.adapter_snapshots.MergedAtSwap`'s compiled merge (median
  of ``--repeats`` versions, its compilation excluded). The copy of the adapters from the
  learner is the same either way and not counted.
* decode step: seconds per decode step of the static sampler, ``--batch`` rows, prompts of
  ``--prompt`` tokens, at temperature 1: (time for ``--new`` tokens − time for 1) / (new − 1),
  the median of ``--repeats``, compilation excluded.

Then the ratio unmerged / merged of the decode step, and the tokens a version must sample
before merging pays (break-even: swap cost / the decode step saved per token, counting every
row's token).

    python benchmarks/bench_lora_sampler.py                     # the demo's student and Qwen3-0.6B's shape
    python benchmarks/bench_lora_sampler.py --shapes demo --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from bench_sampler import timed  # this directory: run as a script, as every benchmark is
from flax import nnx

from asyncopd_jax.models import Decoder, from_pretrained
from asyncopd_jax.models.config import read_hf_config
from asyncopd_jax.models.lora import LoRAParams, add_adapters, split_adapters
from asyncopd_jax.pipeline.adapter_snapshots import AdapterSnapshots, MergedAtSwap
from asyncopd_jax.pipeline.snapshots import InMemorySnapshotStore
from asyncopd_jax.sampling import Sampler, SamplingParams
from asyncopd_jax.scale.learner_inputs import ARCHITECTURES
from asyncopd_jax.tasks.assets import resolve_model_path


def base_model(shape: str) -> Decoder:
    if shape == "demo":
        return from_pretrained(resolve_model_path("builtin:student"))
    with tempfile.TemporaryDirectory() as tmp:  # Qwen3-0.6B's real widths, random weights
        (Path(tmp) / "config.json").write_text((ARCHITECTURES / "Qwen3-0.6B" / "config.json").read_text())
        config, _ = read_hf_config(Path(tmp))
    return Decoder(config, rngs=nnx.Rngs(0))


def measure(shape: str, args: argparse.Namespace) -> dict:
    lora = LoRAParams(rank=args.rank, alpha=2.0 * args.rank)
    model = add_adapters(base_model(shape), lora, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    plain_graphdef = nnx.split(base_model(shape) if shape == "demo" else _plain(model))[0]
    rng = np.random.default_rng(0)
    trained, frozen = split_adapters(state)

    def version() -> nnx.State:  # a version's adapters: B no longer zero
        moved = jax.tree_util.tree_map(lambda x: x + 0.01 * rng.standard_normal(x.shape).astype(x.dtype), trained)
        return nnx.merge_state(moved, frozen)

    channel = AdapterSnapshots(InMemorySnapshotStore(keep=2), InMemorySnapshotStore(keep=2))
    merged_view = MergedAtSwap(channel, lora.scale)
    swaps: dict[str, list[float]] = {"unmerged": [], "merged": []}
    for v in range(args.repeats + 1):
        channel.publish(v, version())
        jax.block_until_ready(channel.adapters.load(v)[1])
        start = time.perf_counter()
        jax.block_until_ready(channel.load(v)[1])
        swaps["unmerged"].append(time.perf_counter() - start)
        merged_view.load(v)
        swaps["merged"].append(merged_view.last_merge_s)
    swap = {mode: statistics.median(times[1:]) for mode, times in swaps.items()}  # the first compiles

    vocab = model.config.vocab_size
    prompts = rng.integers(3, min(vocab, 150_000), size=(args.batch, args.prompt)).tolist()
    unmerged_state, merged_state = channel.load(args.repeats)[1], merged_view.load(args.repeats)[1]
    step = {}
    for mode, g, s in (("unmerged", graphdef, unmerged_state), ("merged", plain_graphdef, merged_state)):
        times = {}
        for new in (1, args.new):
            sampler = Sampler(g, SamplingParams(temperature=1.0, max_new_tokens=new, chunk_steps=new))
            times[new] = timed(
                lambda sampler=sampler, s=s: jax.block_until_ready(
                    sampler.generate(s, prompts, jax.random.key(0)).response_tokens
                ),
                args.repeats,
            )
        step[mode] = (times[args.new] - times[1]) / (args.new - 1)
    saved = step["unmerged"] - step["merged"]
    params = sum(x.size for x in jax.tree_util.tree_leaves(frozen))
    adapter = sum(x.size for x in jax.tree_util.tree_leaves(trained))
    return {
        "shape": shape,
        "parameters": params,
        "adapter_parameters": adapter,
        "swap_s": swap,
        "decode_step_s": step,
        "decode_ratio_unmerged_over_merged": step["unmerged"] / step["merged"],
        "break_even_tokens": (swap["merged"] - swap["unmerged"]) / saved * args.batch if saved > 0 else None,
    }


def _plain(model: Decoder) -> Decoder:
    from asyncopd_jax.models.lora import merge_adapters

    return merge_adapters(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["demo", "qwen3-0.6b"], choices=["demo", "qwen3-0.6b"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for shape in args.shapes:
        print(json.dumps(measure(shape, args)), flush=True)


if __name__ == "__main__":
    main()
