"""``teacher.mapping: byte_prefix``: the character teacher scored on the byte-pair student's
own tokens. Checked against the teacher's chain rule, written here: the character teacher
writes a text one character a token, so the probability that its continuation starts with a
student token's text is the product of its probabilities of those characters, each after
the ones before (one whole forward of the teacher a character)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.config import load_config
from asyncopd_jax.models import from_pretrained
from asyncopd_jax.pipeline.run_models import run_models
from asyncopd_jax.sampling import Sampler, SamplingParams
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.teacher.byte_prefix_teacher import BytePrefixTeacher
from asyncopd_jax.teacher.scorer import ScoringParams

BYTE_PREFIX = ["student.path=builtin:student_bpe", "teacher.mapping=byte_prefix", "sampling.student_topk=4"]
TEMPERATURE = 1.3


@pytest.fixture(scope="module")
def scored():
    """8 answers of the byte-pair student (its top-4 at each position), their teacher prompts
    in the teacher's characters, and the byte-prefix teacher's cache of them."""
    models = run_models(load_config("demo", BYTE_PREFIX))
    pair = models.retokenizers["teacher"]
    prompts, items = models.task.train_prompts(np.random.default_rng(3), 8)
    student = from_pretrained(resolve_model_path("builtin:student_bpe"))
    graphdef, state = nnx.split(student)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, student_topk=4, stop_token_ids=pair.student_eos)
    batch = Sampler(graphdef, params).generate(state, prompts, jax.random.key(0))
    own = [pair.teacher.encode(item.prompt, add_special_tokens=False) for item in items]
    width = max(map(len, own))
    teacher_prompts = np.zeros((len(own), width), np.int32)
    for row, ids in enumerate(own):
        teacher_prompts[row, width - len(ids) :] = ids
    batch = batch.__class__(
        **{
            **batch.__dict__,
            "prompt_tokens": jnp.asarray(teacher_prompts),
            "prompt_mask": jnp.asarray(teacher_prompts != 0),
        }
    )
    teacher = from_pretrained(resolve_model_path("builtin:teacher"))
    scorer = BytePrefixTeacher(teacher, pair, ScoringParams(temperature=TEMPERATURE))
    return pair, teacher, batch, own, scorer.score(batch), scorer


def _chain(teacher, pair, context: list[int], text: bytes) -> float:
    """log P(the teacher's next characters are ``text``), by the chain rule."""
    total, ids = 0.0, list(context)
    for char in pair.teacher.encode(text.decode(), add_special_tokens=False):
        logits = teacher(jnp.asarray([ids]))[0, -1] / TEMPERATURE
        total += float(jax.nn.log_softmax(logits)[char])
        ids.append(char)
    return total


def test_each_token_and_each_top_k_id_gets_the_teachers_chain_rule_probability(scored):
    pair, teacher, batch, own, cache, scorer = scored
    tokens, mask = np.asarray(batch.response_tokens), np.asarray(batch.response_mask)
    support = np.asarray(batch.student_topk_ids)
    pieces, checked, multi = pair.student_bytes.pieces, 0, 0
    for row in range(3):
        prefix = b""
        for position in np.flatnonzero(mask[row])[:6].tolist():
            context = own[row] + pair.teacher.encode(prefix.decode(), add_special_tokens=False)
            sampled = int(tokens[row, position])
            if sampled in pair.student_eos:  # scored as the teacher's EOS
                logits = teacher(jnp.asarray([context]))[0, -1] / TEMPERATURE
                want = float(jax.nn.log_softmax(logits)[pair.teacher_eos])
            else:
                want = _chain(teacher, pair, context, pieces[sampled])
                multi += len(pieces[sampled]) > 1
            np.testing.assert_allclose(np.asarray(cache.token_logp)[row, position], max(want, -30.0), atol=2e-5)
            ids = support[row, position].tolist()
            texts = [pieces[i] for i in ids]
            for k, (i, text) in enumerate(zip(ids, texts)):
                if i in pair.student_eos or not text:
                    continue
                extended = any(o != text and o.startswith(text) for o in texts)  # its mass is split: below
                if not extended and texts.index(text) == k:
                    got = np.asarray(cache.topk_logp)[row, position, k]
                    np.testing.assert_allclose(got, _chain(teacher, pair, context, text), atol=2e-5)
                    checked += 1
            prefix += pieces[sampled]
    assert checked > 20 and multi > 3  # multi-character student tokens were scored, as the spans could not
    np.testing.assert_array_equal(np.asarray(cache.topk_ids), support)
    assert scorer.last_rows > 0


def test_the_top_k_masses_are_disjoint_probabilities(scored):
    """Each position's masses sum to at most 1 (the rest is the tail), and a candidate
    extended by a longer one keeps only what the longer one does not take."""
    pair, teacher, batch, own, cache, _ = scored
    mask = np.asarray(batch.response_mask, bool)
    total = np.exp(np.asarray(cache.topk_logp, np.float64)).sum(-1)[mask]
    assert (total <= 1 + 1e-5).all() and total.max() > 0.3
    assert np.isfinite(np.asarray(cache.token_logp)[mask]).all()


def test_a_teacher_of_the_students_tokenizer_refuses_the_mapping():
    with pytest.raises(ValueError, match=r"mapping = byte_prefix is for a teacher of another tokenizer"):
        run_models(load_config("demo", ["teacher.mapping=byte_prefix", "sampling.student_topk=4"]))


@pytest.mark.parametrize(
    "sets, says",
    [
        (["estimator.name=reverse_kl_topk"], "mapping = byte_prefix fills the top-K with the student's own ids"),
        (
            ["sampling.student_topk=0"],
            "mapping = byte_prefix scores the student's top-K ids: set sampling.student_topk",
        ),
        (
            [
                "teacher.path=''",
                "teacher.server.url=http://x:1",
                "teacher.server.api=asyncopd",
                "teacher.tokenizer=builtin:teacher",
            ],
            "mapping = byte_prefix scores in-process only",
        ),
    ],
)
def test_what_byte_prefix_cannot_do_is_refused_at_start_up(sets, says):
    with pytest.raises(ValueError, match=says):
        run_models(load_config("demo", [*BYTE_PREFIX, *sets]))


def test_contexts_run_whole_equal_the_teachers_forward(scored):
    """Contexts that are no prefix of a kept answer run whole (one a prefix of another read
    off its forward): the teacher's log-softmax after each."""
    _, teacher, _, _, _, scorer = scored
    contexts = [[5, 6, 7], [5, 6], [9, 10, 11, 12, 13], [5, 6, 7, 8], [3]]
    got = scorer.next_logprobs(contexts)
    for context, row in zip(contexts, got):
        want = jax.nn.log_softmax(teacher(jnp.asarray([context]))[0, -1] / TEMPERATURE)
        np.testing.assert_allclose(row[: want.shape[0]], want, atol=2e-5)


def test_no_row_is_dropped_by_the_learners_fault_check(scored):
    """Every log-mass is finite (a candidate no teacher path writes, a special id: the floor),
    so the learner keeps every row of a per-token cache, which takes −inf for a fault."""
    from asyncopd_jax.learner import LearnerBatch
    from asyncopd_jax.learner.faults import nonfinite_rows

    pair, _, batch, _, _, scorer = scored
    special = min(pair.student_bytes.special - set(pair.student_eos))  # a special id: not scored
    support = np.asarray(batch.student_topk_ids).copy()
    support[..., -1] = special
    batch = dataclasses.replace(batch, student_topk_ids=jnp.asarray(support))
    cache = scorer.score(batch)
    assert np.isfinite(np.asarray(cache.topk_logp)).all() and np.isfinite(np.asarray(cache.token_logp)).all()
    assert np.asarray(cache.topk_logp)[..., -1].max() <= -29  # no mass on it
    assert not np.asarray(nonfinite_rows(LearnerBatch(batch, cache))).any()
