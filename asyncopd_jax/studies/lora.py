"""LoRA students against full training: does a low-rank student learn the built-in task as far
and as fast by on-policy distillation, and what does each published version then ship?

"LoRA Without Regret" (Schulman et al., 2025) finds that in RL even rank 1 matches full
fine-tuning at about 10× its learning rate, and every OPD recipe of Tinker is LoRA only. This
study puts that to the built-in task, whose student starts at 3.9 % of the problems and must
learn most of the task (not a capable model's fine-tuning).

Arms: full training, and LoRA at ranks 16, 4 and 1 on the seven projections of every layer,
α = 32 at every rank (the paper's setting, under which the best learning rate barely moves
with the rank); then the same ranks training the tied embedding and every norm whole
beside the adapters (``student.lora.modules_to_save``, PEFT's setting of that name): on a
student of ~100k weights these are what the projections' adapters cannot reach, and rank
64 without them ended no better than rank 16 (docs/lora.md). Each arm's learning rate is
tuned on seed 0 over a grid (the highest final held-out accuracy), then seeds 1, 2, … run
at it. Every run is the demo
(``configs/demo.yaml``: fully asynchronous, η = 2, ``forward_kl_topk``, batch 64, cosine
schedule) for :attr:`Settings.steps` steps: 1.25× the demo's 1,200, so that a LoRA arm may
take the acceptance's 1.25× full training's steps.

Reported per arm: the final accuracy as a share of the teacher's, the steps to 90 % and to
94 % of the teacher (on the seeds' mean curve), and the bytes each published version shipped
(``snapshot_bytes`` in ``metrics.jsonl``: the adapters alone for a LoRA student).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import numpy as np

from asyncopd_jax.studies.report import Report, mean_spread, pyplot
from asyncopd_jax.studies.training_runs import (
    LEDGER_KEYS,
    final_accuracy,
    mean_accuracy,
    run_trainings,
    steps_to,
    train,
)

KEYS = (*LEDGER_KEYS, "eval_accuracy", "snapshot_bytes", "snapshot_base_bytes")


@dataclasses.dataclass(frozen=True)
class Arm:
    rank: int  # 0: full training
    modules_to_save: tuple[str, ...] = ()  # trained whole beside the adapters
    loraplus_lr_ratio: float = 1.0  # LoRA+: B learns at this multiple of the learning rate


SAVED = ("embed_tokens", ".*norm")  # the tied embedding (and head) and every norm
LORAPLUS = 16.0  # loraplus_lr_ratio: 2^4, the value axolotl's docs recommend for it
ARMS = {
    "full": Arm(0),
    "rank 16": Arm(16),
    "rank 4": Arm(4),
    "rank 1": Arm(1),
    "rank 16 + embedding, norms": Arm(16, SAVED),
    "rank 4 + embedding, norms": Arm(4, SAVED),
    "rank 1 + embedding, norms": Arm(1, SAVED),
    # LoRA+ at the ratio axolotl's docs recommend, on the best arm above (docs/lora.md)
    "rank 16 + embedding, norms, LoRA+ λ = 16": Arm(16, SAVED, LORAPLUS),
}
ALPHA = 32.0
TARGETS = (0.90, 0.94)  # shares of the teacher's accuracy
WITHIN = 1.25  # the acceptance: a rank reaches 94 % within 1.25× full training's steps to it


@dataclasses.dataclass(frozen=True)
class Settings:
    steps: int
    eval_every: int
    eval_prompts: int
    batch_size: int
    grid: dict[str, tuple[float, ...]]  # arm → learning rates tuned over (seed 0)


FULL = Settings(
    steps=1500,
    eval_every=100,
    eval_prompts=256,
    batch_size=64,
    grid={
        "full": (1.5e-3, 3e-3, 6e-3),  # the demo's 3e-3 and a factor 2 either side
        "rank 16": (5e-3, 1e-2, 2e-2),
        "rank 4": (5e-3, 1e-2, 2e-2),
        "rank 1": (5e-3, 1e-2, 2e-2),
        # whole weights beside the adapters: from near full training's best (3e-3) to the
        # adapters' grid (2e-2 added once 1e-2, the first grid's edge, was rank 16's best)
        "rank 16 + embedding, norms": (2.5e-3, 5e-3, 1e-2, 2e-2),
        "rank 4 + embedding, norms": (2.5e-3, 5e-3, 1e-2, 2e-2),
        "rank 1 + embedding, norms": (2.5e-3, 5e-3, 1e-2, 2e-2),
        # the rate of A and of the whole weights (B's: 16×), from the arm's best without LoRA+
        # (1e-2) down: LoRA+'s authors advise A about half plain LoRA's rate (their README)
        "rank 16 + embedding, norms, LoRA+ λ = 16": (2.5e-3, 5e-3, 1e-2),
    },
)
QUICK = Settings(
    steps=6,
    eval_every=3,
    eval_prompts=16,
    batch_size=8,
    grid={
        "full": (3e-3,),
        "rank 16": (1e-2,),
        "rank 4": (1e-2,),
        "rank 1": (5e-3, 1e-2),
        "rank 16 + embedding, norms": (5e-3,),
        "rank 4 + embedding, norms": (5e-3,),
        "rank 1 + embedding, norms": (5e-3,),
        "rank 16 + embedding, norms, LoRA+ λ = 16": (2.5e-3,),
    },
)


def _name(arm: str, learning_rate: float, seed: int) -> str:
    return f"{re.sub(r'[^a-z0-9]', '', arm.lower())}-lr{learning_rate:g}-s{seed}"


def _sets(arm: str, learning_rate: float, seed: int, s: Settings) -> list[str]:
    rank, saved, ratio = ARMS[arm].rank, ARMS[arm].modules_to_save, ARMS[arm].loraplus_lr_ratio
    lora = [f"student.lora.rank={rank}", f"student.lora.alpha={ALPHA}"] if rank else []
    if saved:
        lora.append(f"student.lora.modules_to_save=[{', '.join(repr(p) for p in saved)}]")
    if ratio != 1:
        lora.append(f"student.lora.loraplus_lr_ratio={ratio:g}")
    return [
        f"seed={seed}",
        *lora,
        f"optim.learning_rate={learning_rate}",
        f"learner.batch_size={s.batch_size}",
        f"train.steps={s.steps}",
        f"train.eval_every={s.eval_every}",
        f"train.checkpoint_every={10**6}",
        f"task.eval_prompts={s.eval_prompts}",
    ]


def run(
    out_dir: str | Path,
    work_dir: str | Path,
    *,
    quick: bool = False,
    seeds: int = 3,
    jobs: int = 1,
    command: str = "asyncopd study lora",
) -> Path:
    s = QUICK if quick else FULL
    work, ledger = Path(work_dir) / "lora", Path(out_dir) / "lora" / "runs.jsonl"
    trainer = functools.partial(train, keys=KEYS)
    grid = {(arm, lr): (_name(arm, lr, 0), _sets(arm, lr, 0, s)) for arm in ARMS for lr in s.grid[arm]}
    tuning = run_trainings(work, ledger, grid, jobs=jobs, train=trainer)
    tuned = {arm: max(s.grid[arm], key=functools.partial(_tuned_final, tuning, arm)) for arm in ARMS}
    results = {(arm, 0): tuning[arm, tuned[arm]] for arm in ARMS}
    more = {
        (arm, seed): (_name(arm, tuned[arm], seed), _sets(arm, tuned[arm], seed, s))
        for arm in ARMS
        for seed in range(1, seeds)
    }
    results.update(run_trainings(work, ledger, more, jobs=jobs, train=trainer))
    return _write_report(Path(out_dir), s, tuning, tuned, results, seeds, command)


def _tuned_final(tuning: dict, arm: str, learning_rate: float) -> float:
    return _final(tuning[arm, learning_rate])


def _final(result: dict) -> float:
    """A run's final held-out accuracy (−1: it failed), for tuning."""
    value = result["summary"].get("student_after")
    return -1.0 if result["error"] or value is None or not np.isfinite(value) else float(value)


