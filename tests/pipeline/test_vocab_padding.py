"""A teacher and a student that share a tokenizer but pad their embeddings to different
sizes (Qwen2.5 0.5B: 151,936 rows, 7B: 152,064) are compared over the ids both have.

The check: the padded model is the other one with extra embedding rows (large random
values that would take most of the probability mass if the padded model's output kept
them). Over the shared ids the two are the same distribution, so the first step of a
sync reverse-KL run (μ = π_θ) must have loss and gradient zero — in the learner's own
thread and with rollout and scoring in their own processes, whichever side is padded.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from asyncopd_jax.config import load_config
from asyncopd_jax.models import Decoder, from_pretrained, save_pretrained
from asyncopd_jax.pipeline.trainer import Trainer
from asyncopd_jax.tasks.builtin import model_config, new_model
from asyncopd_jax.tasks.tokenizer import save_tokenizer
from tests.waits import SHORT_WAITS

pytestmark = pytest.mark.e2e  # whole runs in every placement: the end-to-end step (-m e2e)

EXTRA_ROWS = 8


def padded(model: Decoder, rows: int, seed: int = 0) -> Decoder:
    """``model`` with ``rows`` more (tied) embedding rows of large random values."""
    config = dataclasses.replace(model.config, vocab_size=model.config.vocab_size + rows)
    bigger = Decoder(config, rngs=nnx.Rngs(0))
    source = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for path, var in nnx.to_flat_state(nnx.state(bigger, nnx.Param)):
        value = source[path][...]
        if path == ("embed_tokens", "embedding"):
            value = jnp.concatenate([value, jax.random.normal(jax.random.key(seed), (rows, config.hidden_size))])
        var[...] = value
    return bigger


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The student (32 ids, the built-in tokenizer's 19 plus padding) saved twice: as is and
    with 8 more rows."""
    root = tmp_path_factory.mktemp("models")
    base = new_model("student", 2)
    assert base.config == model_config("student") and base.config.tie_word_embeddings
    for name, model in (("base", base), ("padded", padded(base, EXTRA_ROWS))):
        save_pretrained(model, root / name)
        save_tokenizer(root / name)
    return root


def test_the_padded_model_differs_unless_narrowed(models):
    """The test below can fail: unnarrowed, the extra rows take most of the padded model's mass."""
    base, big = from_pretrained(models / "base"), from_pretrained(models / "padded")
    ids = jnp.array([[1, 5, 7, 9, 4]])
    wide = jax.nn.softmax(big(ids), axis=-1)
    assert float(wide[..., base.config.vocab_size :].sum(-1).min()) > 0.5
    big.vocab_limit = base.config.vocab_size
    assert jnp.allclose(jax.nn.log_softmax(big(ids)), jax.nn.log_softmax(base(ids)), atol=1e-5)


@pytest.mark.parametrize(
    "padded_side,placement",
    [
        ("teacher", "threads"),  # the trainer's own teacher scores
        ("teacher", "processes"),  # a scoring process loads the teacher
        ("student", "processes"),  # a rollout process samples, the trainer's learner trains
    ],
)
def test_models_padded_differently_are_compared_over_the_ids_they_share(models, tmp_path, padded_side, placement):
    student, teacher = ("padded", "base") if padded_side == "student" else ("base", "padded")
    sets = {
        "name": "v",
        "output_dir": tmp_path,
        "student.path": models / student,
        "teacher.path": models / teacher,
        "task.eval_prompts": 8,
        "sampling.max_new_tokens": 8,
        "sampling.num_candidates": 4,
        "learner.batch_size": 8,
        "learner.mesh": "{data: 1, fsdp: 1}",
        "estimator.name": "reverse_kl_mc",
        "schedule.mode": "sync",
        "stages.placement": placement,
        "optim.warmup_steps": 0,
        "train.steps": 1,
        "train.eval_every": 100,
        "stages.rollouts": 1,
        "stages.scoring_processes": 1 if placement == "processes" else 0,
        **SHORT_WAITS,
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in sets.items()])
    trainer = Trainer(cfg, progress=False)
    assert trainer.vocab_limit == 32
    trainer.run()
    (record,) = [json.loads(line) for line in (tmp_path / "v" / "metrics.jsonl").read_text().splitlines()]
    # q = π = μ on every candidate: the surrogate and its gradient vanish (float32 noise only)
    assert abs(record["loss"]) < 1e-4 and record["grad_norm"] < 1e-4, record
