"""Multi-turn, tool-using OPD on the built-in tool task: what the calculator, overlapping tool
calls with decoding, and a second teacher of another habit do.

The models beyond the shipped ones are made first, by the same ``asyncopd sft`` commands a
user would run (kept under the work directory):

* ``teacher_steps``: the teacher trained on trajectories of two calls (the product, then
  the sum: ``task.tool_habit = steps``);
* ``teacher_none``: the teacher trained to write the answer at once, without the tool
  (``tool_habit = none``);
* ``student_none``: the student's warm start on those answers (40 steps, as
  ``builtin:student_tools`` is on one-call trajectories).

The arms, each with ``seeds`` seeds, with ``demo_tools``' settings (``forward_kl_topk``,
fully asynchronous with η = 2, 64 answers a step):

* ``multi_turn_opd``: ``builtin:student_tools`` from ``builtin:teacher_tools``;
* ``sft_teacher_trajectories``: the same student, supervised on the teacher's own
  multi-turn trajectories (sampled at temperature 1 with the calculator answering, fresh
  prompts each step, the observations as context), as many steps of as many answers;
* ``single_turn_no_tools``: ``student_none`` from ``teacher_none`` with ``task.tools =
  false`` (a call ends the answer): what distillation reaches where the tool is not there;
* ``sync`` and ``fully_async`` under a tool latency, ``fast`` (10 ms, fixed) and
  ``long_tailed`` (lognormal, median 50 ms, σ = 1.5), ``timed_steps`` each: steps a second
  over the run (one held-out evaluation, at the end), and the accuracy;
* ``two_teachers``: ``teacher_tools`` (one call) and ``teacher_steps`` (two), each scoring
  half of the prompts: the student's tool calls per answer on each teacher's rows over
  training, against each teacher's own rate.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import Any

import numpy as np

from asyncopd_jax import configs
from asyncopd_jax.studies.report import Report, mean_spread, pyplot
from asyncopd_jax.studies.training_runs import LEDGER_KEYS, run_trainings, sft_arm, train
from asyncopd_jax.studies.verdicts import beats

DEMO_TOOLS = configs.bundled("demo_tools")
TEACHERS = ("whole", "steps")  # the two teachers' names in the two-teacher arm
KEYS = (
    *LEDGER_KEYS,
    "eval_accuracy",
    "time",
    "tool_calls_per_answer",
    "tool_errors_per_answer",
    "environment_s",
    *(f"teacher/{name}/tool_calls_per_answer" for name in TEACHERS),
)
#: tool latencies of the schedule arms: name → environment settings
LATENCIES = {
    "fast": ["environment.latency_s=0.01", "environment.latency_law=fixed"],
    "long_tailed": ["environment.latency_s=0.05", "environment.latency_law=lognormal", "environment.latency_sigma=1.5"],
}
SCHEDULES = ("sync", "fully_async")
QUALITY = ("multi_turn_opd", "sft_teacher_trajectories", "single_turn_no_tools")


@dataclasses.dataclass(frozen=True)
class Settings:
    steps: int
    batch_size: int
    eval_every: int
    eval_prompts: int
    timed_steps: int  # steps of the sync / fully async arms (what they measure is steps a second)
    teacher_sft_steps: int  # asyncopd sft steps of the teachers the study makes
    student_sft_steps: int  # and of the student's warm start


FULL = Settings(
    steps=200,
    batch_size=64,
    eval_every=50,
    eval_prompts=256,
    timed_steps=100,
    teacher_sft_steps=400,
    student_sft_steps=40,
)
QUICK = Settings(
    steps=4, batch_size=8, eval_every=2, eval_prompts=16, timed_steps=4, teacher_sft_steps=2, student_sft_steps=2
)


# --- the models the study makes ------------------------------------------------------------------


def tool_figures(path: str | Path, tools: bool = True) -> tuple[float, float]:
    """``(held-out accuracy, tool calls per answer)`` of the model at ``path`` (greedy,
    multi-turn with the calculator; single-turn without ``tools``)."""
    from flax import nnx

    from asyncopd_jax.config import TaskConfig
    from asyncopd_jax.models import from_pretrained, load_tokenizer
    from asyncopd_jax.tasks.assets import resolve_model_path
    from asyncopd_jax.tasks.tool_task import ToolTaskData

    directory = resolve_model_path(str(path))
    task = ToolTaskData(TaskConfig(name="tools", tools=tools), load_tokenizer(directory))
    graphdef, params = nnx.split(from_pretrained(directory))
    batch = task.rollout(graphdef, params, task.eval_items, temperature=0.0, seed=0)
    calls = float(np.mean(np.asarray(batch.tool_calls))) if batch.tool_calls is not None else 0.0
    return float(np.mean(task.rewards(task.eval_items, batch))), calls


def made_models(work: Path, s: Settings) -> dict[str, Path]:
    """``teacher_steps``, ``teacher_none`` and ``student_none`` (module docstring), each
    made by ``asyncopd sft`` under ``work/models`` unless it is there already."""
    from asyncopd_jax.cli import main

    wanted = {
        "teacher_steps": ("teacher", "steps", s.teacher_sft_steps),
        "teacher_none": ("teacher", "none", s.teacher_sft_steps),
        "student_none": ("student", "none", s.student_sft_steps),
    }
    out = {}
    for name, (size, habit, steps) in wanted.items():
        path = work / "models" / f"{name}-{steps}"
        if not (path / "config.json").is_file():
            argv = ["sft", "--model", size, "--tokenizer", "tools", "--task", "name=tools"]
            argv += ["--task", f"tool_habit={habit}", "--steps", str(steps), "--out", str(path)]
            if main(argv) != 0:
                raise RuntimeError(f"asyncopd {' '.join(argv)} failed")
        out[name] = path
    return out


# --- the arms' settings --------------------------------------------------------------------------


def _common(seed: int, s: Settings, timed: bool = False) -> list[str]:
    """Every arm's settings; a timed arm runs ``timed_steps`` with one evaluation, at the end."""
    steps = s.timed_steps if timed else s.steps
    return [
        f"seed={seed}",
        f"train.steps={steps}",
        f"learner.batch_size={s.batch_size}",
        f"train.eval_every={steps if timed else s.eval_every}",
        f"train.checkpoint_every={10**6}",
        f"task.eval_prompts={s.eval_prompts}",
    ]


