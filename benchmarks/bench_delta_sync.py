"""How many bytes a published version costs as a sparse delta against the full snapshot,
and what loading it costs: optimizer steps on a real-size model, each step published in
the published dtype and diffed against the step before.

A model at the shapes of an architecture in ``asyncopd_jax/scale/architectures/``
(random weights; e.g. Qwen3-0.6B) or the demo's own student (``--model demo``) is trained
in fp32 with the run's optimizer (``learner/optimizer.py``: clipped AdamW, constant
learning rate here) on next-token cross-entropy over random token sequences. After
``--warmup`` steps (Adam's early steps are larger), each of ``--versions`` steps is
published as ``--publish-dtype`` and encoded by :mod:`asyncopd_jax.pipeline.snapshot_deltas`;
a reader's side is timed too: apply the delta to the previous version, then the digest
of the result. Per learning rate it prints the changed fraction, the delta's bytes
against the full snapshot's (mean and max over the versions) and the seconds of each
part, and writes them as JSON (``--out``)::

    python benchmarks/bench_delta_sync.py --model Qwen3-0.6B --lr 1e-6 1e-5
    python benchmarks/bench_delta_sync.py --model demo --lr 3e-3 --publish-dtype float32
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from asyncopd_jax.config import OptimConfig
from asyncopd_jax.config.sections import ModelSource
from asyncopd_jax.learner.optimizer import make_optimizer
from asyncopd_jax.models.decoder import Decoder
from asyncopd_jax.pipeline import snapshot_deltas
from asyncopd_jax.pipeline.model_loading import load_model_and_tokenizer
from asyncopd_jax.scale.learner_inputs import architecture


def build(model: str) -> tuple[Decoder, str]:
    if model == "demo":
        student, _ = load_model_and_tokenizer("builtin:student", "float32")
        return student, "builtin:student"
    config, source = architecture(ModelSource(path=model))
    return Decoder(config, rngs=nnx.Rngs(0), dtype=jnp.float32), f"random weights at {source}"


def run(model_name: str, lr: float, args: argparse.Namespace) -> dict:
    model, source = build(model_name)
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = make_optimizer(
        OptimConfig(learning_rate=lr, warmup_steps=0, schedule="constant"), args.warmup + args.versions
    )
    opt_state = optimizer.init(params)
    vocab = model.config.vocab_size
    publish_dtype = jnp.dtype(args.publish_dtype)

    @jax.jit
    def step(params, opt_state, tokens):
        def loss_fn(p):
            m = nnx.merge(graphdef, p)
            logits = m.logits(m.hidden_states(tokens[:, :-1]))
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def published(params):
        return [x.astype(publish_dtype) for x in jax.tree_util.tree_leaves(params)]

    rng = np.random.default_rng(0)
    previous = None
    rows = []
    for i in range(args.warmup + args.versions):
        tokens = jnp.asarray(rng.integers(0, vocab, (args.batch, args.seq + 1)), jnp.int32)
        params, opt_state, loss = step(params, opt_state, tokens)
        leaves = [np.asarray(x) for x in jax.device_get(published(params))]
        if previous is not None and i >= args.warmup:
            t0 = time.perf_counter()
            delta = snapshot_deltas.diff(previous, leaves)
            t1 = time.perf_counter()
            rebuilt = snapshot_deltas.apply(previous, delta)
            t2 = time.perf_counter()
            check = snapshot_deltas.digest(rebuilt)
            t3 = time.perf_counter()
            if check != snapshot_deltas.digest(leaves):
                raise AssertionError(f"step {i}: the rebuilt version's digest differs")
            rows.append(
                {
                    "step": i,
                    "loss": float(loss),
                    "changed": snapshot_deltas.changed_elements(delta),
                    "delta_bytes": snapshot_deltas.nbytes(delta),
                    "encode_s": t1 - t0,
                    "apply_s": t2 - t1,
                    "digest_s": t3 - t2,
                }
            )
            print(f"  lr {lr:g} step {i}: {rows[-1]['delta_bytes'] / 1e6:.2f} MB, loss {float(loss):.4f}", flush=True)
        previous = leaves
    elements = sum(x.size for x in previous)
    full = sum(x.nbytes for x in previous)
    delta_bytes = np.array([r["delta_bytes"] for r in rows], float)
    return {
        "model": model_name,
        "source": source,
        "lr": lr,
        "publish_dtype": publish_dtype.name,
        "elements": elements,
        "full_bytes": full,
        "versions": len(rows),
        "changed_fraction_mean": float(np.mean([r["changed"] for r in rows]) / elements),
        "delta_bytes_mean": float(delta_bytes.mean()),
        "delta_bytes_max": float(delta_bytes.max()),
        "delta_over_full_mean": float(delta_bytes.mean() / full),
        "encode_s_median": float(np.median([r["encode_s"] for r in rows])),
        "apply_s_median": float(np.median([r["apply_s"] for r in rows])),
        "digest_s_median": float(np.median([r["digest_s"] for r in rows])),
        "device": str(jax.devices()[0].device_kind),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen3-0.6B", help="an architecture name, a model directory, or demo")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--publish-dtype", default="bfloat16")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--versions", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    results = []
    for lr in args.lr:
        r = run(args.model, lr, args)
        results.append(r)
        print(
            f"{r['model']} lr {lr:g} ({r['publish_dtype']} published, {r['versions']} versions on {r['device']}): "
            f"{100 * r['changed_fraction_mean']:.2f} % of elements changed; delta {r['delta_bytes_mean'] / 1e6:.1f} MB "
            f"mean, {r['delta_bytes_max'] / 1e6:.1f} MB max, against {r['full_bytes'] / 1e6:.1f} MB full "
            f"({100 * r['delta_over_full_mean']:.2f} %); encode {r['encode_s_median']:.3f} s, apply "
            f"{r['apply_s_median']:.3f} s, digest {r['digest_s_median']:.3f} s (medians)",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
