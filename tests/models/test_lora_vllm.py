"""LoRA adapters exported in PEFT's layout, served by a real vLLM with ``--enable-lora`` on
their base (marked ``served``: CI's own step, with ``ASYNCOPD_VLLM_PYTHON`` set; skipped
without it): vLLM's prompt log-probs of 32 demo rollouts under the adapter are ours, the
adapters unmerged in our scorer.

The base is ``builtin:teacher``, not the demo's student: vLLM's CPU attention has no kernel
for the student's head dimension, 16 ("Unsupported CPU attention configuration:
head_dim=16"); the teacher's, 32, it has."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.config import load_config
from asyncopd_jax.models import from_pretrained
from asyncopd_jax.models.lora import LoRAParams, adapters, add_adapters
from asyncopd_jax.models.lora_checkpoint import save_adapters
from asyncopd_jax.pipeline.run_models import run_models
from asyncopd_jax.sampling import Sampler
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.teacher import TeacherScorer
from asyncopd_jax.teacher.client import ServedTeacher, ServerParams
from asyncopd_jax.teacher.launch import VLLM_START_S as START_S
from tests.teacher.vllm_server import vllm_server

pytestmark = pytest.mark.served

PARAMS = LoRAParams(rank=4, alpha=12.0)  # α ≠ r: vLLM scales by α / r as PEFT does


@pytest.mark.timeout(START_S + 300)
def test_vllm_serves_the_exported_adapter_as_we_compute_it(tmp_path):
    cfg = load_config("demo")
    base = resolve_model_path(cfg.teacher.path)
    models = run_models(cfg)
    student = add_adapters(from_pretrained(base), PARAMS, nnx.Rngs(0))
    for i, (_, module) in enumerate(adapters(student)):  # a fresh B is zero: it would hide a wrong A
        module.lora_b[...] = 0.5 * jax.random.normal(jax.random.key(i), module.lora_b.shape)
    save_adapters(student, tmp_path / "adapter", PARAMS, base_model=str(base))

    graphdef, state = nnx.split(from_pretrained(resolve_model_path(cfg.student.path)))  # the demo's rollouts
    prompts = models.task.encode(models.task.eval_items[:32])
    batch = Sampler(graphdef, models.sampling, pad_id=models.task.pad_id).generate(
        state, prompts, jax.random.key(0), prompt_slots=models.task.prompt_slots
    )
    params = dataclasses.replace(cfg.scoring, topk=8)
    ours = TeacherScorer(student, params).score(batch)
    plain = TeacherScorer(from_pretrained(base), params).score(batch)
    # one sequence at a time: vLLM 0.32's CPU LoRA path fails on prompt log-probs of two or
    # more sequences batched together ("einsum(): subscript b has size 2 ... size 28" in
    # punica_cpu.add_lora_logits: the logits' adapter map is per sequence, not per position)
    flags = ("--enable-lora", "--lora-modules", f"adapter={tmp_path / 'adapter'}", "--max-lora-rank", "8")
    with vllm_server(base, tmp_path / "server.log", *flags, "--max-num-seqs", "1") as url:
        served = ServedTeacher(ServerParams(url=url, model="adapter", rows_per_request=1, in_flight=1), params, 32)
        theirs = served.score(batch)
    mask = np.asarray(batch.response_mask)
    want, got = np.asarray(ours.token_logp)[mask], np.asarray(theirs.token_logp)[mask]
    assert np.abs(want - np.asarray(plain.token_logp)[mask]).max() > 0.05  # the adapter changes the scores
    np.testing.assert_allclose(got, want, atol=1e-4)
    np.testing.assert_allclose(np.asarray(theirs.topk_logp)[mask], np.asarray(ours.topk_logp)[mask], atol=1e-4)
