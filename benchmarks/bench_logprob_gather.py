"""Value + gradient of the chunked, fused log-prob gather against the dense path.

Both paths compute ``Σ g · log softmax(hidden @ lm_head)[ids]`` and its gradient with
respect to ``hidden`` and ``lm_head``, at a realistic shape (Qwen-size vocabulary). The
dense path materialises ``[T, V]`` logits (and their softmax and cotangent in the
backward); the chunked path holds ``[chunk, V]`` at a time and recomputes logits in the
backward (one extra matmul).

Memory is XLA's compiled buffer assignment (``memory_analysis``: temporaries + outputs),
minus the ``[H, V]`` weight gradient that both paths must return: the measure the target
is on. As a cross-check, each path runs in a fresh process whose resident memory is
sampled every 2 ms during its first (warm-up) and timed steps: the peak above the level
just before a step, minus the weight gradient. Resident memory also holds what XLA:CPU's
runtime keeps outside its buffer assignment (about one extra [H, V] buffer on a first
run here, seen even for ``w * 2``) and memory its allocator keeps for reuse, so that
ratio is an upper bound, not the figure of merit.
Time is the median wall time of ``--repeats`` runs after one warm-up. Ratios are
chunked / dense, measured in the same run.

    python benchmarks/bench_logprob_gather.py            # V=151936, H=2048, T=2048, K=64
    python benchmarks/bench_logprob_gather.py --small    # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from asyncopd_jax.estimators import gather_logprobs, gather_logprobs_from_hidden


def make_inputs(t: int, h: int, v: int, k: int):
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((1, t, h), dtype=np.float32))
    lm_head = jnp.asarray(rng.standard_normal((h, v), dtype=np.float32) / np.float32(np.sqrt(h)))
    ids = jnp.asarray(rng.integers(0, v, (1, t, k)), jnp.int32)
    cotangent = jnp.asarray(rng.standard_normal((1, t, k), dtype=np.float32))
    return hidden, lm_head, ids, cotangent


class PeakRSS:
    """Samples this process's resident set size in a thread; ``peak`` is the maximum seen."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def __enter__(self):
        self.peak = self.rss()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def make_step(path: str, chunk: int):
    def loss(hidden, lm_head, ids, cotangent):
        if path == "dense":
            logp = gather_logprobs(hidden @ lm_head, ids)
        else:
            logp = gather_logprobs_from_hidden(hidden, lm_head, ids, chunk)
        return jnp.sum(logp * cotangent)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def measure(path: str, args) -> dict:
    inputs = make_inputs(args.t, args.h, args.v, args.k)
    step = make_step(path, args.chunk)
    compiled = step.lower(*inputs).compile()
    mem = compiled.memory_analysis()
    weight_grad = args.h * args.v * 4
    beyond = mem.temp_size_in_bytes + mem.output_size_in_bytes - weight_grad
    times, rss_beyond = [], []
    monitor = PeakRSS()
    for run in range(args.repeats + 1):  # run 0 is the warm-up: timed out, but its memory counts
        before = monitor.rss()
        with monitor:
            start = time.perf_counter()
            out = jax.block_until_ready(compiled(*inputs))
            elapsed = time.perf_counter() - start
        times += [elapsed] if run else []
        rss_beyond.append(monitor.peak - before - weight_grad)
        del out
    return {
        "path": path,
        "xla_bytes_beyond_weight_grad": int(beyond),
        "seconds": statistics.median(times),
        "rss_bytes_beyond_weight_grad": int(max(rss_beyond)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--t", type=int, default=2048, help="positions (B·T)")
    parser.add_argument("--h", type=int, default=2048, help="hidden size")
    parser.add_argument("--v", type=int, default=151_936, help="vocabulary")
    parser.add_argument("--k", type=int, default=64, help="cached ids per position")
    parser.add_argument("--chunk", type=int, default=512, help="rows per chunk")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="T=256, H=256, V=32000")
    parser.add_argument("--child", choices=["dense", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.small:
        args.t, args.h, args.v = 256, 256, 32_000
    if args.child:
        print(json.dumps(measure(args.child, args)))
        return

    # Each path in a fresh process, so that peak RSS belongs to that path alone.
    flags = [
        f"--t={args.t}",
        f"--h={args.h}",
        f"--v={args.v}",
        f"--k={args.k}",
        f"--chunk={args.chunk}",
        f"--repeats={args.repeats}",
    ]
    results = {}
    for path in ("dense", "chunked"):
        out = subprocess.run(
            [sys.executable, __file__, f"--child={path}", *flags], check=True, capture_output=True, text=True
        ).stdout
        results[path] = json.loads(out.strip().splitlines()[-1])

    gib = 2**30
    print(
        f"shape: T={args.t} H={args.h} V={args.v} K={args.k} chunk={args.chunk} fp32, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}"
    )
    print(f"weight gradient (both paths): {args.h * args.v * 4 / gib:.2f} GiB")
    print(f"{'path':8} {'XLA beyond dW (GiB)':>20} {'RSS peak beyond dW (GiB)':>25} {'time (s)':>9}")
    for path, r in results.items():
        print(
            f"{path:8} {r['xla_bytes_beyond_weight_grad'] / gib:20.3f} "
            f"{r['rss_bytes_beyond_weight_grad'] / gib:25.3f} {r['seconds']:9.2f}"
        )
    d, c = results["dense"], results["chunked"]
    mem_ratio = c["xla_bytes_beyond_weight_grad"] / d["xla_bytes_beyond_weight_grad"]
    rss_ratio = c["rss_bytes_beyond_weight_grad"] / max(d["rss_bytes_beyond_weight_grad"], 1)
    print(f"memory ratio chunked/dense, XLA (beyond dW): {mem_ratio:.3f}  (target <= 0.25)")
    print(f"memory ratio chunked/dense, RSS (beyond dW): {rss_ratio:.3f}")
    print(f"time ratio chunked/dense:                    {c['seconds'] / d['seconds']:.3f}  (target <= 1.5)")


if __name__ == "__main__":
    main()
