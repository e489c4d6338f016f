"""``teacher.mapping: byte_prefix``: the character teacher scored on the byte-pair student's
own tokens. Checked against the teacher's chain rule, written here: the character teacher
writes a text one character a token, so the probability that its continuation starts with a
student token's text is the product of its probabilities of those characters, each after
the ones before (one whole forward of the teacher a character)."""

from __future__ import annotations

import dataclasses
import re

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
from asyncopd_jax.teacher.prefix_trees import PrefixTrees
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
    scorer = BytePrefixTeacher(PrefixTrees(teacher, pair.teacher_bytes, TEMPERATURE), pair, ScoringParams())
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
                "teacher.server.api=vllm",
                "teacher.tokenizer=builtin:teacher",
            ],
            r"mapping = byte_prefix asks the server for byte-prefix probabilities \(POST /v1/byte_prefix\): "
            "server.api = vllm is invalid; allowed: asyncopd",
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
    got = scorer.trees.next_logprobs(contexts)
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


def test_from_teacher_puts_the_tokens_that_start_the_teachers_likeliest_next_ones_first(scored):
    """``from_teacher = 2``: each position's first ids are the student tokens of the teacher's
    two likeliest next characters (its EOS: the student's), the rest the student's own top
    ids not among them, in its order; each id is scored as the chain rule says."""
    pair, teacher, batch, own, _, _ = scored
    scorer = BytePrefixTeacher(scored[-1].trees, pair, ScoringParams(), from_teacher=2)
    cache = scorer.score(batch)
    ids, masses = np.asarray(cache.topk_ids), np.asarray(cache.topk_logp)
    tokens, mask, support = np.asarray(batch.response_tokens), np.asarray(batch.response_mask), batch.student_topk_ids
    pieces, moved = pair.student_bytes.pieces, 0
    for row in range(3):
        prefix = b""
        for position in np.flatnonzero(mask[row])[:5].tolist():
            context = own[row] + pair.teacher.encode(prefix.decode(), add_special_tokens=False)
            logp = jax.nn.log_softmax(teacher(jnp.asarray([context]))[0, -1] / TEMPERATURE)
            likeliest = np.argsort(-np.asarray(logp))[:2].tolist()
            want = [
                pair.student_eos[0]
                if i == pair.teacher_eos
                else pair.student_bytes.by_bytes[pair.teacher_bytes.pieces[i]]
                for i in likeliest
            ]
            rest = [int(i) for i in np.asarray(support)[row, position] if int(i) not in want]
            assert ids[row, position].tolist() == (want + rest)[:4]
            moved += rest != np.asarray(support)[row, position, 2:].tolist()
            for k, i in enumerate(want):  # single characters: their mass is the teacher's, less longer candidates'
                text = pieces[i]
                if i not in pair.student_eos and not any(
                    pieces[o] != text and pieces[o].startswith(text) for o in ids[row, position]
                ):
                    np.testing.assert_allclose(masses[row, position, k], float(logp[likeliest[k]]), atol=2e-5)
            prefix += pieces[int(tokens[row, position])]
    assert moved > 3  # the teacher's tokens displaced some of the student's own


def test_the_student_token_that_starts_a_teacher_token(scored):
    pair, teacher, *_ = scored
    scorer = BytePrefixTeacher(PrefixTrees(teacher, pair.teacher_bytes), pair, ScoringParams(), from_teacher=1)
    three = pair.teacher.encode("3", add_special_tokens=False)[0]
    assert scorer.start(three) == pair.student_bytes.by_bytes[b"3"]
    assert scorer.start(pair.teacher_eos) == pair.student_eos[0]
    assert scorer.start(min(pair.teacher_bytes.special - {pair.teacher_eos})) == -1
    assert scorer.start(len(pair.teacher_bytes.pieces) + 5) == -1  # an embedding row past the tokenizer
    assert scorer.start(three, tail=b"3") == -1  # nothing left to write after the tail
    # after a partial character (the tail): a teacher token that completes it and writes on
    pieces = list(pair.teacher_bytes.pieces)
    pieces[three] = b"\xe2\x8234"
    wide = dataclasses.replace(pair, teacher_bytes=dataclasses.replace(pair.teacher_bytes, pieces=tuple(pieces)))
    scorer = BytePrefixTeacher(PrefixTrees(teacher, wide.teacher_bytes), wide, ScoringParams(), from_teacher=1)
    by_bytes = pair.student_bytes.by_bytes
    assert scorer.start(three, tail=b"\xe2\x82") == by_bytes.get(b"34", by_bytes[b"3"])
    assert scorer.start(three, tail=b"\xe3\x82") == -1  # it does not continue the tail
    assert scorer.start(three, tail=b"\xe2") == -1  # no student token starts with b"\x82"


