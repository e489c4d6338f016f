"""E2 of the staleness study: async-RL stabilisers against recomputing the reverse-KL signal.

AsyncOPD's second finding: for reverse KL under staleness, the stabilisers of
asynchronous RL (PPO clip, AReaL's decoupled PPO, truncated IS, M2PO, and the
second-moment-budgeted clip that this study first ran as "M2PO") do not beat
recomputing the signal ``log q − log π_θ`` at learner time with importance weights.
Every variant distils the built-in task under ``fixed_lag`` (exact staleness k) with
N = 1 (the emitted token) and N = 8 (Monte-Carlo candidates). The stabilisers work with
the stale reward ``log q − log μ`` fixed at rollout time, as in async RL, on the emitted
token; PPO clip also on the 8 candidates (its clipped surrogate on each candidate:
``reverse_kl_mc_stale`` with ``estimator.mc.clip_eps``), so that one stabiliser meets recompute at
the same N = 8 (at N = 1 nothing trains well on this task: E1's one-sample
``reverse_kl_pg_stale`` ends at 5.6 % without staleness).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from asyncopd_jax.studies.report import Report, mean_spread, pyplot
from asyncopd_jax.studies.training_runs import fixed_lag_sets, mean_curve, run_trainings
from asyncopd_jax.studies.verdicts import beats, exact_staleness_note, student_before, trains

N8 = ["sampling.num_candidates=8"]
NO_IS = ["estimator.mc.importance_sampling=false"]
CLIP = ["estimator.mc.clip_eps=0.2"]
# (variant, N) → (estimator, extra overrides)
VARIANTS: dict[tuple[str, int], tuple[str, list[str]]] = {
    ("stale signal, no IS", 1): ("reverse_kl_pg_stale", NO_IS),
    ("stale signal + IS", 1): ("reverse_kl_pg_stale", []),
    ("ppo_clip", 1): ("ppo_clip", []),
    ("decoupled_ppo", 1): ("decoupled_ppo", []),
    ("truncated_is", 1): ("truncated_is", []),
    ("m2po", 1): ("m2po", []),
    ("second_moment_clip", 1): ("second_moment_clip", []),  # what E2 ran as "m2po" before the paper's rule landed
    ("recompute + IS", 1): ("reverse_kl_pg", []),
    ("recompute + IS + ratio clip", 1): ("reverse_kl_pg", CLIP),
    ("stale signal, no IS", 8): ("reverse_kl_mc_stale", N8 + NO_IS),
    ("stale signal + IS", 8): ("reverse_kl_mc_stale", N8),
    ("ppo_clip", 8): ("reverse_kl_mc_stale", N8 + CLIP),  # PPO's clipped surrogate on each candidate
    ("recompute + IS", 8): ("reverse_kl_mc", N8),
    ("recompute + IS + ratio clip", 8): ("reverse_kl_mc", N8 + CLIP),
}
# the stabilisers at each N, each compared with the best recompute variant at the same N
STABILISERS: dict[int, tuple[str, ...]] = {
    1: ("ppo_clip", "decoupled_ppo", "truncated_is", "m2po", "second_moment_clip"),
    8: ("ppo_clip",),
}
RECOMPUTE = ("recompute + IS", "recompute + IS + ratio clip")
# N → the variant that is also run without staleness (k = 0; E1 ran exactly these, so they are copied from its
# ledger, not trained): where nothing trains at a lag, it tells staleness from a budget too small to train at all.
WITHOUT_STALENESS: dict[int, str] = {1: "stale signal + IS", 8: "recompute + IS"}
# With N = 8 four variants form a 2 × 2 design, all with IS: (signal, ratio clip) → variant. It separates what
# recomputing the signal does from what the clip does.
FACTORIAL: dict[tuple[str, bool], str] = {
    ("stale", False): "stale signal + IS",
    ("stale", True): "ppo_clip",
    ("recomputed", False): "recompute + IS",
    ("recomputed", True): "recompute + IS + ratio clip",
}


@dataclasses.dataclass(frozen=True)
class Settings:
    steps: int
    batch_size: int
    warmup_steps: int
    learning_rate: float
    lags: tuple[int, ...]
    diagnostics_every: int
    probe_prompts: int
    eval_prompts: int


# E1's run length and its smaller learning rate. At E1's larger rate (3e-3) recompute + IS (E1's reverse_kl_mc,
# N = 8) ends at 0.0 % on every seed at every k >= 1, and the emitted-token reverse_kl_pg_stale at every k, so
# E2 would compare stabilisers against a reference that never trains. At 1e-3 recompute + IS trains at k <= 2
# and collapses at k >= 4 (E1): the range where a stabiliser has room to help. The choice was made on E1's
# numbers before any stabiliser run (E1: docs/study/kl_direction.md).
FULL = Settings(
    steps=600,
    batch_size=64,
    warmup_steps=20,
    learning_rate=1e-3,
    lags=(2, 4, 8),
    diagnostics_every=50,
    probe_prompts=64,
    eval_prompts=256,
)
QUICK = Settings(
    steps=6,
    batch_size=8,
    warmup_steps=2,
    learning_rate=3e-3,
    lags=(2,),
    diagnostics_every=3,
    probe_prompts=8,
    eval_prompts=16,
)


def _sets(estimator: str, extra: list[str], lag: int, seed: int, s: Settings) -> list[str]:
    return [
        f"estimator.name={estimator}",
        *extra,
        *fixed_lag_sets(
            seed=seed,
            lag=lag,
            learning_rate=s.learning_rate,
            batch_size=s.batch_size,
            steps=s.steps,
            warmup_steps=s.warmup_steps,
            diagnostics_every=s.diagnostics_every,
            probe_prompts=s.probe_prompts,
            eval_prompts=s.eval_prompts,
        ),
    ]


def _run(variant: str, n: int, lag: int, seed: int, s: Settings) -> tuple[str, list[str]]:
    """(run name, overrides) of one variant at lag k and seed."""
    estimator, extra = VARIANTS[variant, n]
    name = f"{variant.replace(' ', '_').replace('+', 'and').replace(',', '')}-N{n}-k{lag}-s{seed}"
    return name, _sets(estimator, extra, lag, seed, s)


def run(
    out_dir: str | Path,
    work_dir: str | Path,
    *,
    quick: bool = False,
    seeds: int = 3,
    jobs: int = 1,
    command: str = "asyncopd study stabilisers",
) -> Path:
    s = QUICK if quick else FULL
    runs = {}
    for seed in range(seeds):  # a whole seed at a time: a partly finished study is most useful so
        for lag in s.lags:
            runs.update({(variant, n, lag, seed): _run(variant, n, lag, seed, s) for variant, n in VARIANTS})
        runs.update({(variant, n, 0, seed): _run(variant, n, 0, seed, s) for n, variant in WITHOUT_STALENESS.items()})
    # "stale signal + IS" (N = 1) and "recompute + IS" (N = 8) are E1's reverse_kl_pg_stale and reverse_kl_mc runs,
    # at every lag E1 has (2, 4, 8 and k = 0): copied from its ledger
    results = run_trainings(
        Path(work_dir) / "stabilisers",
        Path(out_dir) / "stabilisers" / "runs.jsonl",
        runs,
        jobs=jobs,
        shared=[Path(out_dir) / "kl_direction" / "runs.jsonl"],
    )
    return _write_report(Path(out_dir), results, s, seeds, command)


def summarise(result: dict) -> dict[str, float]:
    """Final accuracy and probe KL, mean zero-gradient fraction and grad norm, largest ratio."""
    records = result["records"]

    def series(key):
        return np.array([r[key] for r in records if key in r], float)

    def last(key):
        values = series(key)
        return float(values[-1]) if values.size else np.nan

    return {
        "accuracy": float(result["summary"].get("student_after", np.nan)),
        "reverse_kl": last("probe_reverse_kl"),
        "zero_grad": float(np.mean(series("zero_grad_fraction"))) if records else np.nan,
        "grad_norm": float(np.mean(series("grad_norm"))) if records else np.nan,
        "ratio_max": float(np.max(series("importance_ratio_max"))) if records else np.nan,
    }


def _write_report(out_dir: Path, results: dict, s: Settings, seeds: int, command: str) -> Path:
    report = Report(out_dir, "stabilisers", "E2: stabilisers vs recompute for reverse KL under staleness", command)
    report.text(
        f"Each run distils the built-in task for {s.steps} optimizer steps (batch {s.batch_size}, learning "
        f"rate {s.learning_rate:g} warmed up linearly over {s.warmup_steps} steps, then constant, "
        f"`schedule.mode: fixed_lag` with lag k), seeds 0–{seeds - 1}. "
        "Accuracy: held-out, greedy, after the last step; KL: exact KL(π ‖ q) on the probe set at the end; "
        "zero-gradient tokens: the share of response tokens a loss gives no gradient (clipped or masked), "
        "mean over steps; grad norm: mean over steps; ratio: the largest π_θ/μ of an emitted token in "
        'the run. "a ± b": mean ± half-range over seeds.'
    )
    report.text(
        "`m2po` is the M2PO paper's rule (mask the tokens with the largest squared log-ratio until the "
        "batch's second moment is within τ_M2 = 0.04; no clipping); `second_moment_clip` is the trust region "
        "the M2PO authors' code runs instead (a PPO clip range set by that budget over the harmful tokens), "
        "which this study ran under the name m2po until 2026-11-24."
    )
    teacher, before = student_before(results)
    report.text(f"Teacher: {100 * teacher:.1f} %; student before distillation: {100 * before:.1f} %.")
    report.text(exact_staleness_note(results, lambda key: key[2]))
    summary = {key: summarise(r) for key, r in results.items()}

    def cell(variant, n, lag, field, scale=1.0):
        return mean_spread([scale * summary[variant, n, lag, seed][field] for seed in range(seeds)])

    report.text(
        "Without staleness (k = 0; the same runs as E1's): "
        + "; ".join(
            f"{variant}, N = {n} (`{VARIANTS[variant, n][0]}`): {cell(variant, n, 0, 'accuracy', 100)} %"
            for n, variant in WITHOUT_STALENESS.items()
        )
        + "."
    )
    variants = list(VARIANTS)
    for lag in s.lags:
        report.heading(f"Staleness k = {lag}")
        report.table(
            ["variant", "N", "accuracy (%)", "KL(π ‖ q)", "zero-grad tokens", "grad norm", "largest ratio"],
            [
                [
                    v,
                    n,
                    cell(v, n, lag, "accuracy", 100),
                    cell(v, n, lag, "reverse_kl"),
                    cell(v, n, lag, "zero_grad"),
                    cell(v, n, lag, "grad_norm"),
                    cell(v, n, lag, "ratio_max"),
                ]
                for v, n in variants
            ],
        )
    _plots(report, results, summary, s, seeds)
    report.heading("Signal × ratio clip (N = 8)")
    report.table(
        [
            "N = 8, accuracy (%)",
            *[f"k = {k}, {'clip' if clip else 'no clip'}" for k in s.lags for clip in (False, True)],
        ],
        [
            [
                f"{signal} signal",
                *[cell(FACTORIAL[signal, clip], 8, k, "accuracy", 100) for k in s.lags for clip in (False, True)],
            ]
            for signal in ("stale", "recomputed")
        ],
    )
    report.text(_factorial(summary, s, seeds))
    failed = [f"{v} N={n} k={k} seed {seed}: {r['error']}" for (v, n, k, seed), r in results.items() if r["error"]]
    if failed:
        report.text("Runs that stopped with an error: " + "; ".join(failed))
    report.heading("Verdict")
    report.text(_verdict(summary, s, seeds, before))
    report.config(
        "Settings of every run (asyncopd_jax/configs/demo.yaml plus these overrides)",
        {f"{v}, N={n}, k={k}, seed={seed}": r["sets"] for (v, n, k, seed), r in results.items()},
    )
    return report.write()


def _verdict(summary: dict, s: Settings, seeds: int, before: float) -> str:
    """Finding 2 from the accuracies: at each k and N, the best stabiliser against the best
    recompute variant (+ IS, with or without the ratio clip) with the same N (the same
    samples and teacher scores per position), and against recompute + IS alone (AsyncOPD's
    recipe: clipping effectively off). A (k, N) at which neither trains
    (:func:`verdicts.trains`) is no evidence either way."""
    parts, beaten, beaten_unclipped, no_evidence = [], [], [], []
    for lag in s.lags:
        for n, stabilisers in STABILISERS.items():

            def accuracies(variant):
                return np.array([summary[variant, n, lag, seed]["accuracy"] for seed in range(seeds)])

            def margin(a, b):
                return f"{100 * (np.mean(a) - np.mean(b)):.1f} points"

            best, best_recompute = (
                max(variants, key=lambda v: np.mean(accuracies(v))) for variants in (stabilisers, RECOMPUTE)
            )
            stabiliser, recompute, unclipped = accuracies(best), accuracies(best_recompute), accuracies(RECOMPUTE[0])
            parts.append(
                f"k = {lag}, N = {n}: best stabiliser {best} {mean_spread(100 * stabiliser)} %, best "
                f"recompute ({best_recompute}) {mean_spread(100 * recompute)} %."
            )
            if not trains(stabiliser, before) and not trains(recompute, before):
                no_evidence.append(f"k = {lag} N = {n}")
            elif beats(stabiliser, recompute):
                beaten.append(f"{best} at k = {lag}, N = {n} by {margin(stabiliser, recompute)}")
            elif beats(stabiliser, unclipped):
                beaten_unclipped.append(
                    f"{best} at k = {lag}, N = {n} by {margin(stabiliser, unclipped)} "
                    f"(recompute + IS: {mean_spread(100 * unclipped)} %)"
                )
    floor = (
        f" No evidence at {', '.join(no_evidence)}: neither side trains there (mean accuracy under "
        f"{100 * before:.1f} + 10 points)."
        if no_evidence
        else ""
    )
    for n, variant in WITHOUT_STALENESS.items():  # why nothing trains: staleness, or a budget that never trains
        if not any(case.endswith(f"N = {n}") for case in no_evidence):
            continue
        unstale = np.array([summary[variant, n, 0, seed]["accuracy"] for seed in range(seeds)])
        floor += f" At N = {n}, {variant} without staleness (k = 0) ends at {mean_spread(100 * unstale)} %: " + (
            "the likely reason is the staleness, not the budget."
            if trains(unstale, before)
            else "nothing trains at this budget even without staleness, so the likely reason is the "
            "estimator's variance with so few samples (E3 measures it), not the staleness."
        )
    if beaten:
        verdict = "not reproduced: " + "; ".join(beaten) + " (more than the seeds' spread)"
    elif len(no_evidence) == len(s.lags) * len(STABILISERS):
        verdict = "inconclusive: nothing compared here trains at any k, so the comparison says nothing"
    elif beaten_unclipped:
        verdict = (
            "partly reproduced: no stabiliser beats recomputing with the same N and the ratio clip by more "
            "than the seeds' spread, but a stabiliser beats recompute + IS without the clip (AsyncOPD's "
            "recipe: clipping effectively off): " + "; ".join(beaten_unclipped) + ". The 2 × 2 above "
            "separates the clip from the signal"
        )
    else:
        verdict = "reproduced: no stabiliser beats recomputing with the same N by more than the seeds' spread"
    return (
        "Finding 2 (stabilisers do not beat recompute for reverse KL): "
        + " ".join(parts)
        + floor
        + f" Verdict: {verdict}."
    )


def _factorial(summary: dict, s: Settings, seeds: int) -> str:
    """What recomputing the signal and what the ratio clip each change at N = 8, per k: the
    difference of mean accuracy with one factor switched and the other held, marked where it
    is outside the seeds' spread (:func:`verdicts.beats` either way)."""

    def accuracies(signal, clip, lag):
        return np.array([summary[FACTORIAL[signal, clip], 8, lag, seed]["accuracy"] for seed in range(seeds)])

    def effect(a, b):  # a − b in points, "*" where it is outside the seeds' spread
        mark = "*" if beats(a, b) or beats(b, a) else ""
        return f"{100 * (np.mean(a) - np.mean(b)):+.1f}{mark}"

    parts = [
        f"k = {lag}: the clip {effect(accuracies('stale', True, lag), accuracies('stale', False, lag))} "
        f"(stale signal) / {effect(accuracies('recomputed', True, lag), accuracies('recomputed', False, lag))} "
        f"(recomputed); recomputing {effect(accuracies('recomputed', False, lag), accuracies('stale', False, lag))}"
        f" (no clip) / {effect(accuracies('recomputed', True, lag), accuracies('stale', True, lag))} (clip)"
        for lag in s.lags
    ]
    return (
        "Accuracy points each factor adds with the other held (* outside the seeds' spread): " + "; ".join(parts) + "."
    )


