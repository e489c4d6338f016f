"""The served teacher against a real vLLM server on loopback (marked ``served``: CI's own step,
with ``ASYNCOPD_VLLM_PYTHON`` set; skipped without it).

vLLM serves the shipped teacher (``builtin:teacher``) as it is, in float32; the client sends
the demo's student rollouts and the cache it fills must equal the in-process scorer's on the
same weights.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.config import load_config
from asyncopd_jax.models import from_pretrained
from asyncopd_jax.pipeline.run_models import run_models
from asyncopd_jax.sampling import Sampler
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.teacher import TeacherScorer
from asyncopd_jax.teacher.client import ServedTeacher, ServerParams
from asyncopd_jax.teacher.launch import VLLM_START_S as START_S
from tests.teacher.vllm_server import assert_same_topk_ids, vllm_server

pytestmark = pytest.mark.served

TOLERANCE = 1e-4  # fp32 on both sides: different kernels, the same distribution


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with vllm_server(resolve_model_path("builtin:teacher"), log) as url:
        yield url


@pytest.fixture(scope="module")
def rollouts():
    """32 answers of the demo's student to held-out prompts, sampled at temperature 1."""
    cfg = load_config("demo")
    models = run_models(cfg)
    graphdef, state = nnx.split(from_pretrained(resolve_model_path(cfg.student.path)))
    sampler = Sampler(graphdef, models.sampling, pad_id=models.task.pad_id)
    prompts = models.task.encode(models.task.eval_items[:32])
    return sampler.generate(state, prompts, jax.random.key(0), prompt_slots=models.task.prompt_slots), cfg


def _scores_agree(model: str, url: str, rollouts) -> None:
    """vLLM at ``url`` scores ``rollouts`` as the in-process scorer does on ``model``'s weights."""
    batch, cfg = rollouts
    params = dataclasses.replace(cfg.scoring, topk=8)
    local = TeacherScorer(from_pretrained(resolve_model_path(model)), params).score(batch)
    remote = ServedTeacher(ServerParams(url=url, rows_per_request=8, in_flight=2), params, 32).score(batch)
    mask = np.asarray(batch.response_mask)
    assert mask.sum() > 200 and (mask.sum(1) < mask.shape[1]).any()  # many positions; some answers end early
    np.testing.assert_allclose(np.asarray(remote.token_logp)[mask], np.asarray(local.token_logp)[mask], atol=TOLERANCE)
    want_logp, got_logp = np.asarray(local.topk_logp)[mask], np.asarray(remote.topk_logp)[mask]
    np.testing.assert_allclose(got_logp, want_logp, atol=TOLERANCE)
    # the same ids, but where two of them tie to within the tolerance (their order is the kernels')
    want_ids, got_ids = np.asarray(local.topk_ids)[mask], np.asarray(remote.topk_ids)[mask]
    assert_same_topk_ids(got_ids, want_ids, want_logp, TOLERANCE)


@pytest.mark.timeout(START_S + 300)
def test_vllm_scores_equal_the_in_process_scorer_on_the_same_weights(server, rollouts):
    _scores_agree("builtin:teacher", server, rollouts)


@pytest.mark.timeout(START_S + 300)
def test_vllm_serves_the_mixture_of_experts_teacher_as_we_score_it(rollouts, tmp_path):
    """vLLM's CPU build loads builtin:teacher_moe (Qwen3MoeForCausalLM: 8 experts, 2 a token)
    and its scores are ours."""
    with vllm_server(resolve_model_path("builtin:teacher_moe"), tmp_path / "server.log") as url:
        _scores_agree("builtin:teacher_moe", url, rollouts)


@pytest.mark.timeout(START_S + 300)
def test_vllm_scores_a_student_of_another_tokenizer_as_the_in_process_teacher_does(server):
    """The byte-pair student's answers, re-tokenised into the teacher's characters by the
    client and scored by vLLM: the span cache equals the in-process one (issue 40)."""
    from asyncopd_jax.teacher.cross_tokenizer import CrossTokenizerTeacher

    cfg = load_config("demo", ["student.path=builtin:student_bpe"])
    models = run_models(cfg)
    graphdef, state = nnx.split(from_pretrained(resolve_model_path(cfg.student.path)))
    items = models.task.eval_items[:32]
    prompts = models.task.encode(items)
    batch = Sampler(graphdef, models.sampling, pad_id=models.task.pad_id).generate(
        state, prompts, jax.random.key(0), prompt_slots=models.task.prompt_slots
    )
    route = models.router.route(items, prompts, np.random.default_rng(0))  # the teacher's prompts, in characters
    batch = dataclasses.replace(batch, prompt_tokens=route.prompt_tokens, prompt_mask=route.prompt_mask)
    params, pair = dataclasses.replace(cfg.scoring, topk=8), models.retokenizers["teacher"]
    local = CrossTokenizerTeacher(
        TeacherScorer(from_pretrained(resolve_model_path("builtin:teacher")), params), pair, 128
    )
    served = ServedTeacher(ServerParams(url=server, rows_per_request=8, in_flight=2), params, 2**31 - 1)
    want, got = local.score(batch), CrossTokenizerTeacher(served, pair, None).score(batch)
    mask = np.asarray(batch.response_mask)
    ends = np.asarray(want.span_end) & mask
    np.testing.assert_array_equal(np.asarray(got.span_end) & mask, ends)
    assert ends.sum() > 200
    np.testing.assert_allclose(np.asarray(got.token_logp)[ends], np.asarray(want.token_logp)[ends], atol=4 * TOLERANCE)
    starts = np.isfinite(np.asarray(want.topk_logp)).any(-1) & mask
    np.testing.assert_allclose(np.asarray(got.topk_logp)[starts], np.asarray(want.topk_logp)[starts], atol=TOLERANCE)


@pytest.mark.slow  # the whole demo through vLLM: minutes (docs/results.md); -m "served and slow"
@pytest.mark.timeout(START_S + 3600)
def test_the_demo_distils_through_a_vllm_teacher_to_94_percent_of_it(server, tmp_path):
    from asyncopd_jax.pipeline.trainer import Trainer
    from tests.waits import SHORT_WAIT_SETS

    cfg = load_config(
        "demo", [f"output_dir={tmp_path}", "teacher.path=''", f"teacher.server.url={server}", *SHORT_WAIT_SETS]
    )
    summary = Trainer(cfg, progress=False).run()
    models = run_models(cfg)
    teacher = models.task.accuracy(*nnx.split(from_pretrained(resolve_model_path("builtin:teacher"))))
    assert summary["student_after"] >= 0.94 * teacher, (summary["student_after"], teacher)