@pytest.mark.parametrize(
    "sets, says",
    [
        (["teacher.mapping=spans", "teacher.from_teacher=2"], "from_teacher = 2 is invalid with mapping = spans"),
        (["teacher.from_teacher=5"], r"from_teacher = 5 is invalid; allowed: <= sampling.student_topk \(4\)"),
    ],
)
def test_from_teacher_beyond_what_it_can_fill_is_refused(sets, says):
    with pytest.raises(ValueError, match=says):
        run_models(load_config("demo", [*BYTE_PREFIX, *sets]))


# --- through `asyncopd serve-teacher` (POST /v1/byte_prefix) ------------------------------------


@pytest.fixture(scope="module")
def server(scored):
    """serve-teacher of the character teacher at the test's temperature, with its trees."""
    from asyncopd_jax.teacher.batch_scorer import BatchScorer, ServerSettings
    from tests.teacher.test_server import running

    pair, teacher, *_ = scored
    settings = ServerSettings(temperature=TEMPERATURE, max_request_rows=8)
    with running(BatchScorer(teacher, settings), settings, PrefixTrees(teacher, pair.teacher_bytes, TEMPERATURE)) as (
        url,
        *_,
    ):
        yield url


def _served(url: str, **kwargs):
    from asyncopd_jax.teacher.client import ServedTeacher, ServerParams
    from asyncopd_jax.teacher.prefix_wire import ServedPrefixTrees

    client = ServedTeacher(ServerParams(url=url, api="asyncopd"), ScoringParams(temperature=TEMPERATURE), 1 << 30)
    return ServedPrefixTrees(client, TEMPERATURE)


@pytest.mark.parametrize("from_teacher", [0, 2])
def test_a_served_teacher_scores_the_students_tokens_as_the_in_process_one(scored, server, from_teacher):
    pair, _, batch, _, _, local = scored
    served = BytePrefixTeacher(_served(server), pair, ScoringParams(), from_teacher=from_teacher)
    here = BytePrefixTeacher(local.trees, pair, ScoringParams(), from_teacher=from_teacher)
    got, want = served.score(batch), here.score(batch)
    np.testing.assert_array_equal(np.asarray(got.topk_ids), np.asarray(want.topk_ids))
    np.testing.assert_allclose(np.asarray(got.topk_logp), np.asarray(want.topk_logp), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got.token_logp), np.asarray(want.token_logp), atol=1e-5)
    assert served.last_rows == here.last_rows > 0
    # 8 answers, the server's 8 a request: one request for the likeliest ids, one for the prefixes
    assert served.last_requests == 1 + bool(from_teacher) and served.last_wait_s == 0.0
    assert here.last_requests == 1 and here.last_wait_s is None


