"""Sync vs fully async OPD, each in its best stage placement, against the overlap bound.

Runs the demo workload (``asyncopd_jax/configs/demo.yaml`` with a shorter run) as separate
``asyncopd train`` processes, as a user would: ``sync`` (η = 0) and ``fully_async``
(η = 2), each with the stages as threads of one process and as separate processes
(``stages.placement``). Reports samples/s of each (after the first ``--skip`` steps,
which include compilation), the speed-up of the best async over the best sync
placement, and for each async run the fraction of its placement's own bound that it
reaches: the bound is ``B / max(t_rollout+score, t_learn+publish)`` with the per-batch
stage times measured in that same run (for stage processes: the busy time of the rollout
processes, divided by their number). Also times the two channels of the processes
placement: publish + load of a policy snapshot in both formats, Orbax and flat
safetensors (RAM-backed ``/dev/shm`` and the working directory's disk), and commit +
read of one scored rollout group in the spool.

    python benchmarks/bench_pipeline.py
    python benchmarks/bench_pipeline.py --steps 20 --batch 16      # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncopd_jax import configs
from asyncopd_jax.pipeline.trace import load_spans

DEMO = configs.DEMO


def run(mode: str, placement: str, args, out: Path) -> dict:
    name = f"{mode}-{placement}"
    sets = [
        f"name={name}",
        f"output_dir={out}",
        f"schedule.mode={mode}",
        "schedule.max_staleness=2",
        f"stages.placement={placement}",
        f"learner.batch_size={args.batch}",
        f"train.steps={args.steps}",
        f"train.eval_every={10**6}",
        f"train.checkpoint_every={10**6}",
        "task.eval_prompts=16",
        *args.set,
    ]
    command = [sys.executable, "-m", "asyncopd_jax.cli", "train", "--no-progress", "--config", str(DEMO)]
    for s in sets:
        command += ["--set", s]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    run_dir = out / name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first, last = records[args.skip - 1], records[-1]
    window = (first["trace_s"], last["trace_s"])
    rate = (last["step"] - first["step"]) * args.batch / (window[1] - window[0])
    return {"rate": rate, **stage_times(run_dir, args.batch, window)}


def stage_times(run_dir: Path, batch: int, window: tuple[float, float]) -> dict:
    """Per-batch busy time of the rollout side (rollout + score, all its processes) and of
    the learner (learn + publish + proximal), from the run's merged trace, inside ``window``
    (seconds on the trace's clock: the spans of the measured steps)."""
    spans = [e for e in load_spans(run_dir / "trace.json") if window[0] <= e["start"] <= window[1]]
    names = {e["process"] for e in spans}

    def busy(which: set[str], where) -> float:
        return sum(e["seconds"] for e in spans if e["name"] in which and where(e["process"]))

    rollout_processes = {n for n in names if n != "learner"}
    parallel = max(1, len({n for n in rollout_processes if n.startswith("rollout")}))
    rollout = busy({"rollout", "score"}, lambda p: True) / parallel
    learner = busy({"learn", "publish", "proximal"}, lambda p: p == "learner")
    steps = sum(1 for e in spans if e["name"] == "learn")
    return {"t_rollout": rollout / max(steps, 1), "t_learn": learner / max(steps, 1)}


def channel_costs(repeats: int = 10) -> dict:
    import jax
    from flax import nnx

    from asyncopd_jax.pipeline.model_loading import load_model_and_tokenizer
    from asyncopd_jax.pipeline.snapshots import DiskSnapshotStore
    from asyncopd_jax.pipeline.spool import Spool, read_record

    model, _ = load_model_and_tokenizer("builtin:student", "float32")
    _, params = nnx.split(model)
    out = {}
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    for fmt in ("orbax", "safetensors"):
        for where, base in (("/dev/shm", shm), ("disk", Path("."))):
            if base is None:
                continue
            with tempfile.TemporaryDirectory(dir=base) as tmp:
                store = DiskSnapshotStore(tmp, params, keep=4, format=fmt)
                reader = DiskSnapshotStore(tmp, params, read_only=True, format=fmt)
                times = []
                for v in range(repeats):
                    start = time.perf_counter()
                    store.publish(v, params)
                    store.flush()
                    jax.block_until_ready(reader.load()[1])
                    times.append(time.perf_counter() - start)
                store.close()
                out[fmt, where] = statistics.median(times[1:])
    # One scored group of the demo at batch 32: tokens, versions, behaviour log-probs, top-8 cache.
    import numpy as np

    B, T, P, K = 32, 28, 16, 8
    rng = np.random.default_rng(0)
    record = {
        "index": np.asarray(1),
        "oldest_version": np.asarray(0),
        "newest_version": np.asarray(0),
        "batch.prompt_tokens": rng.integers(0, 19, (B, P)).astype(np.int32),
        "batch.prompt_mask": np.ones((B, P), bool),
        "batch.response_tokens": rng.integers(0, 19, (B, T)).astype(np.int32),
        "batch.response_mask": np.ones((B, T), bool),
        "batch.behavior_logp": rng.normal(size=(B, T)).astype(np.float32),
        "batch.token_version": np.zeros((B, T), np.int32),
        "cache.token_logp": rng.normal(size=(B, T)).astype(np.float32),
        "cache.topk_ids": rng.integers(0, 19, (B, T, K)).astype(np.int32),
        "cache.topk_logp": rng.normal(size=(B, T, K)).astype(np.float32),
        "rewards": np.ones(B, np.float32),
    }
    with tempfile.TemporaryDirectory() as tmp:
        spool = Spool(tmp)
        times = []
        for i in range(repeats * 5):
            start = time.perf_counter()
            path = spool.put(f"{i:010d}", record)
            read_record(path)
            times.append(time.perf_counter() - start)
        out["spool group"] = statistics.median(times)
        out["spool bytes"] = path.stat().st_size
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=10, help="first steps left out of the rate (compilation)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--placements", default="threads,processes")
    parser.add_argument("--set", action="append", default=[], metavar="A.B=C", help="config override for every run")
    args = parser.parse_args()
    placements = args.placements.split(",")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "fully_async"):
            for placement in placements:
                results[mode, placement] = r = run(mode, placement, args, Path(tmp))
                print(
                    f"{mode:11} {placement:9} {r['rate']:7.1f} samples/s   per batch: rollout + scoring "
                    f"{r['t_rollout'] * 1e3:5.1f} ms, learn + publish {r['t_learn'] * 1e3:5.1f} ms",
                    flush=True,
                )
    cores = len(os.sched_getaffinity(0))
    print(f"workload: demo, batch {args.batch}, {args.steps} steps (first {args.skip} skipped), {cores} CPU cores")
    best_sync = max((results["sync", p]["rate"], p) for p in placements)
    best_async = max((results["fully_async", p]["rate"], p) for p in placements)
    print(f"best sync:  {best_sync[0]:7.1f} samples/s ({best_sync[1]})")
    print(f"best async: {best_async[0]:7.1f} samples/s ({best_async[1]}, η = 2)")
    print(f"speed-up best async / best sync: {best_async[0] / best_sync[0]:.2f}x  (target >= 1.5)")
    for p in placements:
        r = results["fully_async", p]
        bound = args.batch / max(r["t_rollout"], r["t_learn"])
        overlap = (r["t_rollout"] + r["t_learn"]) / max(r["t_rollout"], r["t_learn"])
        print(
            f"fully_async {p}: {r['rate']:.1f} samples/s of its bound B / max(t_r, t_l) = {bound:.1f} -> "
            f"{r['rate'] / bound:.2f} (target >= 0.9); overlap bound (t_r + t_l) / max = {overlap:.2f}x"
        )
    costs = channel_costs()
    for fmt in ("orbax", "safetensors"):
        print(
            f"snapshot publish + load through {fmt:11} (0.1 M parameters, read by another store): "
            + ", ".join(
                f"{where} {costs[fmt, where] * 1e3:.1f} ms" for where in ("/dev/shm", "disk") if (fmt, where) in costs
            )
        )
    print(
        f"spool: commit + read of one scored group of {args.batch}: {costs['spool group'] * 1e3:.2f} ms "
        f"({costs['spool bytes'] / 1024:.0f} KiB)"
    )


if __name__ == "__main__":
    main()
