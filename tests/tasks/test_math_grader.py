"""The math-answer grader on the formats models really write."""

from __future__ import annotations

import pytest

from asyncopd_jax.tasks.math_grader import answers_match, extract_answer, grade, normalize


@pytest.mark.parametrize(
    "response,answer",
    [
        ("so the total is \\boxed{42}.", "42"),
        ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box
        ("\\boxed{\\{1, 2\\}} wait \\boxed{x^{2}+\\sqrt{y_{1}}}", "x^{2}+\\sqrt{y_{1}}"),  # nested braces
        ("\\fbox{7}", "7"),
        ("She has 3 apples and 4 pears.\n#### 7", "7"),
        ("Therefore, the final answer is $1,000$.", "$1,000$"),
        ("Answer: 12 cm\nThat is all.", "12 cm"),
        ("3 + 4 = 7, and 7 * 2 = 14", "14"),  # the last number
        ("-3.5 is less than .5", ".5"),
        ("no digits here", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_extract_answer(response, answer):
    assert extract_answer(response) == answer


@pytest.mark.parametrize(
    "answer,reference",
    [
        ("1,000", "1000"),
        ("$1,000$", "1000"),
        ("12,345.5", "12345.5"),
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac{1}{2}", "1/2"),
        ("\\tfrac12", "0.5"),
        ("\\frac{\\frac{1}{2}}{2}", "\\frac{\\frac{1}{2}}{2}"),  # not a plain number: equal as text
        ("0.50", "1/2"),
        ("−3", "-3"),
        ("5 cm", "5"),
        ("5\\text{ cm}", "5"),
        ("\\$12.50", "12.5"),
        ("12 dollars.", "12"),
        ("50\\%", "50"),
        ("90^\\circ", "90"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("x^2 + 1", "x^2+1"),
        ("0.3333333", "1/3"),  # within the tolerance (1e-6 of max(|a|, |b|, 1))
        ("1000000.5", "1000000"),  # 5e-7 relative
    ],
)
def test_equal_answers_match(answer, reference):
    assert answers_match(answer, reference), (normalize(answer), normalize(reference))


@pytest.mark.parametrize(
    "answer,reference",
    [
        ("1,2", "12"),  # a pair, not a thousands separator
        ("0.51", "0.5"),
        ("-5", "5"),
        ("\\frac{1}{3}", "0.33"),
        ("0.333", "1/3"),
        ("1000002", "1000000"),  # 2e-6 relative
        ("x^2-1", "(x-1)(x+1)"),  # no symbolic equivalence (documented)
        ("", "0"),
        ("1/0", "0"),
    ],
)
def test_different_answers_do_not_match(answer, reference):
    assert not answers_match(answer, reference)


def test_no_answer_gets_no_reward():
    assert answers_match(None, "3") is False
    assert grade("I do not know", "3") == 0.0
    assert grade("The answer is \\boxed{3}", "3.0") == 1.0
    assert grade("The answer is \\boxed{4}", "3") == 0.0
