"""The built-in tool task: a product plus a sum, ``a·b + c``, whose exact value the
calculator gives and a small model's own arithmetic does not.

A trajectory alternates student turns and the calculator's observations::

    prompt:       Q:37*58+12=
    turn 1:       C:37*58+12<eos>          a call: `C:` and the expression
    observation:  R:2158;                  the calculator's answer (environment tokens)
    turn 2:       A=2158<eos>              the answer: a turn without a call ends the episode

A call that does not evaluate (a malformed expression, a number past the calculator's
bounds) is answered ``R:E;``. Two tool habits, for teachers that call differently:
``whole`` (one call with the whole expression, above) and ``steps`` (the product first,
then the sum: ``C:37*58`` → ``R:2146;`` → ``C:2146+12`` → ``R:2158;`` → ``A=2158``). The
verifier reads the answer of the last turn only. Held-out problems are a fixed hash-defined
tenth of all problems, as in :mod:`asyncopd_jax.tasks.arith`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Literal

import numpy as np

from asyncopd_jax.environments.calculator import Calculator
from asyncopd_jax.environments.protocol import ToolCall
from asyncopd_jax.environments.tool_calls import ParsedTurn
from asyncopd_jax.environments.tool_environment import ToolEnvironment
from asyncopd_jax.tasks.arith import CHARS as ARITH_CHARS

CHARS = ARITH_CHARS + "*CRE"  # the tool tokenizer's characters: the arithmetic task's, a product, call, result, error
CALL, RESULT = "C:", "R:"
Habit = Literal["whole", "steps", "none"]
HABITS: tuple[Habit, ...] = ("whole", "steps", "none")
_ANSWER = re.compile(r"A=(\d+)$")


@dataclasses.dataclass(frozen=True)
class ToolProblem:
    """``a·b + c``."""

    a: int
    b: int
    c: int

    @property
    def answer(self) -> int:
        return self.a * self.b + self.c

    @property
    def prompt(self) -> str:
        return f"Q:{self.a}*{self.b}+{self.c}="

    def trajectory(self, habit: Habit = "whole") -> list[tuple[str, str]]:
        """The teacher's turns with the observations after them (the last turn's: empty)."""
        if habit == "none":  # no tool: the answer at once
            return [(f"A={self.answer}", "")]
        if habit == "steps":
            product = self.a * self.b
            calls = [f"{self.a}*{self.b}", f"{product}+{self.c}"]
            results = [product, self.answer]
        else:
            calls, results = [f"{self.a}*{self.b}+{self.c}"], [self.answer]
        turns = [(CALL + call, render([str(value)])) for call, value in zip(calls, results)]
        return turns + [(f"A={self.answer}", "")]


def is_held_out(problem: ToolProblem) -> bool:
    """A fixed tenth of all problems (by a hash of the operands) is for evaluation only."""
    key = f"{problem.a},{problem.b},{problem.c}".encode()
    return hashlib.blake2b(key, digest_size=2).digest()[0] % 10 == 0


def sample_problems(rng: np.random.Generator, n: int, max_value: int, *, held_out: bool) -> list[ToolProblem]:
    """``n`` problems of operands in ``[10, max_value]`` (two-digit and up: products a small
    model cannot do in its head) from one split."""
    if max_value < 10:
        raise ValueError(f"task.max_value = {max_value} is invalid for the tool task; allowed: >= 10")
    out: list[ToolProblem] = []
    while len(out) < n:
        a, b, c = (int(x) for x in rng.integers(10, max_value + 1, size=3))
        problem = ToolProblem(a, b, c)
        if is_held_out(problem) == held_out:
            out.append(problem)
    return out


def parse_turn(text: str) -> ParsedTurn:
    """A turn ``C:<expression>`` is a calculator call; any other turn calls nothing."""
    text = text.strip()
    if not text.startswith(CALL):
        return ParsedTurn([], [])
    return ParsedTurn([ToolCall(Calculator.name, {"expression": text[len(CALL) :]})], [])


def render(outputs: list[str]) -> str:
    """The observation of a turn's outputs: ``R:<value>;`` each, ``R:E;`` for one that is
    not a whole number (an error, a fraction): the task's characters only."""
    return "".join(RESULT + (out if out.isdigit() else "E") + ";" for out in outputs)


def environment(max_turns: int = 4) -> ToolEnvironment:
    """A problem's environment: the calculator, in this task's format."""
    return ToolEnvironment([Calculator()], max_turns=max_turns, parse=parse_turn, render=render)


def verify(problem: ToolProblem, response: str) -> bool:
    """True iff the last turn is ``A=<a·b + c>`` (``response``: the trajectory's student
    text, turns and observations in order)."""
    match = _ANSWER.search(response.strip())
    return match is not None and int(match.group(1)) == problem.answer
