"""What a served teacher's answer costs on the wire: the hidden-state payload against the
top-K scores, as ``asyncopd serve-teacher`` answers them, in one run.

One server per model (``asyncopd serve-teacher`` in its own process on this machine); the
same rows (random ids: ``--rows`` answers of ``--response`` tokens after ``--prompt``
prompt tokens) are scored five ways, round after round (``--repeats``), after a warm-up
each:

* ``topk-json``: the teacher's top-K (``--topk``) and each token's log-prob, as JSON lists
  (the extension's ``encoding: json``; vLLM's own ``prompt_logprobs`` answer is larger);
* ``topk-base64``: the same, base64 (what a run's client asks for scores);
* ``topk-npy``: the same, one ``.npz`` body;
* ``hidden-bf16-npy``: the same plus the final hidden states in bfloat16, one ``.npz``
  body (what a run's client asks for ``payload: hidden``);
* ``hidden-f32-base64``: the same plus float32 hidden states, base64.

Reported per way: the answer's bytes, the seconds from sending the request to holding the
checked arrays (:func:`~asyncopd_jax.teacher.wire.parse_asyncopd`: the client's own reader),
median over the rounds, and each one's ratio to ``topk-json``; and what the full
float32 logits of the same positions would take.

Two models: the built-in teacher (H = 128 > V = 32: there the hidden states are larger than
the logits), and a Qwen3-0.6B-shaped one (H = 1024, V = 151,936; random weights, 2 layers
rather than 28: the payload depends on H and V, not on the depth, and 2 keep its scoring
short on a CPU).

    JAX_PLATFORMS=cpu python benchmarks/bench_served_payload.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx2
import numpy as np
from flax import nnx

from asyncopd_jax.models import Decoder, save_pretrained
from asyncopd_jax.models.config import read_hf_config
from asyncopd_jax.scale.learner_inputs import ARCHITECTURES
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.teacher import launch
from asyncopd_jax.teacher.client import BINARY, binary_answer
from asyncopd_jax.teacher.wire import Row, head_card, npz_choices, parse_asyncopd

WAYS = {  # name → the extension's hidden and encoding
    "topk-json": (None, "json"),
    "topk-base64": (None, "base64"),
    "topk-npy": (None, "npy"),
    "hidden-bf16-npy": ("bfloat16", "npy"),
    "hidden-f32-base64": ("float32", "base64"),
}


def qwen3_shaped(directory: Path, layers: int) -> Path:
    """A Qwen3-0.6B-shaped model (its widths and vocabulary, ``layers`` layers, random weights)."""
    config = json.loads((ARCHITECTURES / "Qwen3-0.6B" / "config.json").read_text())
    config = {**config, "num_hidden_layers": layers, "torch_dtype": "float32"}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    shape, _ = read_hf_config(directory)
    save_pretrained(Decoder(shape, rngs=nnx.Rngs(0)), directory, dtype="float32")
    return directory


def measure(url: str, rows: list[Row], args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Each way's (answer bytes, median seconds to the checked arrays)."""
    client = httpx2.Client(timeout=600)
    card = head_card(client.get(f"{url}/v1/models").json(), url)
    prompts = [[int(i) for i in r.prompt] + [int(i) for i in r.response] for r in rows]
    start = [len(r.prompt) for r in rows]
    times: dict[str, list[float]] = {name: [] for name in WAYS}
    sizes: dict[str, float] = {}
    for round_ in range(args.repeats + 1):  # round 0: the warm-up (compiles)
        for name, (hidden, encoding) in WAYS.items():
            extension = {"response_start": start, "encoding": encoding, **({"hidden": hidden} if hidden else {})}
            body = {"prompt": prompts, "prompt_logprobs": args.topk, "asyncopd": extension}
            began = time.perf_counter()
            response = client.post(f"{url}/v1/completions", json=body)
            response.raise_for_status()
            if response.headers["content-type"].startswith(BINARY):
                answer = npz_choices(binary_answer(response.content, url), url)
            else:
                answer = response.json()
            parse_asyncopd(answer, rows, args.topk, 0, 1 << 30, url, card.hidden_size if hidden else None)
            if round_:
                times[name].append(time.perf_counter() - began)
            sizes[name] = len(response.content)
    return {name: (sizes[name], statistics.median(times[name])) for name in WAYS}


def report(title: str, results: dict[str, tuple[float, float]], positions: int, vocab: int) -> None:
    base_bytes, base_s = results["topk-json"]
    logits = positions * vocab * 4 / 2**20
    print(f"\n{title}: {positions} scored positions; their full float32 logits would be {logits:.2f} MiB")
    print(f"{'way':<20}{'bytes':>14}{'x json':>9}{'seconds':>10}{'x json':>9}")
    for name, (size, seconds) in results.items():
        print(f"{name:<20}{size:>14,.0f}{size / base_bytes:>9.2f}{seconds:>10.4f}{seconds / base_s:>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--topk", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "built-in teacher (H 128, V 32)": (resolve_model_path("builtin:teacher"), 32),
            f"Qwen3-0.6B-shaped (H 1024, V 151,936, {args.layers} layers)": (
                qwen3_shaped(Path(tmp) / "qwen3", args.layers),
                151_936,
            ),
        }
        rng = np.random.default_rng(0)
        for title, (path, vocab) in models.items():
            topk = min(args.topk, vocab)
            ids = rng.integers(2, vocab, (args.rows, args.prompt + args.response))
            rows = [Row(row[: args.prompt], row[args.prompt :]) for row in ids]
            port = launch.free_port()
            command = launch.serve_teacher_command(str(path), port, "--max-topk", str(max(topk, 1)))
            with launch.running(command, port, Path(tmp) / "server.log", timeout=600) as url:
                results = measure(url, rows, argparse.Namespace(**{**vars(args), "topk": topk}))
            report(title, results, args.rows * args.response, vocab)


if __name__ == "__main__":
    main()
