"""Tool calls overlapped with decoding: how busy the continuous engine's slots stay while
tools run, against a baseline that waits for each group's tools before starting the next.

The workload: the tool task's held-out problems answered by the shipped tool teacher
(``builtin:teacher_tools``: one calculator call an answer, two turns), its calculator
made to sleep — a fixed latency, or a long-tailed one (lognormal, median ``--latency``,
σ = 1: a tenth of the calls take 3.6× the median, a hundredth 10×). Two ways to drive one
stream of ``--slots`` slots over the same prompts, keys and weights:

* ``overlapped`` (a fully async rollout stage): groups are submitted whenever the stream
  wants prompts, so a slot whose turn called the tool parks and takes the next prompt;
* ``group at a time`` (the sync schedule's rollout): a group is submitted only when the one
  before has been handed back, so the slots its parked answers left wait for the tools.

Printed per mode: wall seconds, answer tokens a second, the slot utilisation (answer
tokens per slot row decoded), the slots busy over the wall time (that utilisation times the
share of the time the stream was not blocked on tools with nothing to decode), the same
until the last group was submitted ("steady": a rollout stage's stream never runs dry; the
drain after it waits for the last calls), the blocked seconds, the tools' seconds from call
to observation taken in (summed), and the ratio of the two modes' wall times.

    python benchmarks/bench_tool_overlap.py                      # 512 problems, 32 slots, 100 ms
    python benchmarks/bench_tool_overlap.py --latency-law lognormal
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from asyncopd_jax.config import TaskConfig
from asyncopd_jax.environments import EnvironmentPool
from asyncopd_jax.environments.latency import Delayed, Latency
from asyncopd_jax.models import from_pretrained
from asyncopd_jax.sampling import ContinuousSampler, prompt_keys
from asyncopd_jax.tasks import make_task
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.tasks.tokenizer import build_tokenizer
from asyncopd_jax.tasks.tool_task import ToolTaskData


def run(data: ToolTaskData, engine, params, problems, args, overlapped: bool) -> dict[str, float]:
    """One pass over ``problems`` in groups of ``args.group``; what it took."""
    rng = np.random.default_rng(args.seed)
    delays = Latency(args.latency, args.latency_law).draw(rng, len(problems))  # paired: the same in both modes
    pool = EnvironmentPool(workers=args.workers, timeout_s=60)
    stream = engine.open_stream(
        params, version=0, prompt_slots=data.prompt_slots, slots=args.slots, turns=data.turns(pool)
    )
    groups = [range(i, min(i + args.group, len(problems))) for i in range(0, len(problems), args.group)]
    start, done, next_group, tokens = time.perf_counter(), 0, 0, 0
    steady = None  # (seconds, blocked seconds, tokens, rows decoded) when the last group was submitted
    while done < len(groups):
        ready = stream.wants_prompts if overlapped else stream.pending_groups == 0
        if next_group < len(groups) and ready:
            rows = groups[next_group]
            chosen = [problems[i] for i in rows]
            environments = [Delayed(data.environment(p), Latency(float(delays[i])), rng) for p, i in zip(chosen, rows)]
            keys = prompt_keys(jax.random.key(next_group), len(chosen))
            stream.submit(next_group, data.encode(chosen), keys, environments)
            next_group += 1
            if next_group == len(groups):
                s = stream.stats
                steady = (time.perf_counter() - start, s.episodes.waiting_seconds, s.tokens, s.row_steps)
            continue
        for _, batch in stream.step():
            done += 1
            tokens += int(np.asarray(batch.response_mask).sum())
    seconds = time.perf_counter() - start
    pool.close()
    s = stream.stats
    assert steady is not None
    steady_s, steady_blocked, steady_tokens, steady_rows = steady
    return {
        # until the last group was submitted: a rollout stage's steady state, before the drain
        "steady_busy": steady_tokens / max(steady_rows, 1) * (1 - steady_blocked / steady_s),
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "utilisation": s.utilisation,
        # the slots busy over the whole wall time: while the stream blocked on tools, none were
        "busy": s.utilisation * (1 - s.episodes.waiting_seconds / seconds),
        "blocked_s": s.episodes.waiting_seconds,
        "tool_s": s.episodes.environment_seconds,
        "calls": s.episodes.tool_calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", type=int, default=512)
    parser.add_argument("--group", type=int, default=32, help="problems a group (a rollout batch's share)")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--latency", type=float, default=0.1, help="a tool call's (median) seconds")
    parser.add_argument("--latency-law", choices=["fixed", "lognormal"], default="fixed")
    parser.add_argument("--workers", type=int, default=64, help="tool calls at once")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    data = make_task(TaskConfig(name="tools", eval_prompts=args.problems), build_tokenizer("tools"), max_new_tokens=0)
    assert isinstance(data, ToolTaskData)
    graphdef, params = nnx.split(from_pretrained(resolve_model_path("builtin:teacher_tools")))
    engine = ContinuousSampler(graphdef, data.multi_turn_sampling(temperature=1.0), pad_id=data.pad_id)
    problems = list(data.eval_items)
    run(data, engine, params, problems[: args.group], args, overlapped=True)  # compile first
    print(
        f"{len(problems)} problems in groups of {args.group}, {args.slots} slots, tool latency "
        f"{args.latency * 1e3:g} ms ({args.latency_law}), {args.workers} tool workers; jax {jax.__version__} on "
        f"{jax.devices()[0].platform}"
    )
    print(
        f"{'mode':<18}{'seconds':>9}{'tokens/s':>10}{'slot util.':>11}{'busy':>7}{'steady':>8}{'blocked s':>10}"
        f"{'tool s':>9}{'calls':>7}"
    )
    results = {}
    for name, overlapped in (("overlapped", True), ("group at a time", False)):
        r = results[name] = run(data, engine, params, problems, args, overlapped)
        print(
            f"{name:<18}{r['seconds']:>9.2f}{r['tokens_per_s']:>10.0f}{r['utilisation']:>11.3f}{r['busy']:>7.3f}"
            f"{r['steady_busy']:>8.3f}"
            f"{r['blocked_s']:>10.2f}{r['tool_s']:>9.1f}{r['calls']:>7d}"
        )
    ratio = results["group at a time"]["seconds"] / results["overlapped"]["seconds"]
    print(f"speed-up of overlapping tool calls with decoding: {ratio:.2f}x")


if __name__ == "__main__":
    main()