def _sequences_and_body(**fields):
    body = {"model": "teacher", "temperature": TEMPERATURE, "sequences": [[5, 6, 7]], "contexts": [[0, 2]]}
    return {**body, **fields}


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"top": 2, "candidates": [["YQ=="]]}, "give one of top"),
        ({}, "give one of top"),
        ({"top": 2, "temperature": 1.0}, "this server scores at temperature 1.3 only"),
        ({"top": 2, "model": "other"}, "model 'other' is not served here"),
        ({"top": 2, "contexts": [[1, 2]]}, r"contexts\[0\]\[0\] must be an integer from 0 to 0"),
        ({"top": 2, "contexts": [[0, 4]]}, r"contexts\[0\]\[1\] must be an integer from 1 to 3"),
        ({"top": 2, "contexts": [[0, [5, 99999]]]}, r"contexts\[0\]\[1\]"),
        ({"top": 0}, "top must be an integer from 1"),
        ({"candidates": [["not base64!"]]}, r"candidates\[0\]\[0\] is not base64"),
        ({"candidates": [["YQ=="], ["Yg=="]]}, r"one candidate list per context \(1\), got 2"),
        ({"top": 2, "sequences": [[5]] * 9}, "sequences must be a list of 1 to 8"),
        ({"top": 2, "extra": 1}, "extra is not a field of /v1/byte_prefix"),
    ],
)
def test_a_bad_byte_prefix_request_is_refused_in_one_line(server, fields, says):
    from tests.teacher.test_server import post

    response = post(server + "/v1/byte_prefix", json=_sequences_and_body(**fields))
    assert response.status_code in (400, 413), response.text
    assert re.search(says, response.json()["error"]["message"]), response.json()["error"]["message"]


def test_a_server_without_its_tokenizer_refuses_byte_prefix(scored):
    from asyncopd_jax.teacher.batch_scorer import BatchScorer, ServerSettings
    from tests.teacher.test_server import post, running

    settings = ServerSettings(temperature=TEMPERATURE)
    with running(BatchScorer(scored[1], settings), settings, None) as (url, *_):
        response = post(url + "/v1/byte_prefix", json=_sequences_and_body(top=2))
    assert response.status_code == 400 and "has no tokenizer of its model" in response.text


@pytest.mark.parametrize(
    "arrays, says",
    [
        ({"logprobs": np.zeros((1, 3)), "rows": np.ones(1, np.int64)}, r"shape \[1, 3\]; expected \[1, 2\]"),
        ({"logprobs": np.full((1, 2), np.nan), "rows": np.ones(1, np.int64)}, "expected"),
        ({"logprobs": np.full((1, 2), 0.5), "rows": np.ones(1, np.int64)}, r"log-probs \(<= 0\)"),
        ({"rows": np.ones(1, np.int64)}, "not logprobs and rows"),
    ],
)
def test_a_servers_bad_byte_prefix_answer_is_refused(arrays, says):
    import httpx2

    from asyncopd_jax.npz import npz_bytes
    from asyncopd_jax.teacher.client import ServedTeacher, ServerParams
    from asyncopd_jax.teacher.prefix_wire import ServedPrefixTrees
    from asyncopd_jax.teacher.wire import ServerError

    def answer(request):
        return httpx2.Response(200, content=npz_bytes(arrays), headers={"content-type": "application/octet-stream"})

    client = ServedTeacher(
        ServerParams(url="http://x:1", api="asyncopd", model="teacher", rows_per_request=8),
        ScoringParams(),
        1 << 30,
        client=httpx2.Client(transport=httpx2.MockTransport(answer)),
    )
    with pytest.raises(ServerError, match=says):
        ServedPrefixTrees(client, 1.0).prefixes([[5, 6]], [(0, [5])], [[b"a", b"b"]])


