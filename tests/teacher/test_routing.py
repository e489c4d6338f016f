"""Several teachers: the router's choice per prompt (a mixture by weight, or a dataset
field), each teacher's own prompt, and the scoring stage scoring every row with its own
teacher, under its own prompt."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.sampling import Sampler, SamplingParams
from asyncopd_jax.teacher import ReferenceScorer, Scorers, ScoringParams, TeacherScorer
from asyncopd_jax.teacher.routing import RoutedTeacher, Router, RoutingParams, TeacherRoute
from tests.tiny_models import tiny_decoder

ITEMS = [{"prompt": f"p{i}", "teacher_id": "ab"[i % 3 == 0], "row": i + 1} for i in range(9)]


def where(items) -> str:
    return "rows " + ", ".join(str(i["row"]) for i in items)


def encode(texts: list[str]) -> list[list[int]]:
    """A stand-in tokenizer: one id per character (its code point mod 50, + 3)."""
    return [[3 + ord(c) % 50 for c in t] for t in texts]


def router(teachers, by="mixture", items=ITEMS, student_slots=4) -> Router:
    return Router(
        teachers,
        RoutingParams(by=by),
        fields=lambda item: item,
        items=lambda: items,
        where=where,
        pad_id=0,
        student_slots=student_slots,
    )


def test_a_mixture_draws_each_prompts_teacher_by_weight_from_the_groups_generator():
    r = router([RoutedTeacher("a", 3.0), RoutedTeacher("b", 1.0)])
    prompts = [[5]] * 4000
    route = r.route([ITEMS[0]] * 4000, prompts, np.random.default_rng(7))
    assert route is not None and route.prompt_tokens is None
    assert route.teacher.dtype == np.int32 and abs(np.mean(route.teacher == 0) - 0.75) < 0.03
    again = r.route([ITEMS[0]] * 4000, prompts, np.random.default_rng(7))
    np.testing.assert_array_equal(route.teacher, again.teacher)  # the same group routes the same way
    np.testing.assert_array_equal(route.counts(3), [np.sum(route.teacher == 0), np.sum(route.teacher == 1), 0])


def test_the_answers_to_one_prompt_share_its_teacher():
    r = router([RoutedTeacher("a"), RoutedTeacher("b")])
    route = r.route(ITEMS[:6], [[5]] * 6, np.random.default_rng(0), copies=3)
    assert route.teacher.shape == (18,)
    np.testing.assert_array_equal(route.teacher.reshape(6, 3), np.repeat(route.teacher[::3, None], 3, axis=1))


def test_a_field_routes_each_row_to_the_teacher_it_names():
    r = router([RoutedTeacher("a"), RoutedTeacher("b")], by="field")
    route = r.route(ITEMS, [[5]] * 9, np.random.default_rng(0))
    np.testing.assert_array_equal(route.teacher, [1, 0, 0, 1, 0, 0, 1, 0, 0])  # "b" at rows 0, 3, 6
    np.testing.assert_array_equal(route.rows(1), [0, 3, 6])


def test_rows_naming_no_teacher_or_lacking_the_field_are_named_at_start_up():
    items = [*ITEMS[:2], {"prompt": "x", "teacher_id": "c", "row": 31}, {"prompt": "y", "row": 32}]
    with pytest.raises(ValueError) as err:
        router([RoutedTeacher("a"), RoutedTeacher("b")], by="field", items=items)
    assert str(err.value) == (
        "rows 32 have no field 'teacher_id' (routing.field); rows 31: teacher_id = 'c' names no teacher; allowed: a, b"
    )


def test_one_teacher_under_the_students_prompt_needs_no_route():
    r = router([RoutedTeacher("a")])
    assert not r.needed and r.route(ITEMS, [[5]] * 9, np.random.default_rng(0)) is None


def test_a_teacher_with_its_own_prompt_gets_it_left_padded_and_the_other_keeps_the_students():
    r = router([RoutedTeacher("a", template="T{prompt}!!", encode=encode), RoutedTeacher("b")], by="field")
    assert r.prompt_slots == 5  # one width for every group: the longest own prompt ("Tp0!!"), above the student's 4
    assert router([RoutedTeacher("a", template="{prompt}", encode=encode)], student_slots=4).prompt_slots == 4
    student = [[9, 9, 9], [8, 8], [7]]
    route = r.route(ITEMS[:3], student, np.random.default_rng(0))
    assert route.prompt_tokens.shape == route.prompt_mask.shape == (3, 5)
    np.testing.assert_array_equal(route.prompt_tokens[0], [0, 0, 9, 9, 9])  # "b" scores under the student's prompt
    np.testing.assert_array_equal(route.prompt_mask[0], [False, False, True, True, True])
    np.testing.assert_array_equal(route.prompt_tokens[1], encode(["Tp1!!"])[0])  # "a" under its own
    np.testing.assert_array_equal(route.prompt_mask[1], [True] * 5)


def test_a_template_naming_a_field_the_items_lack_fails_at_start_up():
    with pytest.raises(
        ValueError, match=r"teacher 'a': prompt.template names the field 'solution', which rows 1 lacks"
    ):
        router([RoutedTeacher("a", template="{solution}", encode=encode)])


# --- the scoring stage: each row scored by its own teacher ------------------------------------


@pytest.fixture(scope="module")
def rollouts():
    """Answers of a tiny student to 6 prompts, with 2 candidates per position."""
    graphdef, state = nnx.split(tiny_decoder(0, scale=0.7))
    params = SamplingParams(temperature=1.0, max_new_tokens=7, num_candidates=2)
    prompts = [[2, 5 + i, 12, 6 + i] for i in range(6)]
    return Sampler(graphdef, params).generate(state, prompts, jax.random.key(3))


def test_every_row_is_scored_by_its_own_teacher_under_its_own_prompt(rollouts):
    """Rows 0, 2, 3 go to teacher "a" (under a 6-token prompt of its own), rows 1, 4, 5 to
    "b" (the student's prompt, another temperature); each row's every field equals that
    row scored alone by its teacher, and the reference scores every row under the student's."""
    params = ScoringParams(topk=3, chunk_size=4)
    a = TeacherScorer(tiny_decoder(1, scale=0.7), params, pad_rows=True)
    b = TeacherScorer(tiny_decoder(2, scale=0.7), dataclasses.replace(params, temperature=0.7), pad_rows=True)
    reference = ReferenceScorer(tiny_decoder(4, scale=0.7))
    own = np.asarray([[3, 4, 5, 6, 7, 8]] * 6, np.int32)  # teacher "a"'s prompt; rows of "b" hold the student's
    student = np.asarray(rollouts.prompt_tokens)
    own[[1, 4, 5], :2], own[[1, 4, 5], 2:] = 0, student[[1, 4, 5]]
    mask = np.ones_like(own, bool)
    mask[[1, 4, 5], :2] = False
    route = TeacherRoute(np.asarray([0, 1, 0, 0, 1, 1], np.int32), own, mask)
    scored = Scorers({"a": a, "b": b}, reference).score(rollouts, jax.random.key(0), route)
    assert {n: (u.rows, u.requests) for n, u in scored.uses.items()} == {"a": (3, 1), "b": (3, 1)}
    answer = np.asarray(rollouts.response_mask)
    for row, (teacher, prompt) in enumerate([(a, own[0]), (b, None), (a, own[2]), (a, own[3]), (b, None), (b, None)]):
        alone = jax.tree_util.tree_map(lambda x: x[row : row + 1], rollouts)
        if prompt is not None:
            alone = dataclasses.replace(
                alone, prompt_tokens=jnp.asarray(prompt[None]), prompt_mask=jnp.ones((1, 6), bool)
            )
        want = teacher.score(alone, jax.random.key(0))
        for f in ("token_logp", "topk_logp", "topk_ids", "candidate_logp"):
            got = np.asarray(getattr(scored.cache, f))[row][answer[row]]
            np.testing.assert_allclose(
                got, np.asarray(getattr(want, f))[0][answer[row]], atol=1e-5, err_msg=f"{row} {f}"
            )
    whole = reference.score(rollouts)  # under the student's prompt, every row
    np.testing.assert_allclose(np.asarray(scored.batch.reference_logp)[answer], np.asarray(whole)[answer], atol=1e-5)


def test_padded_rows_score_as_the_rows_alone(rollouts):
    """A routed teacher's 3 rows are scored as 4 (a power of two: one compiled shape per
    power) and cut back: the same scores as scoring the 3."""
    params = ScoringParams(topk=2, chunk_size=8)
    model = tiny_decoder(1, scale=0.7)
    three = jax.tree_util.tree_map(lambda x: x[:3], rollouts)
    padded = TeacherScorer(model, params, pad_rows=True)
    calls = []
    score = padded._score
    padded._score = lambda s, batch, k: calls.append(batch.response_tokens.shape[0]) or score(s, batch, k)
    got, want = padded.score(three), TeacherScorer(model, params).score(three)
    assert calls == [4]
    for f in ("token_logp", "topk_logp", "topk_ids"):
        assert getattr(got, f).shape[0] == 3
        np.testing.assert_allclose(np.asarray(getattr(got, f)), np.asarray(getattr(want, f)), atol=1e-6, err_msg=f)


def test_a_teacher_routed_no_rows_is_not_called(rollouts):
    params = ScoringParams(chunk_size=8)
    a, b = TeacherScorer(tiny_decoder(1), params), TeacherScorer(tiny_decoder(2), params)
    b.score = None  # type: ignore[method-assign]  # called: a TypeError
    route = TeacherRoute(np.zeros(6, np.int32))
    scored = Scorers({"a": a, "b": b}).score(rollouts, jax.random.key(0), route)
    assert scored.uses["b"].rows == 0 and scored.uses["a"].rows == 6
    np.testing.assert_allclose(scored.cache.token_logp, a.score(rollouts, jax.random.key(0)).token_logp, atol=1e-6)