def arm_sets(arm: str, seed: int, s: Settings, models: dict[str, Path]) -> list[str]:
    """The ``--set`` overrides of ``arm`` (a name of :func:`arms`) at ``seed``."""
    if arm == "multi_turn_opd":
        return _common(seed, s)
    if arm == "single_turn_no_tools":
        paths = [f"student.path={models['student_none']}", f"teacher.path={models['teacher_none']}"]
        return [*_common(seed, s), "task.tools=false", *paths]
    if arm == "two_teachers":
        teachers = (
            f"teachers=[{{name: {TEACHERS[0]}, path: 'builtin:teacher_tools'}}, "
            f"{{name: {TEACHERS[1]}, path: '{models['teacher_steps']}'}}]"
        )
        return [*_common(seed, s), "teacher.path=''", teachers]
    schedule, latency = arm.split("-")
    return [*_common(seed, s, timed=True), f"schedule.mode={schedule}", *LATENCIES[latency]]


def timed_arms() -> list[str]:
    """The sync and fully async arms under each tool latency (``schedule-latency``): what
    they measure is steps a second, so they train one at a time, alone."""
    return [f"{schedule}-{latency}" for latency in LATENCIES for schedule in SCHEDULES]


def arms() -> list[str]:
    """The OPD arms, trained by the pipeline (the SFT arm apart)."""
    return ["multi_turn_opd", "single_turn_no_tools", "two_teachers", *timed_arms()]


def sft_sets(seed: int, s: Settings) -> list[str]:
    """The SFT arm's settings, in the ledger's ``--set`` form (read by :func:`train_sft_arm`)."""
    return [*_common(seed, s), "sft=teacher_trajectories"]


