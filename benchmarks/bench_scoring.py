"""Teacher scoring three ways on the same weights, in one run: in-process, behind our
``asyncopd serve-teacher``, and behind vLLM.

Workload: the demo's (``configs/demo.yaml``): a batch of 64 answers of the shipped student
to the built-in task's prompts (up to 28 tokens each), scored by the shipped teacher for
``forward_kl_topk`` (each answer token's log-prob and the teacher's top-8), as the
scoring stage scores a batch (:class:`~asyncopd_jax.teacher.Scorers`). The three are timed
in turn, round after round (``--repeats``), after a warm-up each, so a load on the machine
falls on all of them; reported: scored positions/s (answer tokens scored per second,
median over the rounds) and each one's ratio to the in-process scorer. Both servers run
in their own process on this machine, float32, the client sending ``teacher.server``'s
defaults: ``rows_per_request`` by API (the batch in one request to ``serve-teacher``, 8 rows
a request to vLLM) with ``in_flight`` (4) requests at once (``--rows``, ``--in-flight``
change them).

Then (unless ``--skip-train``) the demo itself with each teacher for ``--steps`` steps:
samples trained on per second after its first ``--warmup-steps`` (which compile), from
``metrics.jsonl``.

vLLM runs when ``ASYNCOPD_VLLM_PYTHON`` names an interpreter with vLLM's CPU build
(``.ci/run`` builds one; docs/testing.md), else it is left out and the report says so.

    JAX_PLATFORMS=cpu python benchmarks/bench_scoring.py
    JAX_PLATFORMS=cpu python benchmarks/bench_scoring.py --repeats 5 --skip-train      # scoring only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from asyncopd_jax.config import load_config
from asyncopd_jax.models import from_pretrained
from asyncopd_jax.pipeline.run_models import run_models
from asyncopd_jax.pipeline.trainer import Trainer
from asyncopd_jax.sampling import Sampler
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.teacher import Scorers, TeacherScorer, launch
from asyncopd_jax.teacher.client import ServedTeacher, ServerParams

VLLM_PYTHON = "ASYNCOPD_VLLM_PYTHON"


def demo_batch(rows: int):
    """``rows`` answers of the demo's student to its training prompts, and the demo's config."""
    cfg = load_config("demo", [f"learner.batch_size={rows}"])
    models = run_models(cfg)
    graphdef, state = nnx.split(from_pretrained(resolve_model_path(cfg.student.path)))
    prompts, _ = models.task.train_prompts(np.random.default_rng(0), rows)
    sampler = Sampler(graphdef, models.sampling, pad_id=models.task.pad_id)
    batch = sampler.generate(state, prompts, jax.random.key(0), prompt_slots=models.task.prompt_slots)
    return cfg, jax.block_until_ready(batch)


def scoring_rounds(scorers: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each scorer's call, the scorers timed in turn ``repeats`` times."""
    for call in scorers.values():
        call()  # warm-up: compiles, the servers' first batches, the start-up determinism check
    times: dict[str, list[float]] = {name: [] for name in scorers}
    for _ in range(repeats):
        for name, call in scorers.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def demo_samples_per_s(steps: int, warmup: int, output: Path, name: str, sets: list[str]) -> float:
    """The demo's samples trained on per second with these overrides, between its step
    ``warmup`` and its step ``steps`` (the first steps compile)."""
    cfg = load_config(
        "demo",
        [f"output_dir={output}", f"name={name}", f"train.steps={steps}", "train.eval_every=100000", *sets],
    )
    Trainer(cfg, progress=False).run()
    records = [json.loads(line) for line in (output / name / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "samples_per_s" in r]
    # each record's rate is since the run started: samples = rate × time
    first, last = records[warmup - 1], records[-1]
    samples = last["samples_per_s"] * last["time"] - first["samples_per_s"] * first["time"]
    return samples / (last["time"] - first["time"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows", type=int, default=None, help="rows per request (teacher.server.rows_per_request; default by API)"
    )
    parser.add_argument("--in-flight", type=int, default=4, help="requests at once (teacher.server.in_flight)")
    parser.add_argument("--batch", type=int, default=64, help="rollouts per batch (the demo's learner.batch_size)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=60, help="demo steps per teacher")
    parser.add_argument("--warmup-steps", type=int, default=20, help="demo steps left out of its rate (compiles)")
    parser.add_argument("--skip-train", action="store_true", help="scoring only, no demo runs")
    args = parser.parse_args()

    cfg, batch = demo_batch(args.batch)
    positions = int(np.asarray(batch.response_mask).sum())
    params = cfg.scoring
    teacher_dir = resolve_model_path(cfg.teacher.path)
    vocab = from_pretrained(teacher_dir).config.vocab_size
    local = Scorers({"teacher": TeacherScorer(from_pretrained(teacher_dir), params)})
    key = jax.random.key(1)
    vllm_python = os.environ.get(VLLM_PYTHON, "")
    print(
        f"demo batch: {args.batch} answers, {positions} answer tokens; top-{params.topk}, float32; "
        f"rows a request: {args.rows or 'by API'}, {args.in_flight} in flight"
    )

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as servers:
        root = Path(tmp)
        urls = {}
        port = launch.free_port()
        # the server on this process's platform (JAX would otherwise also initialise an
        # installed libtpu there, which slows its CPU scoring by half on this machine)
        env = {**os.environ, "JAX_PLATFORMS": jax.default_backend()}
        urls["asyncopd"] = servers.enter_context(
            launch.running(
                launch.serve_teacher_command(cfg.teacher.path, port),
                port,
                root / "serve-teacher.log",
                launch.SERVE_TEACHER_START_S,
                env,
            )
        )
        if vllm_python:
            port = launch.free_port()
            command = launch.vllm_command(vllm_python, teacher_dir, port)
            start = time.perf_counter()
            urls["vllm"] = servers.enter_context(
                launch.running(command, port, root / "vllm.log", launch.VLLM_START_S, launch.vllm_env())
            )
            print(f"vLLM up in {time.perf_counter() - start:.0f} s")
        else:
            print(f"vLLM left out: {VLLM_PYTHON} is not set")

        def served(api: str) -> Callable[[], object]:
            server = ServerParams(url=urls[api], api=api, rows_per_request=args.rows, in_flight=args.in_flight)
            client = Scorers({"teacher": ServedTeacher(server, params, vocab)})
            return lambda: jax.block_until_ready(client.score(batch, key).cache)

        calls = {"in-process": lambda: jax.block_until_ready(local.score(batch, key).cache)}
        calls["asyncopd serve-teacher"] = served("asyncopd")
        if "vllm" in urls:
            calls["vLLM"] = served("vllm")
        seconds = scoring_rounds(calls, args.repeats)
        base = seconds["in-process"]
        print(f"\nscoring the batch (median of {args.repeats} rounds, interleaved)")
        print(f"{'teacher':<24}{'ms':>9}{'positions/s':>14}{'× in-process time':>20}")
        for name, s in seconds.items():
            print(f"{name:<24}{s * 1e3:>9.1f}{positions / s:>14,.0f}{s / base:>20.2f}")

        if args.skip_train:
            return
        print(f"\nthe demo with each teacher: samples trained on per second, steps {args.warmup_steps} to {args.steps}")
        runs = {"in-process": []}
        runs["asyncopd serve-teacher"] = ["teacher.path=''", f"teacher.server.url={urls['asyncopd']}"]
        runs["asyncopd serve-teacher"].append("teacher.server.api=asyncopd")
        if "vllm" in urls:
            runs["vLLM"] = ["teacher.path=''", f"teacher.server.url={urls['vllm']}"]
        rates = {
            name: demo_samples_per_s(args.steps, args.warmup_steps, root, name.split()[0], sets)
            for name, sets in runs.items()
        }
        for name, rate in rates.items():
            print(f"{name:<24}{rate:>9.1f} samples/s  {rate / rates['in-process']:.2f} × in-process")


if __name__ == "__main__":
    main()
