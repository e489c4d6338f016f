"""A run whose teacher has another tokenizer than the student's: the byte-pair student
(``builtin:student_bpe``) distilled from the character teacher, in-process, behind
``asyncopd serve-teacher``, and in stage processes; what such a run refuses at start-up."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from asyncopd_jax.config import load_config
from asyncopd_jax.models import from_pretrained
from asyncopd_jax.pipeline.run_models import run_models
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.tasks.tokenizer import build_tokenizer
from asyncopd_jax.teacher.batch_scorer import BatchScorer
from tests.pipeline.test_teachers import _run as run_demo
from tests.teacher.test_server import SETTINGS, running

CROSS = ["student.path=builtin:student_bpe"]


def test_the_teacher_is_prompted_in_its_own_tokens():
    models = run_models(load_config("demo", CROSS))
    assert list(models.retokenizers) == ["teacher"]
    prompts, items = models.task.train_prompts(np.random.default_rng(0), 3)
    route = models.router.route(items, prompts, np.random.default_rng(0))
    characters = build_tokenizer("characters")
    for row, item in enumerate(items):
        own = np.asarray(route.prompt_tokens)[row][np.asarray(route.prompt_mask)[row]].tolist()
        assert own == characters.encode(item.prompt) != prompts[row]  # the student's are byte pairs
    assert not run_models(load_config("demo", [])).retokenizers  # one tokenizer: nothing re-tokenised


@pytest.mark.parametrize(
    "sets, says",
    [
        (["estimator.name=reverse_kl_mc", "sampling.num_candidates=2"], "estimator 'reverse_kl_mc' cannot compare"),
        (["scoring.num_samples=2"], "scoring.num_samples = 2: teacher samples do not map across tokenizers"),
        (["train.diagnostics_every=5"], "train.diagnostics_every = 5: the diagnostics compare"),
        (
            ["learner.extrapolation.enabled=true", "learner.extrapolation.probe_metric=reverse_kl"],
            "probe_metric = 'reverse_kl' compares the two models' vocabularies",
        ),
    ],
)
def test_what_cannot_cross_tokenizers_is_refused_at_start_up(sets, says):
    with pytest.raises(ValueError, match=says):
        run_models(load_config("demo", [*CROSS, *sets]))


def _run(tmp_path, name: str, *sets: str) -> tuple[dict, list[dict]]:
    """Three sync steps of the demo (tests/pipeline/test_teachers.py) with the byte-pair student."""
    return run_demo(tmp_path, name, *CROSS, "learner.batch_size=16", *sets)


@pytest.mark.e2e  # whole runs (3 steps each), one beside a server, one in stage processes (-m e2e)
@pytest.mark.parametrize("estimator", ["forward_kl_topk", "reverse_kl_pg"])
def test_in_process_served_and_stage_processes_score_alike(tmp_path, estimator):
    """The same three steps with the teacher in-process (threads), behind ``serve-teacher``
    (its tokenizer named by ``teacher.tokenizer``), and in stage processes: the same
    teacher KL and loss at every step (sync: the same rollouts)."""
    teacher = from_pretrained(resolve_model_path("builtin:teacher"))
    settings = dataclasses.replace(SETTINGS, queue_rows=64)
    local_summary, local = _run(tmp_path, "local", f"estimator.name={estimator}")
    with running(BatchScorer(teacher, settings), settings) as (url, _, _):
        _, served = _run(
            tmp_path,
            "served",
            f"estimator.name={estimator}",
            "teacher.path=''",
            f"teacher.server={{url: '{url}', api: asyncopd}}",
            "teacher.tokenizer=builtin:teacher",
        )
    _, processes = _run(tmp_path, "processes", f"estimator.name={estimator}", "stages.placement=processes")
    for other in (served, processes):
        for a, b in zip(local, other):
            np.testing.assert_allclose(b["teacher/teacher/kl"], a["teacher/teacher/kl"], rtol=1e-4)
            np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-4, atol=1e-6)
    assert all(r["teacher/teacher/kl"] > 0.5 for r in local)  # the BPE warm start is far from the teacher
    assert local_summary["teacher_accuracy"] > 0.9  # measured through the teacher's own tokenizer


def test_the_teachers_kl_metric_sums_its_spans():
    """``teacher/NAME/kl`` with a span cache: Σ log μ over the tokens of scored spans minus
    Σ log q of the spans, over the answer's tokens (a token past the last span: neither)."""
    import jax.numpy as jnp

    from asyncopd_jax.cache import RolloutBatch, TeacherScoreCache
    from asyncopd_jax.pipeline.learner_stage import teacher_stats
    from asyncopd_jax.pipeline.staleness import RolloutGroup
    from asyncopd_jax.teacher.scorer import TeacherUse

    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], bool)
    ends = np.array([[0, 1, 0, 1, 0], [1, 0, 0, 0, 0]], bool)  # row 1: two tokens past its only span
    mu = np.array([[-1.0, -2, -3, -4, -9], [-0.5, -7, -7, -9, -9]], np.float32)
    q = np.where(ends, np.array([[0, -4.0, 0, -6, 0], [-1.5, 0, 0, 0, 0]]), 0.0).astype(np.float32)
    batch = RolloutBatch(
        prompt_tokens=jnp.ones((2, 2), jnp.int32),
        prompt_mask=jnp.ones((2, 2), bool),
        response_tokens=jnp.ones((2, 5), jnp.int32),
        response_mask=jnp.asarray(mask),
        behavior_logp=jnp.asarray(mu),
        token_version=jnp.zeros((2, 5), jnp.int32),
    )
    cache = TeacherScoreCache(token_logp=jnp.asarray(q), span_end=jnp.asarray(ends))
    group = RolloutGroup(batch, cache, 0, 0, teacher_uses={"t": TeacherUse(2, 1.0, 1)})
    # row 0: (−1 − 2 + 4) + (−3 − 4 + 6) = 0; row 1: −0.5 + 1.5 = 1; over 7 tokens
    stats = teacher_stats([group])
    assert stats["teacher/t/kl"] == pytest.approx(1.0 / 7)
    assert stats["teacher/t/unscored_tokens"] == 2.0  # row 1's two tokens past its only span
    per_token = dataclasses.replace(group, cache=TeacherScoreCache(token_logp=jnp.asarray(q)))
    assert "teacher/t/unscored_tokens" not in teacher_stats([per_token])


@pytest.mark.e2e  # a whole run (3 steps): the end-to-end step (-m e2e)
def test_a_teacher_of_another_tokenizer_beside_one_of_the_students(tmp_path):
    """Teachers ``a`` (the character teacher: another tokenizer) and ``b`` (the byte-pair
    student itself) routed by mixture: their caches (by spans, by tokens) merge into one; b's
    KL on step 1 is 0 (it sampled that batch) and a's is not."""
    _, records = _run(
        tmp_path,
        "mixed",
        "teacher.path=''",
        "teachers=[{name: a, path: 'builtin:teacher', weight: 2}, {name: b, path: 'builtin:student_bpe'}]",
        "seed=3",
    )
    first = records[0]
    assert first["teacher/a/rows"] > 0 and first["teacher/b/rows"] > 0, first
    assert abs(first["teacher/b/kl"]) < 1e-3 and first["teacher/a/kl"] > 0.5, first
    assert first["teacher/b/unscored_tokens"] == 0.0
