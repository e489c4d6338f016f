"""Cross-tokenizer OPD: does distilling from a teacher of another tokenizer work as well as
from one of the student's own?

The teacher is the built-in character model (one token per character). Three arms, each
from a warm start of the same architecture and about the same accuracy (3.9 % and 4.3 %),
with the demo's settings (``forward_kl_topk``, fully asynchronous, η = 2):

* ``same_tokenizer``: the built-in student (the teacher's characters): plain OPD;
* ``cross_tokenizer``: ``builtin:student_bpe`` (64 byte-pair merges over the same
  characters): OPD through span alignment (:mod:`asyncopd_jax.teacher.cross_tokenizer`);
* ``byte_prefix``: the same byte-pair student, OPD on 8 of its ids at each position (the
  tokens that start the teacher's 4 likeliest next tokens, then its own top ids), each
  scored by the teacher's probability that the continuation starts with its text
  (``teacher.mapping: byte_prefix``, ``from_teacher: 4``,
  :mod:`asyncopd_jax.teacher.byte_prefix_teacher`);
* ``sft_teacher_samples``: the same byte-pair student, supervised on the teacher's own
  answers (sampled at temperature 1 to fresh training prompts each step, re-encoded in the
  student's tokens: sequence-level knowledge distillation), as many steps of as many
  answers as OPD takes.

Held-out accuracy (greedy) every ``eval_every`` steps; the verdict compares the arms'
final accuracies over seeds, and the report counts the tokens a batch of answers takes,
which shows how the byte-pair student writes its answers after each arm.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from asyncopd_jax.studies.report import Report, mean_spread, pyplot
from asyncopd_jax.studies.training_runs import DEMO, LEDGER_KEYS, run_trainings, sft_arm, steps_to, train
from asyncopd_jax.studies.training_runs import accuracy_curve as curve
from asyncopd_jax.studies.training_runs import final_accuracy as final
from asyncopd_jax.studies.training_runs import mean_accuracy as mean_curve
from asyncopd_jax.studies.verdicts import beats

KEYS = (*LEDGER_KEYS, "eval_accuracy", "tokens", "reverse_kl_signal", "entropy", "nonfinite_rows")
STUDENTS = {
    "same_tokenizer": "builtin:student",
    "cross_tokenizer": "builtin:student_bpe",
    "byte_prefix": "builtin:student_bpe",
}
#: An OPD arm's settings beyond the demo's and its student.
MAPPINGS = {"byte_prefix": ["teacher.mapping=byte_prefix", "sampling.student_topk=8", "teacher.from_teacher=4"]}
SFT_STUDENT = "builtin:student_bpe"
ARMS = ("same_tokenizer", "cross_tokenizer", "byte_prefix", "sft_teacher_samples")
WITHIN = 0.03  # the bar: cross-tokenizer OPD within 3 points of same-tokenizer OPD
LONG = "byte_prefix_2x"  # the byte_prefix arm, seed 0, at twice the steps


@dataclasses.dataclass(frozen=True)
class Settings:
    steps: int
    batch_size: int
    eval_every: int
    eval_prompts: int


FULL = Settings(steps=1200, batch_size=64, eval_every=200, eval_prompts=256)  # the demo's
QUICK = Settings(steps=6, batch_size=8, eval_every=3, eval_prompts=16)


def _opd_sets(arm: str, seed: int, s: Settings) -> list[str]:
    return [
        f"seed={seed}",
        f"student.path={STUDENTS[arm]}",
        f"train.steps={s.steps}",
        f"learner.batch_size={s.batch_size}",
        f"train.eval_every={s.eval_every}",
        f"train.checkpoint_every={10**6}",
        f"task.eval_prompts={s.eval_prompts}",
        *MAPPINGS.get(arm, []),
    ]


def _sft_sets(seed: int, s: Settings) -> list[str]:
    """The SFT arm's settings, in the ledger's ``--set`` form (read back by :func:`train_sft_arm`)."""
    return [
        f"seed={seed}",
        f"student.path={SFT_STUDENT}",
        f"train.steps={s.steps}",
        f"learner.batch_size={s.batch_size}",
        f"train.eval_every={s.eval_every}",
        f"task.eval_prompts={s.eval_prompts}",
        "sft=teacher_samples",
    ]


def train_sft_arm(work: Path, name: str, sets: list[str]) -> tuple[dict[str, Any], float]:
    """Train the SFT arm's run ``name`` (``sets`` from :func:`_sft_sets`): each step, the
    teacher answers ``batch_size`` fresh training prompts at temperature 1 in its own
    characters, and the student takes one optimizer step of negative log-likelihood on
    those answers in its own tokens (the demo's optimizer settings). Returns its ledger line
    and the seconds it took."""
    from flax import nnx

    from asyncopd_jax.config import load_config
    from asyncopd_jax.models import from_pretrained, load_tokenizer
    from asyncopd_jax.sampling import SamplingParams, make_sampler
    from asyncopd_jax.tasks.assets import resolve_model_path
    from asyncopd_jax.tasks.builtin import TaskData

    start = time.perf_counter()
    cfg = load_config(DEMO, [s for s in sets if not s.startswith("sft=")])  # the demo's teacher and optimizer
    student_dir, teacher_dir = resolve_model_path(cfg.student.path), resolve_model_path(cfg.teacher.path)
    student_task = TaskData(cfg.task, load_tokenizer(student_dir))
    teacher_task = TaskData(cfg.task, load_tokenizer(teacher_dir))
    teacher_graph, teacher_state = nnx.split(from_pretrained(teacher_dir))
    sampler = make_sampler(
        teacher_graph,
        SamplingParams(
            temperature=1.0,
            max_new_tokens=teacher_task.max_new_tokens,
            stop_token_ids=(teacher_task.eos_id,),
            chunk_steps=teacher_task.max_new_tokens,
        ),
        pad_id=teacher_task.pad_id,
    )
    rng, key = np.random.default_rng(cfg.seed), jax.random.key(cfg.seed)
    batch_size = cfg.learner.batch_size

    def batches():
        nonlocal key
        while True:
            prompts, problems = teacher_task.train_prompts(rng, batch_size)
            key, sample = jax.random.split(key)
            answers = sampler.generate(teacher_state, prompts, sample, prompt_slots=teacher_task.prompt_slots)
            yield student_task.answer_batch(
                problems, teacher_task.decode(answers), student_task.prompt_slots, student_task.max_new_tokens
            )

    teacher_accuracy = teacher_task.accuracy(teacher_graph, teacher_state)
    model = from_pretrained(student_dir)
    line = sft_arm(name, sets, model, batches(), cfg, student_task.accuracy, teacher_accuracy, {"tokens": "tokens"})
    return line, time.perf_counter() - start


def run(
    out_dir: str | Path,
    work_dir: str | Path,
    *,
    quick: bool = False,
    seeds: int = 3,
    jobs: int = 1,
    command: str = "asyncopd study cross_tokenizer",
) -> Path:
    s = QUICK if quick else FULL
    work, ledger = Path(work_dir) / "cross_tokenizer", Path(out_dir) / "cross_tokenizer" / "runs.jsonl"
    opd = {(arm, seed): (f"{arm}-s{seed}", _opd_sets(arm, seed, s)) for seed in range(seeds) for arm in STUDENTS}
    results = run_trainings(work, ledger, opd, jobs=jobs, train=functools.partial(train, keys=KEYS))
    sft = {("sft_teacher_samples", seed): (f"sft_teacher_samples-s{seed}", _sft_sets(seed, s)) for seed in range(seeds)}
    results.update(run_trainings(work, ledger, sft, jobs=jobs, train=train_sft_arm))
    # whether more steps close byte_prefix's gap: seed 0 at twice the steps
    longer = dataclasses.replace(s, steps=2 * s.steps, eval_every=2 * s.eval_every)
    long = {(LONG, 0): (f"{LONG}-s0", _opd_sets("byte_prefix", 0, longer))}
    results.update(run_trainings(work, ledger, long, jobs=jobs, train=functools.partial(train, keys=KEYS)))
    return _write_report(Path(out_dir), results, s, seeds, command)


def tokens_per_answer(result: dict, batch_size: int, first: bool) -> float:
    """Mean answer tokens of a run's first (or last) 5 batches (fewer in a shorter run), per answer."""
    values = [r["tokens"] for r in result["records"] if "tokens" in r]
    if not values:
        return np.nan
    n = max(1, min(5, len(values) // 4))
    return float(np.mean(values[:n] if first else values[-n:])) / batch_size


def peak_tokens(result: dict, batch_size: int, window: int = 10) -> tuple[int, float]:
    """(step, tokens per answer) where a run's answers are longest: the largest mean over
    ``window`` consecutive batches (NaN: no token counts)."""
    records = [r for r in result["records"] if "tokens" in r]
    if len(records) < window:
        return 0, np.nan
    means = np.convolve([r["tokens"] for r in records], np.ones(window) / window, mode="valid")
    at = int(np.argmax(means))
    return int(records[at + window // 2]["step"]), float(means[at]) / batch_size


def verdict(cross: np.ndarray, same: np.ndarray) -> str:
    """Whether cross-tokenizer OPD's mean final accuracy ends within :data:`WITHIN` of
    same-tokenizer OPD's, and by how much it is below or above it."""
    gap = float(np.mean(cross) - np.mean(same))
    within = "within" if abs(gap) <= WITHIN else "not within"
    side = "below" if gap < 0 else "above"
    return (
        f"{within} {WITHIN * 100:.0f} points: cross-tokenizer OPD ends {abs(gap) * 100:.1f} points {side} "
        "same-tokenizer OPD"
    )


def _why(results: dict, s: Settings, seeds: int) -> str:
    """What the curves and the token counts say about the gap between the OPD arms."""
    first_eval = {arm: mean_curve(results, arm, seeds)[1][0] * 100 for arm in STUDENTS}
    runs = [results["cross_tokenizer", seed] for seed in range(seeds)]
    start = np.mean([tokens_per_answer(r, s.batch_size, first=True) for r in runs])
    end = np.mean([tokens_per_answer(r, s.batch_size, first=False) for r in runs])
    soon = max(1, s.steps // 12)  # a twelfth of the run
    early = np.mean([np.mean([r["tokens"] for r in run["records"][:soon] if "tokens" in r][-5:]) for run in runs])
    half = {arm: steps_to(results, arm, seeds, 0.5) for arm in STUDENTS}
    return (
        "What the runs show. The byte-pair student's answers start at "
        f"{start:.1f} tokens (its own merges; the first 5 steps) and end at {end:.1f}, one character a token, as the "
        f"teacher writes them; by step {soon} they are at {early / s.batch_size:.1f} already. "
        "`forward_kl_topk` compares only tokens of exactly the same text, so the teacher's mass on a character "
        "meets the student's one-character token and the student's multi-character tokens are all in the tail "
        "bucket: distillation first teaches the student to write as the teacher cuts. At the first evaluation "
        f"(step {s.eval_every}) cross-tokenizer OPD is at {first_eval['cross_tokenizer']:.1f} % and same-tokenizer "
        f"OPD at {first_eval['same_tokenizer']:.1f} %; the mean reaches 50 % at step "
        f"{half['cross_tokenizer']:.0f} against {half['same_tokenizer']:.0f}: the gap at the end is the steps spent "
        "re-tokenising, as far as these runs show (the cosine schedule gives the later steps a smaller learning "
        "rate; whether more steps would close it, they do not test)."
    )


def _byte_prefix_note(results: dict, finals: dict, s: Settings, seeds: int) -> str:
    """What the ``byte_prefix`` arm's runs show, from their numbers: its gap to span
    alignment, how its answers are cut, where its curve trails same-tokenizer OPD's, and the
    rows the learner dropped as non-finite."""
    arms = ("cross_tokenizer", "byte_prefix")
    tokens = {arm: tokens_per_answer(results[arm, 0], s.batch_size, False) for arm in arms}
    gap = (np.mean(finals["cross_tokenizer"]) - np.mean(finals["byte_prefix"])) * 100
    curves = {arm: mean_curve(results, arm, seeds) for arm in ("same_tokenizer", "byte_prefix")}
    steps = curves["byte_prefix"][0]
    behind = {
        int(step): (curves["same_tokenizer"][1][i] - curves["byte_prefix"][1][i]) * 100 for i, step in enumerate(steps)
    }
    note = (
        f"What the `byte_prefix` runs show. It ends {abs(gap):.1f} points {'below' if gap > 0 else 'above'} span "
        f"alignment; its answers (seed 0, last 5 steps) take {tokens['byte_prefix']:.1f} tokens against span "
        f"alignment's {tokens['cross_tokenizer']:.1f}: it keeps writing with its own merges. What remains is a "
        "slower start, then a gap that closes slowly: the mean trails same-tokenizer OPD by "
        + ", ".join(f"{points:.1f} points at step {step}" for step, points in behind.items())
        + "."
    )
    runs = [results["byte_prefix", seed] for seed in range(seeds)]
    peaks = [peak_tokens(run, s.batch_size) for run in runs]
    first = np.mean([tokens_per_answer(run, s.batch_size, first=True) for run in runs])
    last = np.mean([tokens_per_answer(run, s.batch_size, first=False) for run in runs])
    note += (
        f" Its answers take {first:.1f} tokens (mean over seeds, first 5 steps), then "
        f"{np.mean([p[1] for p in peaks]):.1f} at their most (around step {np.median([p[0] for p in peaks]):.0f}), "
        f"then {last:.1f} (last 5 steps): the teacher's part of each position's ids is the student tokens that start "
        "its likeliest next *tokens*, one character each here, so the first steps move the student toward writing "
        "a character a token, and it then comes back to its merges — a detour same-tokenizer OPD does not make."
    )
    if (LONG, 0) in results and not results[LONG, 0]["error"]:
        steps2, accuracy2 = curve(results[LONG, 0])
        same = final(results, "same_tokenizer", seeds)
        note += (
            f" With twice the steps ({int(steps2[-1])}, seed 0, the cosine schedule stretched to them) it ends at "
            f"{accuracy2[-1] * 100:.1f} %, {abs(np.mean(same) - accuracy2[-1]) * 100:.1f} points "
            f"{'below' if accuracy2[-1] < np.mean(same) else 'above'} same-tokenizer OPD's mean at {s.steps}: "
            + (
                "the gap left at the study's length is steps."
                if abs(np.mean(same) - accuracy2[-1]) <= WITHIN
                else "more steps do not close it."
            )
        )
    else:
        note += " Whether more steps close the rest, these runs do not show."
    dropped = [
        [r["nonfinite_rows"] for r in results["byte_prefix", seed]["records"] if "nonfinite_rows" in r]
        for seed in range(seeds)
    ]
    if not all(dropped):
        return note + " The rows the learner dropped as non-finite were not recorded by these runs."
    mean = float(np.mean([np.mean(d) for d in dropped]))
    if mean < 0.5:
        return note + f" The learner dropped {mean:.2f} rows a batch as non-finite."
    return note + (
        f" **These runs lost {mean:.1f} of {s.batch_size} rows a batch, on average, to the learner's non-finite "
        "check** (a score of −inf in a per-token cache): their accuracy is what the rest taught, not what the "
        "mapping can."
    )


def _write_report(out_dir: Path, results: dict, s: Settings, seeds: int, command: str) -> Path:
    plt = pyplot()
    report = Report(out_dir, "cross_tokenizer", "Cross-tokenizer on-policy distillation", command)
    errors = [f"{arm} seed {seed}: {r['error']}" for (arm, seed), r in results.items() if r["error"]]
    before = {
        arm: [results[arm, seed]["summary"].get("student_before", np.nan) for seed in range(seeds)] for arm in ARMS
    }
    teacher = next(
        (r["summary"]["teacher_accuracy"] for r in results.values() if "teacher_accuracy" in r["summary"]), np.nan
    )
    finals = {arm: final(results, arm, seeds) for arm in ARMS}
    report.text(
        f"The teacher is the built-in character model ({teacher:.1%} held-out). Each arm trains "
        f"{s.steps} steps of {s.batch_size} answers, {seeds} seeds, with the demo's settings (`forward_kl_topk` "
        "on the teacher's top-8 with a tail bucket, fully asynchronous with η = 2, learning rate 3e-3 after 20 "
        "warm-up steps, cosine). `same_tokenizer` distils the built-in student, which shares the teacher's "
        "characters; `cross_tokenizer` distils `builtin:student_bpe`, the same architecture over 64 byte-pair "
        "merges of the same characters, through span alignment (each student token is a span here: every "
        "byte-pair boundary is a character boundary; the teacher's top-8 characters map to the student's "
        "one-character tokens, the rest of the student's mass is the tail); `byte_prefix` distils the same "
        "byte-pair student on 8 of its ids at each position, the tokens that start the teacher's 4 likeliest next "
        "tokens and then its own top ids, each given the teacher's probability that the continuation starts with "
        "its text (`teacher.mapping: byte_prefix`, `from_teacher: 4`); `sft_teacher_samples` trains the "
        "same byte-pair student on the teacher's own answers (temperature 1, fresh prompts each step) in its own "
        "tokens. Held-out accuracy: greedy, "
        f"{s.eval_prompts} problems, every {s.eval_every} steps."
    )
    if errors:
        report.text("Runs that failed: " + "; ".join(errors))
    report.heading("Verdict")
    report.text(f"**{verdict(finals['cross_tokenizer'], finals['same_tokenizer'])}** (mean ± half-range over seeds).")
    spread = {arm: float(np.ptp(finals[arm]) / 2) for arm in ("byte_prefix", "same_tokenizer")}
    report.text(
        f"With `byte_prefix`: **{verdict(finals['byte_prefix'], finals['same_tokenizer'])}**; its half-range "
        f"{spread['byte_prefix'] * 100:.1f} points against same-tokenizer's {spread['same_tokenizer'] * 100:.1f} "
        f"({'no wider than' if spread['byte_prefix'] <= 2 * spread['same_tokenizer'] else 'wider than'} twice it)."
    )
    report.text(_byte_prefix_note(results, finals, s, seeds))
    against_sft = (
        "beats"
        if beats(finals["cross_tokenizer"], finals["sft_teacher_samples"])
        else "loses to"
        if beats(finals["sft_teacher_samples"], finals["cross_tokenizer"])
        else "neither beats nor loses to"
    )
    report.text(
        f"Against SFT on the teacher's samples (the same student, steps and answers a step), cross-tokenizer OPD "
        f"{against_sft} it: {mean_spread(finals['cross_tokenizer'] * 100)} % against "
        f"{mean_spread(finals['sft_teacher_samples'] * 100)} % (one arm beats another when its mean is higher by "
        "more than either's half-range over seeds)."
    )
    report.text(_why(results, s, seeds))
    rows = []
    for arm in ARMS:
        rows.append(
            [
                arm,
                mean_spread(np.array(before[arm]) * 100),
                mean_spread(finals[arm] * 100),
                ", ".join(f"{v * 100:.1f}" for v in finals[arm]),
                f"{tokens_per_answer(results[arm, 0], s.batch_size, True):.1f} → "
                f"{tokens_per_answer(results[arm, 0], s.batch_size, False):.1f}"
                if arm != "sft_teacher_samples"
                else "(the teacher's answers)",
            ]
        )
    header = ["arm", "before (%)", "after (%)", "per seed (%)", "rollout tokens / answer, seed 0: first → last 5 steps"]
    report.table(header, rows)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, arm in enumerate(ARMS):
        for seed in range(seeds):
            steps, accuracy = curve(results[arm, seed])
            ax.plot(steps, accuracy * 100, color=f"C{i}", alpha=0.8, label=arm if seed == 0 else None)
    ax.axhline(teacher * 100, color="k", ls="--", lw=0.8, label="teacher")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out accuracy (%, greedy)")
    ax.legend()
    report.figure(fig, "accuracy.png", "Held-out accuracy against steps, each seed a line")
    plt.close(fig)
    table = []
    steps = curve(results["same_tokenizer", 0])[0]
    for i, step in enumerate(steps):
        cells = []
        for arm in ARMS:
            values = [curve(results[arm, seed])[1] for seed in range(seeds)]
            at = [v[i] * 100 for v in values if len(v) > i]
            cells.append(mean_spread(at) if at else "")
        table.append([int(step), *cells])
    report.table(["step", *ARMS], table)
    report.config("The runs' settings", {f"{arm}-s{seed}": results[arm, seed]["sets"] for arm, seed in results})
    return report.write()


__all__ = ["ARMS", "FULL", "QUICK", "Settings", "run", "train_sft_arm", "verdict"]
