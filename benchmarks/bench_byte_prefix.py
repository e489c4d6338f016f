"""What ``teacher.mapping: byte_prefix`` costs the teacher, against span alignment, in one run.

The demo's cross-tokenizer pair (the built-in character teacher, ``builtin:student_bpe``):
one batch of ``--rows`` answers of the byte-pair student (its top-8 ids at each position),
scored three ways, round after round (``--repeats``), after a warm-up each:

* ``spans``: the span-aligned teacher (``mapping: spans``; one forward over each answer in
  the teacher's tokens, its top-8 at each position);
* ``byte_prefix``: the student's top-8 ids at each position (``from_teacher = 0``);
* ``byte_prefix-from4``: 4 of them the student tokens that start the teacher's likeliest
  next tokens (``from_teacher = 4``, what the study's arm runs).

Reported per way: seconds per batch (median), and for the byte-prefix ways per student
position scored: the tree's teacher rows (nodes), and the teacher's matmul FLOPs (counted
from each call's jaxpr, :func:`~asyncopd_jax.scale.flops.matmul_flops`, padding included:
what the calls compute) split into the answers' forward (the teacher's forward over each
answer, which span alignment runs too) and the trees (the extra: the roots' LM head and the
paths over the kept keys and values); their ratio to the answers' forward plus an LM head at
every position, what a teacher of the student's own tokenizer costs.

    JAX_PLATFORMS=cpu python benchmarks/bench_byte_prefix.py
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncopd_jax.config import load_config
from asyncopd_jax.models import from_pretrained
from asyncopd_jax.pipeline.run_models import run_models
from asyncopd_jax.sampling import Sampler, SamplingParams
from asyncopd_jax.scale.flops import matmul_flops
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.teacher.byte_prefix_teacher import BytePrefixTeacher
from asyncopd_jax.teacher.cross_tokenizer import CrossTokenizerTeacher
from asyncopd_jax.teacher.prefix_trees import PrefixTrees
from asyncopd_jax.teacher.scorer import ScoringParams, TeacherScorer

TOPK = 8

#: The byte-prefix teacher's jitted calls and their static arguments' places.
CALLS = {"_run_answers": (3,), "_read": (), "_extend": (5,), "_logp_at": ()}


def batch_of(rows: int, seed: int):
    """``rows`` answers of the byte-pair student with its top-8 ids, under the teacher's
    prompts (in its tokens), and the pair."""
    models = run_models(load_config("demo", ["student.path=builtin:student_bpe"]))
    pair = models.retokenizers["teacher"]
    prompts, items = models.task.train_prompts(np.random.default_rng(seed), rows)
    graphdef, state = nnx.split(from_pretrained(resolve_model_path("builtin:student_bpe")))
    params = SamplingParams(temperature=1.0, max_new_tokens=32, student_topk=TOPK, stop_token_ids=pair.student_eos)
    batch = Sampler(graphdef, params).generate(state, prompts, jax.random.key(seed))
    own = [pair.teacher.encode(item.prompt, add_special_tokens=False) for item in items]
    width = max(map(len, own))
    teacher_prompts = np.zeros((rows, width), np.int32)
    for row, ids in enumerate(own):
        teacher_prompts[row, width - len(ids) :] = ids
    batch = batch.__class__(
        **{
            **batch.__dict__,
            "prompt_tokens": jnp.asarray(teacher_prompts),
            "prompt_mask": jnp.asarray(teacher_prompts != 0),
        }
    )
    return models, pair, batch


def counted(scorer: PrefixTrees) -> collections.Counter:
    """Wrap ``scorer``'s jitted calls so each adds its matmul FLOPs to the returned tally
    (``answers``: the answers' forward; ``trees``: the rest)."""
    tally: collections.Counter = collections.Counter()
    known: dict = {}
    for name, static in CALLS.items():
        fn = getattr(scorer, name)

        def call(*args, fn=fn, name=name, static=static):
            fixed = {i: args[i] for i in static}
            dynamic = [a for i, a in enumerate(args) if i not in static]
            key = (name, str(jax.tree.map(lambda a: (a.shape, str(a.dtype)), dynamic)), tuple(fixed.items()))
            if key not in known:

                def bound(*values):
                    rest = iter(values)
                    return fn(*[fixed[i] if i in fixed else next(rest) for i in range(len(args))])

                known[key] = matmul_flops(bound, *dynamic)
            tally["answers" if name == "_run_answers" else "trees"] += known[key]
            return fn(*args)

        scorer.__dict__[name] = call  # the cached_property's slot: the wrapper is what score() calls
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    models, pair, batch = batch_of(args.rows, args.seed)
    teacher = from_pretrained(resolve_model_path("builtin:teacher"))
    params = ScoringParams(topk=TOPK)
    positions = int(np.asarray(batch.response_mask).sum())
    head = matmul_flops(teacher.logits, jax.ShapeDtypeStruct((positions, teacher.config.hidden_size), jnp.float32))
    ways = {
        "spans": CrossTokenizerTeacher(
            TeacherScorer(teacher, params, pad_rows=True), pair, teacher.config.max_position_embeddings
        ),
        "byte_prefix": BytePrefixTeacher(PrefixTrees(teacher, pair.teacher_bytes), pair, params),
        "byte_prefix-from4": BytePrefixTeacher(PrefixTrees(teacher, pair.teacher_bytes), pair, params, from_teacher=4),
    }
    print(f"{args.rows} answers, {positions} student positions, top-{TOPK}; {jax.devices()[0].platform}")
    for name, scorer in ways.items():
        tally = counted(scorer.trees) if isinstance(scorer, BytePrefixTeacher) else None
        jax.block_until_ready(scorer.score(batch))  # warm-up: compiles
        seconds = []
        for _ in range(args.repeats):
            if tally is not None:
                tally.clear()
                scorer.trees.forget()  # a new batch: its answers run anew (as every batch of a run)
            start = time.perf_counter()
            jax.block_until_ready(scorer.score(batch))
            seconds.append(time.perf_counter() - start)
        line = f"{name:18s} {statistics.median(seconds):.3f} s a batch"
        if isinstance(scorer, BytePrefixTeacher) and tally is not None:
            base = tally["answers"] + head
            line += (
                f"; per position: {scorer.last_rows / positions:.2f} tree rows, "
                f"{tally['answers'] / positions:,.0f} FLOPs answers' forward + {tally['trees'] / positions:,.0f} trees "
                f"= {(tally['answers'] + tally['trees']) / base:.2f}x the answers' forward and a head a position "
                f"({base / positions:,.0f})"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