def test_a_sentencepiece_students_leading_space_is_not_scored_as_text():
    """A SentencePiece student writes its answer's first word with ``▁`` that its decoder
    drops: the first token is scored as the text without it (``"Hello"``, as the span
    alignment's text has it), the later ones with their spaces; a teacher token at the
    start maps to the student's ``▁`` token of it (``from_teacher``)."""
    from asyncopd_jax.cache import RolloutBatch
    from asyncopd_jax.teacher.cross_tokenizer import Retokenizer
    from tests.tiny_models import tiny_decoder
    from tests.tiny_tokenizers import byte_level_bpe, sentencepiece_bpe

    student, teacher_tokenizer = sentencepiece_bpe(), byte_level_bpe()
    pair = Retokenizer.of(student, teacher_tokenizer, (student.eos_token_id,))
    assert pair.student_bytes.strips_leading_space
    teacher = tiny_decoder(seed=2, vocab=len(teacher_tokenizer), scale=4.0)
    trees = PrefixTrees(teacher, pair.teacher_bytes)
    answer = student.encode("the cat sat", add_special_tokens=False)
    assert pair.student_bytes.pieces[answer[0]] == b" the"
    prompt = teacher_tokenizer.encode("12+34=", add_special_tokens=False)
    t = len(answer)
    top = np.asarray([[i, student.convert_tokens_to_ids("▁")] for i in answer], np.int32)[None]
    batch = RolloutBatch(
        prompt_tokens=jnp.asarray([prompt], jnp.int32),
        prompt_mask=jnp.ones((1, len(prompt)), bool),
        response_tokens=jnp.asarray([answer], jnp.int32),
        response_mask=jnp.ones((1, t), bool),
        behavior_logp=jnp.zeros((1, t)),
        token_version=jnp.zeros((1, t), jnp.int32),
        student_topk_ids=jnp.asarray(top),
        student_topk_behavior_logp=jnp.zeros(top.shape),
    )
    cache = BytePrefixTeacher(trees, pair, ScoringParams()).score(batch)
    sequence = prompt + teacher_tokenizer.encode("the cat sat", add_special_tokens=False)
    text = b""
    for position, token in enumerate(answer):
        piece = pair.student_bytes.pieces[token]
        piece = piece[1:] if position == 0 else piece  # the decoder's text: no leading space
        context = prompt + (teacher_tokenizer.encode(text.decode(), add_special_tokens=False) if text else [])
        want = trees.prefixes([sequence], [(0, context)], [[piece]])[0, 0]
        np.testing.assert_allclose(np.asarray(cache.token_logp)[0, position], want, atol=1e-5)
        text += piece
    assert np.asarray(cache.topk_logp)[0, 0, 1] <= -29  # "▁" alone writes no text at the start: not scored
    # a teacher token at the answer's start maps to the student's token of it with its ▁
    scorer = BytePrefixTeacher(trees, pair, ScoringParams(), from_teacher=1)
    the = teacher_tokenizer.convert_tokens_to_ids("the")
    assert scorer.start(the, lead=b" ") == student.convert_tokens_to_ids("▁the")
    assert scorer.start(the) == student.convert_tokens_to_ids("the")
    own = np.asarray([[7, 8]] * 2)
    got = scorer.teacher_ids(np.asarray([[the]] * 2), [b"", b""], own, [True, False])
    assert student.convert_ids_to_tokens(got[:, 0].tolist()) == ["▁the", "the"] and (got[:, 1] == 7).all()
    best, _ = trees.top([sequence], [(0, prompt)], 4)
    want = next(s for j in best[0] if (s := scorer.start(int(j), lead=b" ")) >= 0)
    assert int(np.asarray(scorer.score(batch).topk_ids)[0, 0, 0]) == want


@pytest.mark.parametrize("mapping", ["spans", "byte_prefix"])
def test_an_environment_mask_of_no_observation_scores_as_single_turn(scored, mapping):
    """Both mappings read a batch whose environment mask marks nothing as they read one with
    none (trajectories with observations: ``tests/teacher/test_trajectory_spans.py``)."""
    from asyncopd_jax.teacher import TeacherScorer
    from asyncopd_jax.teacher.cross_tokenizer import CrossTokenizerTeacher

    pair, teacher, batch, _, _, local = scored
    if mapping == "spans":
        scorer = CrossTokenizerTeacher(TeacherScorer(teacher, ScoringParams(topk=4), pad_rows=True), pair, 128, "t")
    else:
        scorer = BytePrefixTeacher(local.trees, pair, ScoringParams(), "t")
    environment = jnp.zeros(np.shape(batch.response_mask), bool)
    single, marked = scorer.score(batch), scorer.score(dataclasses.replace(batch, environment_mask=environment))
    mask = np.asarray(batch.response_mask)
    np.testing.assert_array_equal(np.asarray(marked.token_logp)[mask], np.asarray(single.token_logp)[mask])
    np.testing.assert_array_equal(np.asarray(marked.topk_logp)[mask], np.asarray(single.topk_logp)[mask])
