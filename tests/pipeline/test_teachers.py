"""Several teachers in a run, and a teacher-only prompt, through the whole pipeline.

Teacher ``b`` is the student's own starting weights (``builtin:student``): on the first
batch, sampled by those weights, the behaviour policy's KL to ``b`` is 0 on every row ``b``
scores and clearly not on the rows the real teacher ``a`` scores. A row scored by the other
teacher, or not under its route, would show in ``teacher/NAME/kl`` at step 1."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from asyncopd_jax.config import load_config
from asyncopd_jax.models import from_pretrained
from asyncopd_jax.pipeline.run_models import run_models
from asyncopd_jax.pipeline.trainer import Trainer
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.teacher.batch_scorer import BatchScorer
from tests.teacher.test_server import SETTINGS, running
from tests.waits import SHORT_WAIT_SETS

STEPS = 3


def _run(tmp_path, name: str, *sets: str) -> tuple[dict, list[dict]]:
    cfg = load_config(
        "demo",
        [
            f"output_dir={tmp_path}",
            f"name={name}",
            f"train.steps={STEPS}",
            "train.eval_every=1000",
            "train.checkpoint_every=1000",
            "task.eval_prompts=16",
            "learner.batch_size=32",
            "schedule.mode=sync",
            *SHORT_WAIT_SETS,
            *sets,
        ],
    )
    summary = Trainer(cfg, progress=False).run()
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def _two_teachers(b: str) -> list[str]:
    return ["teacher.path=''", f"teachers=[{{name: a, path: 'builtin:teacher', weight: 2}}, {b}]", "seed=3"]


def _check_routed(summary: dict, records: list[dict]) -> list[tuple[float, float]]:
    """Each step's rows split between a and b (returned); a's and b's KL on step 1's rows."""
    rows = [(r["teacher/a/rows"], r["teacher/b/rows"]) for r in records]
    assert all(a + b == 32 for a, b in rows) and sum(b for _, b in rows) > 0 and sum(a for a, _ in rows) > 0, rows
    first = records[0]
    assert abs(first["teacher/b/kl"]) < 1e-3, first  # b is the student that sampled step 1's batch
    assert first["teacher/a/kl"] > 0.05, first
    assert summary["teacher_accuracy/a"] > 0.9 and "teacher_accuracy" not in summary
    return rows


@pytest.mark.e2e  # a whole run (3 steps) beside a server: the end-to-end step (-m e2e)
def test_two_teachers_one_in_process_one_served_each_score_their_own_rows(tmp_path):
    """``a`` in-process, ``b`` behind ``asyncopd serve-teacher`` (in a thread): local and served mixed."""
    student = from_pretrained(resolve_model_path("builtin:student"))
    settings = dataclasses.replace(SETTINGS, queue_rows=64)  # room for every request in flight: no 503 to wait out
    with running(BatchScorer(student, settings), settings) as (url, _, _):
        summary, records = _run(
            tmp_path, "mixed", *_two_teachers(f"{{name: b, server: {{url: '{url}', api: asyncopd}}}}")
        )
    rows = _check_routed(summary, records)
    assert "teacher_accuracy/b" not in summary  # a served teacher's accuracy is not measured here
    for r, (a, b) in zip(records, rows):
        assert r["teacher/a/requests"] == (a > 0) and r["teacher/b/requests"] >= (b > 0), r  # one call; b: 8 rows each
        assert "teacher/a/wait_s" not in r and r["teacher/b/wait_s"] == 0.0 and r["teacher_wait_s"] == 0.0
    assert all(r["teacher/b/score_s"] > 0 for r, (_, b) in zip(records, rows) if b)


@pytest.mark.e2e  # two whole runs (3 steps), one beside a server: the end-to-end step (-m e2e)
def test_two_hidden_state_teachers_one_served_train_as_both_in_process(tmp_path):
    """The exact dense KL from two teachers' hidden states, ``a`` (width 128) in-process and
    ``b`` (the student, width 64) behind ``serve-teacher``, its head fetched from the server
    (``GET /v1/head``, digest checked): each step's loss and rows are those of the same run
    with ``b`` in-process, so the served hidden states reach the learner with b's own head."""
    dense = ["estimator.name=forward_kl_dense", "scoring.payload=hidden", "scoring.hidden_dtype=bfloat16"]
    student = from_pretrained(resolve_model_path("builtin:student"))
    settings = dataclasses.replace(SETTINGS, queue_rows=64)
    with running(BatchScorer(student, settings), settings) as (url, _, _):
        served = f"{{name: b, server: {{url: '{url}', api: asyncopd}}}}"
        summary, records = _run(tmp_path, "served", *_two_teachers(served), *dense)
    local_summary, local = _run(tmp_path, "local", *_two_teachers("{name: b, path: 'builtin:student'}"), *dense)
    assert _check_routed(summary, records) == _check_routed(local_summary, local)
    assert all(r["teacher/b/requests"] >= 1 for r in records if r["teacher/b/rows"])
    # the same rollouts, scored in another batch shape (float32 rounding, then bfloat16)
    np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in local], rtol=2e-3)
    assert records[0]["loss"] > 0.05


