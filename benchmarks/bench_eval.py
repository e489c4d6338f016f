"""Learning speed with held-out evaluation inline against in the background (``eval.mode``).

Runs the demo (``asyncopd train``'s default config: its built-in models, its schedule) for
``--steps`` optimizer steps three ways, in one process, one after the other:

* **no eval** — ``train.eval_every`` past the end: only the last step is evaluated;
* **inline** — every ``--every`` steps the learner stops while the held-out set is answered;
* **background** — every ``--every`` steps the version just published is evaluated on a
  worker thread while the learner goes on (it waits only for the last one, at the end).

Learning steps/s is the steps after the first ``--skip`` (compilation) over the seconds
between those steps' records (``time`` in metrics.jsonl: the loop's clock), so the final
evaluation, which every arm makes, is outside it; the whole run's seconds are printed too.
The arms run ``--rounds`` times in turn (the machine's drift falls on each alike) and
the medians are reported, with background / inline::

    python benchmarks/bench_eval.py                 # 100 steps, eval every 20 on 2,048 prompts, 3 rounds
    python benchmarks/bench_eval.py --steps 12 --every 4 --rounds 1 --prompts 32   # smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from asyncopd_jax.config import load_config
from asyncopd_jax.pipeline.host_env import detect_platform, prepare_learner_process
from asyncopd_jax.pipeline.layout import plan_layout
from asyncopd_jax.pipeline.run_outputs import optimizer_step_records
from asyncopd_jax.pipeline.trainer import Trainer

ARMS = ("no eval", "inline", "background")


def run_arm(arm: str, args: argparse.Namespace, output: str) -> tuple[float, float, list[float]]:
    """One run of ``arm`` in a directory of its own under ``output``: (learning steps/s,
    the run's seconds, each evaluation's seconds)."""
    every = args.steps + 1 if arm == "no eval" else args.every
    cfg = load_config(
        "demo",
        [
            f"name={arm.replace(' ', '_')}",
            f"output_dir={tempfile.mkdtemp(dir=output)}",
            f"train.steps={args.steps}",
            f"train.eval_every={every}",
            f"train.checkpoint_every={args.steps}",
            f"task.eval_prompts={args.prompts}",
            f"eval.mode={'background' if arm == 'background' else 'inline'}",
        ],
    )
    # as `asyncopd train` plans it: from the cores this process had before it pinned itself
    layout = plan_layout(cfg, run_path=f"{cfg.output_dir}/{cfg.name}", available_cores=args.cores, multi_process=False)
    prepare_learner_process(layout, detect_platform())
    start = time.perf_counter()
    trainer = Trainer(cfg, progress=False, layout=layout)
    trainer.run()
    seconds = time.perf_counter() - start
    records = trainer.run_dir.read_metrics()
    steps = optimizer_step_records(records)
    first, last = steps[args.skip - 1], steps[-1]
    rate = (last["step"] - first["step"]) / (last["time"] - first["time"])
    return rate, seconds, [r["eval_seconds"] for r in records if "eval_seconds" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=20, help="train.eval_every of the inline and background arms")
    parser.add_argument("--prompts", type=int, default=2048, help="task.eval_prompts (the demo's: 256, 70 ms here)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the rate (compilation)")
    args = parser.parse_args()
    args.cores = sorted(os.sched_getaffinity(0))
    rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    evals: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as output:
        for _ in range(args.rounds):
            for arm in ARMS:
                rate, took, evals[arm] = run_arm(arm, args, output)
                rates[arm].append(rate)
                seconds[arm].append(took)
    print(f"demo, {args.steps} steps, eval every {args.every} on {args.prompts} prompts, {len(args.cores)} cores")
    print(f"{'arm':<12} {'learning steps/s':>17} {'run s':>8} {'evals':>6} {'s each':>7}   (medians of {args.rounds})")
    for arm in ARMS:
        rate, took, each = statistics.median(rates[arm]), statistics.median(seconds[arm]), evals[arm]
        print(f"{arm:<12} {rate:>17.2f} {took:>8.1f} {len(each):>6} {statistics.mean(each):>7.2f}")
    inline, background = statistics.median(rates["inline"]), statistics.median(rates["background"])
    print(f"background / inline learning steps/s: {background / inline:.2f}x")
    print(f"inline / no eval: {inline / statistics.median(rates['no eval']):.2f}x")


if __name__ == "__main__":
    main()