def train_sft_arm(work: Path, name: str, sets: list[str]) -> tuple[dict[str, Any], float]:
    """The SFT arm's run ``name``: each step the teacher answers ``batch_size`` fresh
    training problems at temperature 1, multi-turn, with the calculator answering; the
    student takes one optimizer step of negative log-likelihood on its turns, the
    observations as context (``demo_tools``' optimizer). Returns its ledger line and the
    seconds it took."""
    from flax import nnx

    from asyncopd_jax.config import load_config
    from asyncopd_jax.models import from_pretrained, load_tokenizer
    from asyncopd_jax.tasks.assets import resolve_model_path
    from asyncopd_jax.tasks.tool_task import ToolTaskData

    start = time.perf_counter()
    cfg = load_config(DEMO_TOOLS, [s for s in sets if not s.startswith("sft=")])
    student_dir, teacher_dir = resolve_model_path(cfg.student.path), resolve_model_path(cfg.teacher.path)
    task = ToolTaskData(cfg.task, load_tokenizer(student_dir))
    teacher_graph, teacher_state = nnx.split(from_pretrained(teacher_dir))
    rng, steps = np.random.default_rng(cfg.seed), cfg.train.steps

    def batches():
        for step in range(steps):
            _, problems = task.train_prompts(rng, cfg.learner.batch_size)
            yield task.rollout(teacher_graph, teacher_state, problems, temperature=1.0, seed=cfg.seed * 100_003 + step)

    teacher_accuracy = task.accuracy(teacher_graph, teacher_state)
    line = sft_arm(
        name, sets, from_pretrained(student_dir), batches(), cfg, task.accuracy, teacher_accuracy, {"time": "seconds"}
    )
    return line, time.perf_counter() - start


def run(
    out_dir: str | Path,
    work_dir: str | Path,
    *,
    quick: bool = False,
    seeds: int = 3,
    jobs: int = 1,
    command: str = "asyncopd study multi_turn",
) -> Path:
    s = QUICK if quick else FULL
    work, ledger = Path(work_dir) / "multi_turn", Path(out_dir) / "multi_turn" / "runs.jsonl"
    models = made_models(work, s)
    teachers = {
        "teacher_tools": tool_figures("builtin:teacher_tools"),
        "teacher_steps": tool_figures(models["teacher_steps"]),
        "teacher_none": tool_figures(models["teacher_none"], tools=False),
    }
    step = functools.partial(train, base=DEMO_TOOLS, keys=KEYS)
    runs = {(arm, seed): (f"{arm}-s{seed}", arm_sets(arm, seed, s, models)) for seed in range(seeds) for arm in arms()}
    # the timed arms one at a time, alone on the machine: their figure is steps a second
    timed = {key: run for key, run in runs.items() if key[0] in timed_arms()}
    results = run_trainings(work, ledger, {k: v for k, v in runs.items() if k not in timed}, jobs=jobs, train=step)
    results.update(run_trainings(work, ledger, timed, jobs=1, train=step))
    sft = {
        ("sft_teacher_trajectories", seed): (f"sft_teacher_trajectories-s{seed}", sft_sets(seed, s))
        for seed in range(seeds)
    }
    results.update(run_trainings(work, ledger, sft, jobs=jobs, train=train_sft_arm))
    return _write_report(Path(out_dir), results, models, teachers, s, seeds, command)


# --- reading the runs ----------------------------------------------------------------------------


def final(results: dict, arm: str, seeds: int) -> np.ndarray:
    """Each seed's final held-out accuracy of ``arm``."""
    return np.array([results[arm, seed]["summary"].get("student_after", np.nan) for seed in range(seeds)], float)


def steps_per_second(result: dict) -> float:
    """Optimizer steps a second between a run's first and last step (its records' ``time``:
    seconds since the run started; the first step's compile left out)."""
    times = [r["time"] for r in result["records"] if "time" in r]
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else np.nan


def speed_up(results: dict, latency: str, seeds: int) -> tuple[float, np.ndarray, np.ndarray]:
    """``(fully async ÷ sync steps a second, [seeds] sync's, [seeds] fully async's)`` under ``latency``."""
    rates = {
        schedule: np.array([steps_per_second(results[f"{schedule}-{latency}", seed]) for seed in range(seeds)])
        for schedule in SCHEDULES
    }
    return float(np.mean(rates["fully_async"]) / np.mean(rates["sync"])), rates["sync"], rates["fully_async"]


def eval_curve(result: dict) -> dict[int, float]:
    """A run's held-out accuracy at each evaluation step."""
    return {int(r["step"]): r["eval_accuracy"] for r in result["records"] if "eval_accuracy" in r}


