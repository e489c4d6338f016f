"""A real vLLM teacher scoring multi-turn trajectories (issue 57; marked ``served``: CI's own
step, with ``ASYNCOPD_VLLM_PYTHON`` set; skipped without it).

vLLM serves the tool task's teacher (``builtin:teacher_tools``) as it is, in float32. The
client sends each trajectory's turns and observations as one sequence; vLLM's prompt
log-probs must give every student token what the in-process scorer gives it, the
observations read as context. The same holds through a teacher of another tokenizer, whose
spans the client cuts at every observation.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.config import TaskConfig, load_config
from asyncopd_jax.models import from_pretrained
from asyncopd_jax.pipeline.run_models import run_models
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.tasks.tokenizer import EOS_ID, build_tokenizer
from asyncopd_jax.tasks.tool_task import ToolTaskData
from asyncopd_jax.teacher import TeacherScorer
from asyncopd_jax.teacher.client import ServedTeacher, ServerParams
from asyncopd_jax.teacher.cross_tokenizer import CrossTokenizerTeacher, Retokenizer
from asyncopd_jax.teacher.launch import VLLM_START_S as START_S
from tests.teacher.test_trajectory_spans import PARAMS, _batch
from tests.teacher.vllm_server import assert_same_topk_ids, vllm_server

pytestmark = pytest.mark.served

# fp32 on both sides: different kernels, the same distribution. Measured on 3 × 32 episodes
# (2026-11-29): vLLM's log-probs differ from ours by 1.2-2.3e-5 at the 99th percentile and by
# at most 1.9e-4, the largest before any observation (logits of magnitude ~13 summed in
# another order). A trajectory read wrongly (an observation left out, a turn shifted) moves
# them by whole nats.
P99, WORST = 5e-5, 5e-4


def _agree(got: np.ndarray, want: np.ndarray) -> None:
    """``got`` equals ``want`` to fp32 kernels' noise: 99 % within :data:`P99`, all within :data:`WORST`."""
    diff = np.abs(got - want)
    assert np.quantile(diff, 0.99) <= P99 and diff.max() <= WORST, (np.quantile(diff, 0.99), diff.max())


TEACHER = "builtin:teacher_tools"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    with vllm_server(resolve_model_path(TEACHER), log) as url:
        yield url


def _served(url: str, vocab_size: int) -> ServedTeacher:
    return ServedTeacher(ServerParams(url=url, rows_per_request=8, in_flight=2), PARAMS, vocab_size)


@pytest.mark.timeout(START_S + 300)
def test_vllm_scores_the_tool_students_trajectories_as_the_in_process_scorer(server):
    """32 held-out episodes of ``demo_tools``' student, sampled at temperature 1 with the
    calculator answering: vLLM's log-probs and top-K on every student token equal ours."""
    models = run_models(load_config("demo_tools"))
    task = models.task
    graphdef, state = nnx.split(from_pretrained(resolve_model_path("builtin:student_tools")))
    batch = task.rollout(graphdef, state, task.eval_items[:32], temperature=1.0, seed=0)
    student, environment = np.asarray(batch.response_mask), np.asarray(batch.environment_mask)
    # real trajectories: 13 of the 32 observed the calculator, and 124 student tokens follow
    # an observation (seed 0)
    assert environment.any(1).sum() >= 8, environment.any(1).sum()
    after = student & (np.cumsum(environment, axis=1) > 0)
    assert after.sum() >= 64, after.sum()

    local = TeacherScorer(from_pretrained(resolve_model_path(TEACHER)), PARAMS).score(batch)
    remote = _served(server, models.student_config.vocab_size).score(batch)
    _agree(np.asarray(remote.token_logp)[student], np.asarray(local.token_logp)[student])
    want_logp, got_logp = np.asarray(local.topk_logp)[student], np.asarray(remote.topk_logp)[student]
    _agree(got_logp, want_logp)
    # the same ids, but where two of them tie to within the noise (their order is the kernels')
    want_ids, got_ids = np.asarray(local.topk_ids)[student], np.asarray(remote.topk_ids)[student]
    assert_same_topk_ids(got_ids, want_ids, want_logp, WORST)


@pytest.mark.timeout(START_S + 300)
def test_vllm_behind_a_teacher_of_another_tokenizer_scores_trajectories_as_in_process(server):
    """The byte-pair student's trajectories (a tool error and a turn cut at the length limit
    among them): the client re-tokenises each turn and observation into the teacher's
    characters, vLLM scores them, and the span cache equals the in-process one."""
    config = TaskConfig(name="tools")
    pair = ToolTaskData(config, build_tokenizer("tools_merges")), ToolTaskData(config, build_tokenizer("tools"))
    batch = _batch(*pair, cut=2)
    retokenizer = Retokenizer.of(pair[0].tokenizer, pair[1].tokenizer, (EOS_ID,))
    scorer = TeacherScorer(from_pretrained(resolve_model_path(TEACHER)), PARAMS)
    want = CrossTokenizerTeacher(scorer, retokenizer, context=128).score(batch)
    got = CrossTokenizerTeacher(_served(server, 2**31 - 1), retokenizer, context=None).score(batch)
    student = np.asarray(batch.response_mask)
    ends = np.asarray(want.span_end) & student
    np.testing.assert_array_equal(np.asarray(got.span_end) & student, ends)
    # spans after an observation are among those compared
    assert (ends & (np.cumsum(np.asarray(batch.environment_mask), axis=1) > 0)).sum() >= 8
    _agree(np.asarray(got.token_logp)[ends], np.asarray(want.token_logp)[ends])
    starts = np.isfinite(np.asarray(want.topk_logp)).any(-1) & student
    _agree(np.asarray(got.topk_logp)[starts], np.asarray(want.topk_logp)[starts])
