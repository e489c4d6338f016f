"""Sync vs fully async OPD on the same workload, against the overlap bound.

Runs the built-in task twice with identical settings except the schedule: ``sync``
(η = 0: rollout, score, learn, publish in turn) and ``fully_async`` (η = 2, rollout
workers keep sampling while the learner trains). Reports samples/s of each (after the
first ``--skip`` steps, which include compilation), their ratio, and the ratio of the
async speed-up to the overlap bound ``(t_rollout + t_learn) / max(t_rollout, t_learn)``
computed from the per-batch stage times measured in the sync run of this same
invocation. Also times publishing a snapshot through Orbax against the in-memory path.

    python benchmarks/bench_pipeline.py
    python benchmarks/bench_pipeline.py --steps 20 --batch 16      # quicker
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax

from asyncopd_jax.config import load_config
from asyncopd_jax.pipeline.snapshots import InMemorySnapshotStore, OrbaxSnapshotStore
from asyncopd_jax.pipeline.trainer import Trainer


def run(mode: str, args, out: Path):
    sets = [
        f"name={mode}", f"output_dir={out}", f"schedule.mode={mode}", "schedule.max_staleness=2",
        f"learner.batch_size={args.batch}", f"train.steps={args.steps}", f"train.eval_every={10**6}",
        f"train.checkpoint_every={10**6}", "task.eval_prompts=16", f"schedule.rollout_workers={args.workers}",
        *args.set,
    ]
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml", sets)
    trainer = Trainer(cfg, progress=False)
    trainer.run()
    records = [json.loads(line) for line in (out / mode / "metrics.jsonl").read_text().splitlines()]
    first, last = records[args.skip - 1], records[-1]
    samples_per_s = (last["step"] - first["step"]) * args.batch / (last["time"] - first["time"])
    trace = json.loads((out / mode / "trace.json").read_text())["traceEvents"]

    def per_batch(names):
        spans = [e for e in trace if e.get("name") in names and e.get("ph") == "X"]
        totals: dict = {}
        for e in spans:  # sum the stages of one batch (rollout + score on one worker) by start order
            totals.setdefault(e["name"], []).append(e["dur"] / 1e6)
        per_name = [statistics.median(v[args.skip:]) for v in totals.values()]
        return sum(per_name)

    return samples_per_s, per_batch({"rollout", "score"}), per_batch({"learn", "publish", "proximal"})


def publish_times(repeats: int = 5):
    from asyncopd_jax.pipeline.trainer import load_model_and_tokenizer
    from flax import nnx

    model, _ = load_model_and_tokenizer("builtin:student", "float32")
    _, params = nnx.split(model)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, store in (("orbax", OrbaxSnapshotStore(tmp, params, keep=4)), ("in-memory", InMemorySnapshotStore())):
            times = []
            for v in range(repeats):
                start = time.perf_counter()
                store.publish(v, params)
                store.wait_for(v)
                version, loaded = store.load()
                jax.block_until_ready(loaded)
                times.append(time.perf_counter() - start)
            store.close()
            out[name] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the rate (compilation)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], metavar="A.B=C", help="config override for both runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sync_rate, t_roll, t_learn = run("sync", args, Path(tmp))
        async_rate, t_roll_async, t_learn_async = run("fully_async", args, Path(tmp))
    bound = (t_roll + t_learn) / max(t_roll, t_learn)
    speedup = async_rate / sync_rate
    print(f"workload: built-in task, batch {args.batch}, {args.steps} steps (first {args.skip} skipped), "
          f"{args.workers} rollout worker(s), {jax.devices()[0].platform} ({jax.device_count()} device(s))")
    print(f"stage times per batch (sync run): rollout + scoring {t_roll:.3f} s, learn + publish {t_learn:.3f} s")
    print(f"stage times per batch (async run, overlapping): rollout + scoring {t_roll_async:.3f} s, "
          f"learn + publish {t_learn_async:.3f} s")
    print(f"sync        {sync_rate:8.1f} samples/s")
    print(f"fully_async {async_rate:8.1f} samples/s  (η = 2)")
    print(f"speed-up async / sync: {speedup:.2f}x  (target >= 1.5)")
    print(f"overlap bound (t_r + t_l) / max(t_r, t_l): {bound:.2f}x; async reaches {speedup / bound:.2f} of it "
          "(target >= 0.9)")
    pub = publish_times()
    print(f"snapshot publish + load: orbax {pub['orbax'] * 1e3:.1f} ms, in-memory {pub['in-memory'] * 1e3:.2f} ms "
          f"({pub['orbax'] / pub['in-memory']:.0f}x)")


if __name__ == "__main__":
    main()
