"""The calculator tool: exact arithmetic from the syntax tree, everything else refused in one line."""

from __future__ import annotations

import pytest

from asyncopd_jax.environments import Calculator
from asyncopd_jax.environments.calculator import MAX_EXPONENT, evaluate


@pytest.mark.parametrize(
    "expression, value",
    [
        ("12*34", "408"),
        ("123456789 * 987654321", "121932631112635269"),  # exact: past float's 2^53
        ("(7 + 5) // 5 - -3", "5"),
        ("6/3", "2"),
        ("7/2", "3.5"),
        ("2 ** 100", str(2**100)),
        ("17 % 5", "2"),
        ("+1.5 * 2", "3"),
    ],
)
def test_it_computes_exactly(expression, value):
    assert Calculator()({"expression": expression}) == value


@pytest.mark.parametrize(
    "expression, says",
    [
        ("__import__('os').system('true')", "not Call"),
        ("x + 1", "not Name"),
        ("1 < 2", "not Compare"),
        ("1/0", "division by zero"),
        (f"2 ** {MAX_EXPONENT + 1}", "exponent"),
        ("(-1) ** 0.5", "not a real number"),
        ("9" * 1001, "1001 characters"),
        ("1 +", "not an arithmetic expression"),
        ("10 ** 1000 * 10 ** 1000 * 10 ** 1000 * 10 ** 1000 * 10 ** 1000", "more than 4300 digits"),
    ],
)
def test_anything_else_is_refused_in_one_line(expression, says):
    with pytest.raises(ValueError, match=says):
        evaluate(expression)


def test_it_takes_an_expression_argument():
    with pytest.raises(ValueError, match='calculator takes {"expression"'):
        Calculator()({"expr": "1+1"})