def teacher_accuracy(results: dict) -> float:
    """The teacher's held-out accuracy (every run measures the same teacher on the same problems)."""
    values = [r["summary"].get("teacher_accuracy") for r in results.values()]
    return float(np.nanmean([v for v in values if v is not None] or [np.nan]))


def version_bytes(result: dict) -> tuple[float, float]:
    """(bytes a published version shipped, the base's bytes shipped once: 0 for a full
    student) from a run's ``metrics.jsonl``; NaN where no record holds them."""
    shipped = [r["snapshot_bytes"] for r in result["records"] if "snapshot_bytes" in r]
    base = [r["snapshot_base_bytes"] for r in result["records"] if "snapshot_base_bytes" in r]
    return (float(shipped[-1]) if shipped else np.nan), (float(base[-1]) if base else 0.0)


def acceptance(steps_to_94: dict[str, float]) -> tuple[str | None, str]:
    """The best LoRA arm (fewest steps to 94 % of the teacher) and whether it took at most
    :data:`WITHIN` × full training's steps to it, as a sentence."""
    lora = {arm: steps for arm, steps in steps_to_94.items() if arm != "full" and np.isfinite(steps)}
    full = steps_to_94["full"]
    if not lora:
        return None, "no LoRA arm reached 94 % of the teacher within the run: the acceptance does not hold"
    best = min(lora, key=lambda arm: lora[arm])
    if not np.isfinite(full):
        return best, f"{best} reached 94 % of the teacher at step {lora[best]:.0f}; full training never did"
    holds = lora[best] <= WITHIN * full
    return best, (
        f"{best} reached 94 % of the teacher at step {lora[best]:.0f}, {lora[best] / full:.2f}× full training's "
        f"{full:.0f} steps: the acceptance (at most {WITHIN}×) {'holds' if holds else 'does not hold'}"
    )


