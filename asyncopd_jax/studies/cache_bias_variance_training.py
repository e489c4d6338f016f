"""E3's training arms: distilling on each forward-KL cache estimator against the exact dense forward KL.

The bias and variance of :mod:`.cache_bias_variance` are per gradient; whether they matter
is what a run ends at. Each arm distils the built-in task with one forward-KL estimator
under the fully asynchronous schedule with staleness bound η (``schedule.mode:
fully_async``, ``schedule.max_staleness: η``; η = 0 is synchronous), over several seeds:

- ``forward_kl_dense`` with ``teacher.payload: hidden`` (the teacher ships its hidden
  states and the learner applies the teacher's head: the exact KL over the vocabulary),
  the reference;
- ``forward_kl_topk`` (the demo's estimator: the teacher's top ``scoring.topk`` = 8 ids
  plus a tail bucket), ``forward_kl_topk_renormalized`` (the same ids, both renormalised)
  and ``forward_kl_mc`` (8 ids drawn from the teacher, ``scoring.num_samples: 8``).

The runs go through :func:`.training_runs.run_trainings` (a ledger next to the report,
``docs/study/cache_bias_variance/runs.jsonl``), with E1's optimiser (learning rate warmed
up, then constant; :func:`.training_runs.fixed_lag_sets` less its schedule).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from asyncopd_jax.studies.report import Report, mean_spread
from asyncopd_jax.studies.training_runs import fixed_lag_sets, run_trainings
from asyncopd_jax.studies.verdicts import beats, student_before, trains

REFERENCE = "forward_kl_dense"
# arm → the overrides it needs besides estimator.name (the demo's cache: scoring.topk = 8)
ARMS: dict[str, list[str]] = {
    REFERENCE: ["teacher.payload=hidden"],
    "forward_kl_topk": [],
    "forward_kl_topk_renormalized": [],
    "forward_kl_mc": ["scoring.num_samples=8"],
}


@dataclasses.dataclass(frozen=True)
class TrainingSettings:
    steps: int
    batch_size: int
    warmup_steps: int
    learning_rate: float
    etas: tuple[int, ...]  # staleness bounds (schedule.max_staleness)
    arms: tuple[str, ...]  # of ARMS, the reference first
    diagnostics_every: int
    probe_prompts: int
    eval_prompts: int


# 300 steps of 64 (19 k samples) at E1's larger rate (E1's forward-KL runs reach about half their 600-step
# sampled accuracy by then), three arms: on 2026-11-28 a run took 1.5–4 min on a shared 2-core machine and
# 27 runs were what the study's budget held; forward_kl_mc (trained by E1 under exact lag) was left out.
FULL_TRAINING = TrainingSettings(
    steps=300,
    batch_size=64,
    warmup_steps=20,
    learning_rate=3e-3,
    etas=(0, 2, 4),
    arms=(REFERENCE, "forward_kl_topk", "forward_kl_topk_renormalized"),
    diagnostics_every=100,
    probe_prompts=64,
    eval_prompts=256,
)
QUICK_TRAINING = TrainingSettings(
    steps=4,
    batch_size=8,
    warmup_steps=1,
    learning_rate=3e-3,
    etas=(2,),
    arms=tuple(ARMS),
    diagnostics_every=2,
    probe_prompts=8,
    eval_prompts=16,
)


def training_sets(arm: str, eta: int, seed: int, s: TrainingSettings) -> list[str]:
    """The overrides of one run: the estimator and its cache, E1's optimiser and final eval, and
    the staleness bound η of the fully asynchronous schedule."""
    shared = fixed_lag_sets(
        seed=seed,
        lag=0,
        learning_rate=s.learning_rate,
        batch_size=s.batch_size,
        steps=s.steps,
        warmup_steps=s.warmup_steps,
        diagnostics_every=s.diagnostics_every,
        probe_prompts=s.probe_prompts,
        eval_prompts=s.eval_prompts,
    )
    return [
        f"estimator.name={arm}",
        *ARMS[arm],
        *[x for x in shared if not x.startswith("schedule.")],
        "schedule.mode=fully_async",
        f"schedule.max_staleness={eta}",
    ]


def train_arms(out_dir: Path, work_dir: Path, s: TrainingSettings, seeds: int, jobs: int) -> dict:
    """(arm, η, seed) → the run (``{"sets", "records", "summary", "error"}``), trained where the
    ledger lacks it: the reference and top-K at every η and seed first, then the other arms."""
    order = [a for a in s.arms if a in (REFERENCE, "forward_kl_topk")] + [
        a for a in s.arms if a not in (REFERENCE, "forward_kl_topk")
    ]
    runs = {
        (arm, eta, seed): (f"{arm}-eta{eta}-s{seed}", training_sets(arm, eta, seed, s))
        for arm in order[:2]
        for seed in range(seeds)
        for eta in s.etas
    }
    runs |= {
        (arm, eta, seed): (f"{arm}-eta{eta}-s{seed}", training_sets(arm, eta, seed, s))
        for seed in range(seeds)
        for eta in s.etas
        for arm in order[2:]
    }
    return run_trainings(
        work_dir / "cache_bias_variance", out_dir / "cache_bias_variance" / "runs.jsonl", runs, jobs=jobs
    )


def summarise(result: dict[str, Any]) -> dict[str, float]:
    """Held-out accuracy at the end, the last probe KL(q ‖ π) and the staleness the run saw."""
    records = result["records"]

    def series(key):
        return np.array([r[key] for r in records if key in r], float)

    forward = series("probe_forward_kl")
    return {
        "accuracy": float(result["summary"].get("student_after", np.nan)),
        "forward_kl": float(forward[-1]) if forward.size else np.nan,
        "staleness_mean": float(np.mean(series("staleness_mean"))) if records else np.nan,
        "staleness_max": float(np.max(series("staleness_max"))) if records else np.nan,
    }


def write_training(report: Report, results: dict, s: TrainingSettings, seeds: int) -> None:
    """The training section of the E3 report: tables and the verdict."""
    report.heading("Training on each forward estimator against the exact dense forward KL")
    report.text(
        f"Each run distils the built-in task for {s.steps} optimizer steps (batch {s.batch_size}, learning rate "
        f"{s.learning_rate:g} warmed up linearly over {s.warmup_steps} steps, then constant: E1's optimiser, "
        "shorter), `schedule.mode: fully_async` with staleness bound `schedule.max_staleness: η` (η = 0: "
        f"synchronous), seeds 0–{seeds - 1}. `forward_kl_dense` runs with `teacher.payload: hidden` (the "
        "exact KL over the vocabulary); the top-K arms use the demo's cache (`scoring.topk: 8`, K/V = 8/32)"
        + (", `forward_kl_mc` 8 teacher samples per position" if "forward_kl_mc" in s.arms else "")
        + f". Arms not run: {', '.join(a for a in ARMS if a not in s.arms) or 'none'}. Accuracy: held-out, "
        f"greedy, {s.eval_prompts} problems, after the last step; KL(q ‖ π): exact, on {s.probe_prompts} probe "
        "prompts, "
        "the last probe (measured before the last batch of steps); staleness: versions between the policy that "
        "sampled a consumed token and the learner's (mean over the run / largest): the bound is a ceiling. "
        '"a ± b": mean ± half-range over seeds.'
    )
    teacher, before = student_before(results)
    report.text(f"Teacher: {100 * teacher:.1f} %; student before distillation: {100 * before:.1f} %.")
    summary = {key: summarise(r) for key, r in results.items()}

    def values(arm, eta, field):
        return [summary[arm, eta, seed][field] for seed in range(seeds)]

    report.table(
        ["final accuracy (%)", *[f"η = {eta}" for eta in s.etas]],
        [[arm, *[mean_spread([100 * v for v in values(arm, eta, "accuracy")]) for eta in s.etas]] for arm in s.arms],
    )
    report.table(
        ["final KL(q ‖ π) / staleness mean / largest", *[f"η = {eta}" for eta in s.etas]],
        [
            [
                arm,
                *[
                    f"{np.nanmean(values(arm, eta, 'forward_kl')):.3g} / "
                    f"{np.nanmean(values(arm, eta, 'staleness_mean')):.2f} / "
                    f"{np.nanmax(values(arm, eta, 'staleness_max')):.0f}"
                    for eta in s.etas
                ],
            ]
            for arm in s.arms
        ],
    )
    failed = [f"{key}: {r['error']}" for key, r in results.items() if r["error"]]
    if failed:
        report.text("Runs that stopped with an error: " + "; ".join(failed))
    report.text(training_verdict(lambda arm, eta: values(arm, eta, "accuracy"), s, before))
    eta, seed = s.etas[-1], seeds - 1  # the others differ in schedule.max_staleness and seed only
    report.config(
        f"Settings of the training runs at η = {eta}, seed {seed} (asyncopd_jax/configs/demo.yaml plus these "
        "overrides; the other runs differ in `schedule.max_staleness` and `seed` only)",
        {arm: results[arm, eta, seed]["sets"] for arm in s.arms},
    )


def training_verdict(accuracy, s: TrainingSettings, before: float) -> str:
    """At each η, each cache arm against the dense reference by one stated rule: **within the
    seeds' spread** when neither beats the other (:func:`verdicts.beats`: a mean higher by more
    than either's half-range over seeds and by at least 1 point), else below or above it. No
    comparison at an η where the reference does not train (:func:`verdicts.trains`).
    ``accuracy(arm, eta)`` gives the per-seed accuracies."""
    parts: list[str] = []
    within: list[str] = []
    outside: list[str] = []
    for eta in s.etas:
        dense = np.asarray(accuracy(REFERENCE, eta))
        if not trains(dense, before):
            parts.append(
                f"η = {eta}: no comparison, the reference ends at {mean_spread(100 * dense)} % (under "
                f"{100 * before:.1f} + 10 points)."
            )
            continue
        cells = []
        for arm in s.arms[1:]:
            other = np.asarray(accuracy(arm, eta))
            if beats(dense, other):
                where, bucket = "below the reference", outside
            elif beats(other, dense):
                where, bucket = "above the reference", outside
            else:
                where, bucket = "within the seeds' spread", within
            bucket.append(f"{arm} at η = {eta}")
            cells.append(f"{arm} {mean_spread(100 * other)} % ({where}, {100 * (other.mean() - dense.mean()):+.1f})")
        parts.append(f"η = {eta}: {REFERENCE} {mean_spread(100 * dense)} %; " + "; ".join(cells) + ".")
    if not within and not outside:
        verdict = "no comparison"
    elif not outside:
        verdict = "every cache arm ends within the seeds' spread of the dense reference at every η"
    else:
        verdict = f"{len(outside)} of {len(within) + len(outside)} arm-η pairs end outside it ({'; '.join(outside)})"
    return (
        "Training verdict (does a cached forward KL end where the exact one does?), judged at each η: an arm is "
        "within the seeds' spread of `forward_kl_dense` when neither's mean accuracy exceeds the other's by more "
        "than either's half-range over seeds (and 1 point). " + " ".join(parts) + f" Verdict: {verdict}."
    )