def _plots(report: Report, results: dict, summary: dict, s: Settings, seeds: int) -> None:
    """Final accuracy against k for every variant (one panel per N), and the exact reverse KL
    during training of the N = 8 variants (one panel per k)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, n in zip(axes, (1, 8)):
        for variant, v_n in VARIANTS:
            if v_n != n:
                continue
            values = np.array(
                [[100 * summary[variant, n, k, seed]["accuracy"] for seed in range(seeds)] for k in s.lags]
            )
            mean = values.mean(axis=1)
            ax.errorbar(
                s.lags,
                mean,
                yerr=[mean - values.min(axis=1), values.max(axis=1) - mean],
                marker="o",
                capsize=3,
                label=variant,
            )
        ax.set_title(f"N = {n}", fontsize=10)
        ax.set_xlabel("staleness k")
        ax.set_xticks(list(s.lags))
        ax.legend(fontsize=7)
    axes[0].set_ylabel("held-out accuracy (%)")
    report.figure(fig, "accuracy.png", "Final held-out accuracy against staleness, mean and range over seeds")
    plt.close(fig)

    fig, axes = plt.subplots(1, len(s.lags), figsize=(4.5 * len(s.lags), 3.6), sharey=True, squeeze=False)
    for ax, lag in zip(axes[0], s.lags):
        for variant, n in VARIANTS:
            if n != 8:
                continue
            steps, mean = mean_curve([results[variant, n, lag, seed] for seed in range(seeds)], "probe_reverse_kl")
            if steps:
                ax.plot(steps, mean, marker=".", label=variant)
        ax.set_title(f"N = 8, k = {lag}", fontsize=10)
        ax.set_yscale("log")
        ax.set_xlabel("learner step")
    axes[0, 0].set_ylabel("exact KL(π ‖ q) on the probe")
    axes[0, 0].legend(fontsize=7)
    report.figure(
        fig,
        "reverse_kl.png",
        "Exact reverse KL of the student to the teacher during training, N = 8 variants, mean over seeds",
    )
    plt.close(fig)