def _write_report(
    out_dir: Path, s: Settings, tuning: dict, tuned: dict[str, float], results: dict, seeds: int, command: str
) -> Path:
    report = Report(out_dir, "lora", "LoRA students against full training", command)
    teacher = teacher_accuracy(results)
    more = f"; seeds 1–{seeds - 1} run at it" if seeds > 1 else ""
    report.text(
        f"Each run distils the built-in task from the shipped student with the demo's settings "
        f"(`configs/demo.yaml`: fully asynchronous, η = 2, `forward_kl_topk`, batch {s.batch_size}, cosine "
        f"schedule) for {s.steps} steps, held-out accuracy ({s.eval_prompts} problems, greedy) every "
        f"{s.eval_every} steps. LoRA arms: adapters of rank r on the seven projections of every layer, "
        f"α = {ALPHA:g} at every rank; the base frozen, but for the tied embedding and every norm in the arms "
        "that train them whole beside the adapters (`student.lora.modules_to_save`). "
        "Each arm's learning rate is the best of its grid on seed "
        f"0 (final accuracy){more}. The teacher answers {100 * teacher:.1f} %. "
        '"a ± b": mean ± half-range over seeds.'
    )
    report.heading("Learning rates tried (seed 0)")
    rows = []
    for arm in ARMS:
        for lr in s.grid[arm]:
            result = tuning[arm, lr]
            final = 100 * _final(result) / teacher
            mark = "**" if lr == tuned[arm] else ""
            rows.append([arm, f"{mark}{lr:g}{mark}", f"{final:.1f}" if final >= 0 else result["error"]])
    report.table(["arm", "learning rate", "final, % of the teacher"], rows)
    report.heading("Each arm at its learning rate")
    reached = {target: {arm: steps_to(results, arm, seeds, target * teacher) for arm in ARMS} for target in TARGETS}
    full_bytes = version_bytes(results["full", 0])[0]
    rows = []
    for arm in ARMS:
        shipped, base = version_bytes(results[arm, 0])
        finals = 100 * final_accuracy(results, arm, seeds) / teacher
        rows.append(
            [
                arm,
                f"{tuned[arm]:g}",
                mean_spread(finals),
                *[_steps(reached[target][arm]) for target in TARGETS],
                f"{shipped:,.0f}" + (f" (+ {base:,.0f} once)" if base else ""),
                f"{100 * shipped / full_bytes:.1f} %",
            ]
        )
    report.table(
        [
            "arm",
            "learning rate",
            "final, % of the teacher",
            *[f"steps to {100 * t:.0f} % of the teacher" for t in TARGETS],
            "bytes per version",
            "of full training's",
        ],
        rows,
    )
    report.text(
        "Steps to a share of the teacher: the first held-out evaluation at which the seeds' mean accuracy "
        'reaches it ("–": never within the run). Bytes per version: what the weights channel shipped per '
        "published version (`snapshot_bytes`: in memory, the arrays copied); a LoRA student's base ships once."
    )
    _curves(report, results, seeds, teacher)
    failed = [f"{arm} seed {seed}: {r['error']}" for (arm, seed), r in results.items() if r["error"]]
    if failed:
        report.text("Runs that stopped with an error: " + "; ".join(failed))
    report.heading("Verdict")
    report.text(acceptance(reached[0.94])[1] + ".")
    report.config(
        "Settings of every run (asyncopd_jax/configs/demo.yaml plus these overrides)",
        {f"{arm}, seed={seed}": r["sets"] for (arm, seed), r in results.items()},
    )
    return report.write()


def _steps(steps: float) -> str:
    return f"{steps:.0f}" if np.isfinite(steps) else "–"


def _curves(report: Report, results: dict, seeds: int, teacher: float) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9.0, 4.0), layout="constrained")
    for arm in ARMS:
        steps, accuracy = mean_accuracy(results, arm, seeds)
        style = "--" if ARMS[arm].modules_to_save else "-"
        ax.plot(steps, 100 * accuracy / teacher, style, marker="o", markersize=3, label=arm)
    for target in TARGETS:
        ax.axhline(100 * target, color="grey", linewidth=0.6, linestyle=":")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out accuracy, % of the teacher")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))  # beside the curves, not over them
    report.figure(fig, "accuracy.png", f"Held-out accuracy, mean of {seeds} seed(s), each arm at its learning rate.")