@pytest.mark.e2e  # stage processes start in ~1 min: the end-to-end step (-m e2e)
def test_two_teachers_route_the_same_rows_in_stage_processes(tmp_path):
    """Both in-process, the stages in processes: the same group routes the same way as in
    threads (the route is drawn where the prompts are, and travels in the spool record)."""
    sets = _two_teachers("{name: b, path: 'builtin:student'}")
    threads = _check_routed(*_run(tmp_path, "threads", *sets))
    summary, records = _run(tmp_path, "processes", *sets, "stages.placement=processes")
    assert _check_routed(summary, records) == threads
    assert summary["teacher_accuracy/b"] < summary["teacher_accuracy/a"]


@pytest.mark.e2e  # three whole runs: the end-to-end step (-m e2e)
def test_a_teacher_prompt_is_what_the_teacher_scores_under(tmp_path):
    """``{prompt}`` renders the student's own prompt: the same scores as no template. One
    more token before it (``+{prompt}``) moves every score: the template reaches the teacher."""
    _, plain = _run(tmp_path, "plain", "learner.batch_size=16")
    _, same = _run(tmp_path, "same", "learner.batch_size=16", "teacher.prompt.template='{prompt}'")
    _, other = _run(tmp_path, "other", "learner.batch_size=16", "teacher.prompt.template='+{prompt}'")
    kl = [[r["teacher/teacher/kl"] for r in run] for run in (plain, same, other)]
    np.testing.assert_allclose(kl[1], kl[0], rtol=1e-5)
    assert abs(other[0]["teacher/teacher/kl"] - plain[0]["teacher/teacher/kl"]) > 1e-3, kl


def test_a_dataset_field_routes_each_row_and_a_row_naming_no_teacher_is_refused(tmp_path):
    rows = [{"prompt": f"Q:{i}+{i + 1}=", "answer": str(2 * i + 1), "teacher_id": "ab"[i % 2]} for i in range(40)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [
        "task.name=dataset",
        f"task.path={data}",
        "task.eval_fraction=0",
        "routing.by=field",
        *_two_teachers("{name: b, path: 'builtin:student'}"),
    ]
    models = run_models(load_config("demo", sets))
    task = models.task
    prompts, items = task.train_prompts(np.random.default_rng(0), 12)
    route = models.router.route(items, prompts, np.random.default_rng(0))
    assert route.teacher.tolist() == [int(e.fields["teacher_id"] == "b") for e in items]
    rows[7]["teacher_id"] = "c"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=rf"^{data}: row 8: teacher_id = 'c' names no teacher; allowed: a, b$"):
        run_models(load_config("demo", sets))


def test_a_mixture_of_experts_student_is_refused_in_one_line(tmp_path):
    """The learner has no router load-balancing loss yet: a Qwen3-MoE student is refused in
    one line naming it, before any weights are read."""
    from asyncopd_jax.models import DecoderConfig

    moe = tmp_path / "moe"
    moe.mkdir()
    config = DecoderConfig(
        "qwen3_moe", 61, 16, 24, 1, 2, 1, 8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8
    )
    (moe / "config.json").write_text(json.dumps(config.to_hf_dict()))
    with pytest.raises(ValueError, match=rf"^student.path = '{moe}' is a mixture-of-experts model \(qwen3_moe\)"):
        run_models(load_config("demo", [f"student.path={moe}"]))


@pytest.mark.e2e  # two whole runs (3 steps), one beside a server: the end-to-end step (-m e2e)
def test_a_served_byte_prefix_teacher_trains_as_the_in_process_one(tmp_path):
    """``teacher.mapping: byte_prefix`` of the character teacher for the byte-pair student,
    4 of whose 8 ids a position come from the teacher: behind ``serve-teacher`` (its trees
    asked through ``POST /v1/byte_prefix``, two requests a batch) each step's loss is the
    in-process teacher's."""
    from asyncopd_jax.teacher.server import prefix_trees

    sets = [
        "student.path=builtin:student_bpe",
        "teacher.mapping=byte_prefix",
        "sampling.student_topk=8",
        "teacher.from_teacher=4",
        "seed=5",
    ]
    teacher = from_pretrained(resolve_model_path("builtin:teacher"))
    settings = dataclasses.replace(SETTINGS, queue_rows=64)
    with running(BatchScorer(teacher, settings), settings, prefix_trees(teacher, "builtin:teacher", 1.0)) as (url, *_):
        server = [f"teacher.server.url={url}", "teacher.server.api=asyncopd", "teacher.tokenizer=builtin:teacher"]
        _, served = _run(tmp_path, "served", *sets, "teacher.path=''", *server)
    _, local = _run(tmp_path, "local", *sets)
    np.testing.assert_allclose([r["loss"] for r in served], [r["loss"] for r in local], rtol=1e-5)
    # 32 answers, 8 a request (the server's limit): 4 requests for the teacher's likeliest ids, 4 for the prefixes
    assert served[0]["loss"] > 0.05 and [r["teacher/teacher/requests"] for r in served] == [8] * STEPS
    assert all(r["nonfinite_rows"] == 0 for r in served)
