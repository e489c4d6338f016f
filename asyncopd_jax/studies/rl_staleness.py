"""AReaL's staleness ablation: naive PPO against decoupled PPO as the staleness bound η grows.

AReaL (Fu et al., 2025) trains fully asynchronously with a bound η on how many policy
versions a consumed sample may lag; its ablation (1.5B model, AIME24) has naive PPO
fall from 42.0 (η = 0) to 23.3 (η = 4) and 34.0 (η = ∞) while decoupled PPO holds 42.2
at η = 4, 38.7 at η = 16 and 36.9 at η = ∞. Here ``configs/rl.yaml`` (reward-driven RL
on the built-in task from the distilled student, G = 8 answers per prompt, fully async)
runs for η ∈ {0, 1, 2, 4, 8, ∞} with ``ppo_clip`` (naive PPO: clipped ratio against the
behaviour policy, dual clip) and ``decoupled_ppo`` (clip around the proximal policy,
behaviour weight capped). η = 0 is synchronous; η = ∞ is run as η = ``train.steps``, a
bound that cannot bind. The staleness each run actually saw is reported beside it: in
``fully_async`` the bound is a ceiling, and how close the data comes to it depends on how
far the rollout stage gets ahead of the learner.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import numpy as np

from asyncopd_jax.studies.report import Report, mean_spread, pyplot
from asyncopd_jax.studies.training_runs import LEDGER_KEYS, RL, run_trainings, train

KEYS = (*LEDGER_KEYS, "eval_accuracy", "eval_seconds", "time")
OBJECTIVES = {"ppo_clip": "naive PPO (ppo_clip)", "decoupled_ppo": "decoupled PPO"}
# AReaL's staleness ablation (1.5B, AIME24, prior-art.md): η → accuracy, where published
AREAL = {"ppo_clip": {0: 42.0, 4: 23.3, math.inf: 34.0}, "decoupled_ppo": {4: 42.2, 16: 38.7, math.inf: 36.9}}


@dataclasses.dataclass(frozen=True)
class Settings:
    steps: int
    etas: tuple[float, ...]
    eval_every: int
    eval_prompts: int
    batch_size: int


FULL = Settings(steps=200, etas=(0, 1, 2, 4, 8, math.inf), eval_every=50, eval_prompts=256, batch_size=64)
QUICK = Settings(steps=4, etas=(0, math.inf), eval_every=2, eval_prompts=16, batch_size=16)


def _eta(eta: float, s: Settings) -> int:
    return s.steps if math.isinf(eta) else int(eta)


def _label(eta: float) -> str:
    return "∞" if math.isinf(eta) else f"{eta:g}"


def _sets(objective: str, eta: float, seed: int, s: Settings) -> list[str]:
    return [f"seed={seed}", f"estimator.name={objective}", "schedule.mode=fully_async",
            f"schedule.max_staleness={_eta(eta, s)}", f"train.steps={s.steps}", f"train.eval_every={s.eval_every}",
            f"train.checkpoint_every={10**6}", f"task.eval_prompts={s.eval_prompts}",
            f"learner.batch_size={s.batch_size}"]


def run(out_dir: str | Path, work_dir: str | Path, *, quick: bool = False, seeds: int = 3, jobs: int = 1,
        command: str = "asyncopd study rl_staleness") -> Path:
    s = QUICK if quick else FULL
    runs = {(objective, eta, seed): (f"{objective}-eta{_label(eta).replace('∞', 'inf')}-s{seed}",
                                     _sets(objective, eta, seed, s))
            for seed in range(seeds) for eta in s.etas for objective in OBJECTIVES}
    results = run_trainings(Path(work_dir) / "rl_staleness", Path(out_dir) / "rl_staleness" / "runs.jsonl", runs,
                            jobs=jobs, train=functools.partial(train, base=RL, keys=KEYS))
    return _write_report(Path(out_dir), results, s, seeds, command)


def summarise(result: dict) -> dict[str, float]:
    """Final held-out accuracy, the sampled reward over the last tenth of the steps, the
    staleness the run saw (mean and maximum over consumed tokens), the largest importance
    ratio, the share of tokens without gradient, and the training seconds (held-out
    evaluations taken out)."""
    records = result["records"]

    def series(key):
        return np.array([r[key] for r in records if key in r], float)

    tail = max(1, len(records) // 10)
    reward = series("rollout_accuracy")
    return {
        "accuracy": float(result["summary"].get("student_after", np.nan)),
        "reward": float(np.mean(reward[-tail:])) if reward.size else np.nan,
        "staleness_mean": float(np.mean(series("staleness_mean"))) if records else np.nan,
        "staleness_max": float(np.max(series("staleness_max"))) if records else np.nan,
        "ratio_max": float(np.max(series("importance_ratio_max"))) if records else np.nan,
        "zero_grad": float(np.mean(series("zero_grad_fraction"))) if records else np.nan,
        "seconds": float(records[-1]["time"] - np.sum(series("eval_seconds")[:-1])) if records else np.nan,
    }


def _write_report(out_dir: Path, results: dict, s: Settings, seeds: int, command: str) -> Path:
    plt = pyplot()

    report = Report(out_dir, "rl_staleness", "AReaL's staleness ablation: naive vs decoupled PPO", command)
    report.text(f"Each run is `configs/rl.yaml` (reward-driven RL on the built-in task from the distilled student, "
                f"{s.batch_size // 8} prompts × G = 8 answers per batch, learning rate 1e-4, {s.steps} steps, "
                f"`schedule.mode: fully_async`) with the staleness bound η and the objective below, seeds "
                f"0–{seeds - 1}. η = ∞ runs as η = {s.steps} (it cannot bind). Accuracy: held-out, greedy, "
                f"{s.eval_prompts} problems, after the last step; reward: the verifier's mean on the sampled answers "
                "over the last tenth of the steps; staleness: versions between the policy that sampled a consumed "
                "token and the learner's (mean over the run / largest); seconds: wall-clock of training with the "
                "held-out evaluations taken out. \"a ± b\": mean ± half-range over seeds.")
    before = [r["summary"].get("student_before") for r in results.values() if r["summary"]]
    if before:
        report.text(f"Student before RL: {100 * before[0]:.1f} % held-out.")
    summary = {key: summarise(r) for key, r in results.items()}

    def cell(objective, eta, field, scale=1.0, digits=3):
        return mean_spread([scale * summary[objective, eta, seed][field] for seed in range(seeds)], digits)

    for objective, title in OBJECTIVES.items():
        report.heading(title)
        report.table(["η", "accuracy (%)", "sampled reward", "staleness mean / max", "largest ratio",
                      "zero-grad tokens", "seconds", "AReaL (AIME24)"],
                     [[_label(eta), cell(objective, eta, "accuracy", 100), cell(objective, eta, "reward"),
                       f"{cell(objective, eta, 'staleness_mean')} / {cell(objective, eta, 'staleness_max')}",
                       cell(objective, eta, "ratio_max"), cell(objective, eta, "zero_grad"),
                       cell(objective, eta, "seconds"), AREAL[objective].get(eta, "–")] for eta in s.etas])
    failed = [f"{o} η={_label(e)} seed {seed}: {r['error']}" for (o, e, seed), r in results.items() if r["error"]]
    if failed:
        report.text("Runs that stopped with an error: " + "; ".join(failed))

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, objective in zip(axes, OBJECTIVES):
        for eta in s.etas:
            curves = [[r["rollout_accuracy"] for r in results[objective, eta, seed]["records"]
                       if "rollout_accuracy" in r] for seed in range(seeds)]
            length = min(len(c) for c in curves)
            if length:
                ax.plot(np.arange(1, length + 1), np.mean([c[:length] for c in curves], axis=0),
                        label=f"η = {_label(eta)}")
        ax.set_title(OBJECTIVES[objective], fontsize=10)
        ax.set_xlabel("learner step")
    axes[0].set_ylabel("sampled reward (mean over seeds)")
    axes[0].legend(fontsize=8)
    report.figure(fig, "reward.png", "The verifier's reward on the sampled answers during training")
    plt.close(fig)

    report.heading("Verdict")
    report.text(_verdict(summary, s, seeds))
    report.config("Settings of every run (configs/rl.yaml plus these overrides)",
                  {f"{o}, η={_label(e)}, seed={seed}": r["sets"] for (o, e, seed), r in results.items()})
    return report.write()


def _verdict(summary: dict, s: Settings, seeds: int) -> str:
    def accuracy(objective, eta):
        return np.array([summary[objective, eta, seed]["accuracy"] for seed in range(seeds)])

    stale = [eta for eta in s.etas if eta >= 4] or [max(s.etas)]
    parts = []
    drops = {}
    for objective in OBJECTIVES:
        base = accuracy(objective, 0)
        worst = min(stale, key=lambda eta: np.mean(accuracy(objective, eta)))
        drops[objective] = np.mean(base) - np.mean(accuracy(objective, worst))
        parts.append(f"{objective}: {100 * np.mean(base):.1f} % at η = 0, worst at η ≥ 4 "
                     f"{100 * np.mean(accuracy(objective, worst)):.1f} % (η = {_label(worst)}).")
    spread = max(np.ptp(accuracy(o, eta)) / 2 for o in OBJECTIVES for eta in s.etas)
    seen = max(summary[o, eta, seed]["staleness_max"] for o in OBJECTIVES for eta in s.etas for seed in range(seeds))
    if drops["ppo_clip"] > spread and drops["ppo_clip"] - drops["decoupled_ppo"] > spread:
        verdict = "reproduced: naive PPO loses more accuracy to staleness than decoupled PPO, beyond the seeds' spread"
    elif drops["ppo_clip"] - drops["decoupled_ppo"] > 0:
        verdict = "partly reproduced: decoupled PPO loses less, but within the seeds' spread"
    else:
        verdict = "not reproduced: naive PPO does not lose more to staleness than decoupled PPO here"
    return (f"Decoupled PPO tolerates staleness that breaks naive PPO (AReaL: naive 42.0 → 23.3 at η = 4, "
            f"decoupled 42.2 at η = 4): {' '.join(parts)} Largest half-range over seeds {100 * spread:.1f} points; "
            f"largest staleness any run saw: {seen:g}. Verdict: {verdict}.")