def window(result: dict, key: str, first: bool, n: int = 10) -> float:
    """The mean of ``key`` over a run's first (or last) ``n`` records that hold it."""
    values = [r[key] for r in result["records"] if key in r]
    return float(np.mean(values[:n] if first else values[-n:])) if values else np.nan


def calls_by_teacher(results: dict, seeds: int, first: bool) -> dict[str, float]:
    """The student's tool calls per answer on each teacher's rows, first or last 10 steps,
    mean over seeds."""
    return {
        name: float(
            np.mean(
                [
                    window(results["two_teachers", seed], f"teacher/{name}/tool_calls_per_answer", first)
                    for seed in range(seeds)
                ]
            )
        )
        for name in TEACHERS
    }


def quality_verdict(finals: dict[str, np.ndarray]) -> str:
    """How multi-turn OPD's final accuracy compares with each other quality arm's."""
    parts = []
    for other in QUALITY[1:]:
        a, b = finals["multi_turn_opd"], finals[other]
        word = "beats" if beats(a, b) else "loses to" if beats(b, a) else "neither beats nor loses to"
        parts.append(f"multi-turn OPD {word} `{other}` ({mean_spread(a * 100)} % against {mean_spread(b * 100)} %)")
    return "; ".join(parts)


def _write_report(
    out_dir: Path,
    results: dict,
    models: dict[str, Path],
    teachers: dict[str, tuple[float, float]],
    s: Settings,
    seeds: int,
    command: str,
) -> Path:
    plt = pyplot()
    report = Report(out_dir, "multi_turn", "Multi-turn, tool-using on-policy distillation", command)
    errors = [f"{arm} seed {seed}: {r['error']}" for (arm, seed), r in results.items() if r["error"]]
    report.text(
        f"The tool task (a·b + c, operands 10–99; the calculator gives the exact value). Every arm trains {s.steps} "
        f"steps of {s.batch_size} answers, {seeds} seeds, with `demo_tools`' settings (`forward_kl_topk` on the "
        "teacher's top-8, fully asynchronous with η = 2 unless the arm says otherwise). Held-out accuracy: greedy, "
        f"multi-turn with the calculator, {s.eval_prompts} problems. `teacher_steps` and `teacher_none` were made "
        f"by `asyncopd sft` at {s.teacher_sft_steps} steps, `student_none` at {s.student_sft_steps} (the study's "
        "first step; the commands are in the module's docstring). The teachers, greedy on the 256 held-out problems:"
    )
    report.table(
        ["teacher", "habit", "held-out (%)", "tool calls / answer"],
        [
            [name, habit, f"{teachers[name][0] * 100:.1f}", f"{teachers[name][1]:.2f}"]
            for name, habit in (
                ("teacher_tools", "one call"),
                ("teacher_steps", "two calls"),
                ("teacher_none", "no tool"),
            )
        ],
    )
    if errors:
        report.text("Runs that failed: " + "; ".join(errors))
    report.heading("What the tool and on-policy distillation give")
    finals = {arm: final(results, arm, seeds) for arm in QUALITY}
    report.text(
        f"**{quality_verdict(finals)}** (one arm beats another when its mean is higher by more than either's "
        "half-range over seeds)."
    )
    rows = []
    for arm in QUALITY:
        before = [results[arm, seed]["summary"].get("student_before", np.nan) for seed in range(seeds)]
        rows.append(
            [
                arm,
                mean_spread(np.array(before) * 100),
                mean_spread(finals[arm] * 100),
                ", ".join(f"{v * 100:.1f}" for v in finals[arm]),
            ]
        )
    report.table(["arm", "before (%)", "after (%)", "per seed (%)"], rows)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, arm in enumerate(QUALITY):
        for seed in range(seeds):
            points = [(r["step"], r["eval_accuracy"]) for r in results[arm, seed]["records"] if "eval_accuracy" in r]
            ax.plot(
                [p[0] for p in points], [p[1] * 100 for p in points], color=f"C{i}", label=arm if seed == 0 else None
            )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("held-out accuracy (%, greedy)")
    ax.legend()
    report.figure(fig, "accuracy.png", "Held-out accuracy against steps, each seed a line")
    plt.close(fig)
    report.text("Held-out accuracy (%) at each evaluation, mean ± half-range over seeds:")
    shown = (*QUALITY, "two_teachers")
    curves = {arm: [eval_curve(results[arm, seed]) for seed in range(seeds)] for arm in shown}
    steps = sorted({step for arm in shown for curve in curves[arm] for step in curve})
    report.table(
        ["step", *shown],
        [
            [step, *(mean_spread(np.array([c[step] for c in curves[arm] if step in c]) * 100) for arm in shown)]
            for step in steps
        ],
    )

    report.heading("Sync against fully async, with a tool that takes time")
    rows = []
    for latency, sets in LATENCIES.items():
        ratio, sync, fully = speed_up(results, latency, seeds)
        accuracy = {sch: final(results, f"{sch}-{latency}", seeds) for sch in SCHEDULES}
        tool_s = np.mean(
            [window(results[f"fully_async-{latency}", seed], "environment_s", False) for seed in range(seeds)]
        )
        rows.append(
            [
                latency,
                " ".join(x.split(".", 1)[1] for x in sets),
                mean_spread(sync, 3),
                mean_spread(fully, 3),
                f"**{ratio:.2f}×**",
                mean_spread(accuracy["sync"] * 100),
                mean_spread(accuracy["fully_async"] * 100),
                f"{tool_s:.2f}",
            ]
        )
    report.table(
        [
            "latency",
            "settings",
            "sync steps/s",
            "fully async steps/s",
            "speed-up",
            "sync after (%)",
            "fully async after (%)",
            "tool s a batch (summed)",
        ],
        rows,
    )
    report.text(
        "Steps a second are measured between each run's first and last step (the first step's compile left out; "
        "one held-out evaluation, after the last). In both schedules the continuous engine overlaps a parked "
        "answer's tool call with the other answers' decoding; what fully async adds is that rollout does not wait "
        f"for the learner, nor the learner for a batch's slowest call. At {s.timed_steps} steps neither schedule's "
        "student has learned the task yet (the shorter cosine schedule; the 200-step arms above cross over between "
        "steps 100 and 150): these arms measure speed, not accuracy."
    )

    report.heading("Two teachers of different habits")
    early, late = calls_by_teacher(results, seeds, True), calls_by_teacher(results, seeds, False)
    overall = [window(results["two_teachers", seed], "tool_calls_per_answer", False) for seed in range(seeds)]
    own = {TEACHERS[0]: teachers["teacher_tools"][1], TEACHERS[1]: teachers["teacher_steps"][1]}
    report.table(
        ["teacher's rows", "the teacher's own calls / answer", "student, first 10 steps", "student, last 10 steps"],
        [[name, f"{own[name]:.2f}", f"{early[name]:.2f}", f"{late[name]:.2f}"] for name in TEACHERS],
    )
    gap = late[TEACHERS[1]] - late[TEACHERS[0]]
    report.text(
        f"Over all rows the student ends at {mean_spread(np.array(overall), 2)} calls an answer; an even mixture of "
        f"the two teachers' own rates is {(own[TEACHERS[0]] + own[TEACHERS[1]]) / 2:.2f}. Both teachers score "
        "answers to the same prompts, so the student has nothing to tell them apart by: on the two teachers' rows it "
        f"ends {abs(gap):.3f} calls an answer apart. Final held-out accuracy: "
        f"{mean_spread(final(results, 'two_teachers', seeds) * 100)} %."
    )
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    for i, name in enumerate(TEACHERS):
        key = f"teacher/{name}/tool_calls_per_answer"
        for seed in range(seeds):
            points = [(r["step"], r[key]) for r in results["two_teachers", seed]["records"] if key in r]
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                color=f"C{i}",
                alpha=0.7,
                label=f"on {name}'s rows" if seed == 0 else None,
            )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("tool calls per answer")
    ax.legend()
    report.figure(fig, "calls.png", "The student's tool calls per answer on each teacher's rows, each seed a line")
    plt.close(fig)
    report.config("The runs' settings", {f"{arm}-s{seed}": results[arm, seed]["sets"] for arm, seed in results})
    report.config("The models the study made", {name: str(path) for name, path in models.items()})
    return report.write()


__all__ = [
    "FULL",
    "QUICK",
    "Settings",
    "arm_sets",
    "arms",
    "timed_arms",
    "made_models",
    "run",
    "speed_up",
    "train_sft_arm",
]
