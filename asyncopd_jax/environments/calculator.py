"""The built-in calculator tool: exact arithmetic on integers and decimals.

An expression of numbers, ``+ - * / // % **`` and parentheses is evaluated from its Python
syntax tree, node by node (never ``eval``): a name, a call, an attribute or any other node is
refused. Integers stay exact; ``/`` gives a float (an integral one is written as an integer).
Bounds keep one call cheap: the expression's length, the exponent of ``**`` and the result's
size; past one, the call raises :class:`ValueError` with one line saying which (an
observation's error, through the environment).
"""

from __future__ import annotations

import ast
import operator
from typing import Any

#: The longest expression a call takes, in characters.
MAX_EXPRESSION = 1000

#: The largest exponent of ``**`` (2 ** 1000 is 302 digits).
MAX_EXPONENT = 1000

#: The most digits a result (or an intermediate one) may have.
MAX_DIGITS = 4300

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Any] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Calculator:
    """The ``calculator`` tool: ``{"expression": "12*34"}`` → ``"408"``."""

    name = "calculator"

    def __call__(self, arguments: dict[str, Any]) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise ValueError('calculator takes {"expression": "<arithmetic>"}')
        return format_number(evaluate(expression))


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression`` (module docstring)."""
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"the expression has {len(expression)} characters; at most {MAX_EXPRESSION}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression[:80]!r}") from None
    return _value(tree.body)


def format_number(value: int | float) -> str:
    """``value`` as the tool writes it: an integral float as an integer (``6/3`` → ``2``)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(value)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value  # type: ignore[return-value]  # an int or a float: checked just above
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"the exponent {right} is too large; at most {MAX_EXPONENT}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the result is too large") from None
        if isinstance(result, complex):
            raise ValueError("the result is not a real number")
        if isinstance(result, int) and result.bit_length() > MAX_DIGITS * 3.33:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
        return result
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}")
