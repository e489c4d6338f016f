"""The built-in task: multi-operand addition with a chain of partial sums.

A problem is ``k`` operands (``k`` = the difficulty knob) drawn from ``[0, max_value]``:

    prompt:    Q:23+58+14=
    response:  58+14=72;72+23=95;A=95<eos>        (one of several valid solutions)

Any order of summation is a valid solution, so a teacher trained on all orders has a
genuinely multi-modal per-token distribution: at the first response token it spreads its
mass over every operand (``k`` modes), and at each later step over the operands not yet
used. Forward KL (mass-covering), reverse KL (mode-seeking) and top-K truncation
therefore differ on this task. The verifier checks only the final answer after ``A=``.

Held-out problems are a fixed hash-defined tenth of all problems, never used in training.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

import numpy as np

CHARS = "0123456789+=;:AQ"
_ANSWER = re.compile(r"A=(\d+)$")


@dataclasses.dataclass(frozen=True)
class Problem:
    operands: tuple[int, ...]

    @property
    def answer(self) -> int:
        return sum(self.operands)

    @property
    def prompt(self) -> str:
        return "Q:" + "+".join(map(str, self.operands)) + "="

    def solution(self, order: tuple[int, ...]) -> str:
        """The chain of partial sums adding the operands in ``order`` (a permutation of indices)."""
        values = [self.operands[i] for i in order]
        steps, total = [], values[0]
        for v in values[1:]:
            steps.append(f"{total}+{v}={total + v}")
            total += v
        return ";".join(steps) + f";A={total}"


def is_held_out(problem: Problem) -> bool:
    """A fixed tenth of all problems (by a hash of the sorted operands) is for evaluation only."""
    key = ",".join(map(str, sorted(problem.operands))).encode()
    return hashlib.blake2b(key, digest_size=2).digest()[0] % 10 == 0


def sample_problems(
    rng: np.random.Generator, n: int, difficulty: int, max_value: int, *, held_out: bool
) -> list[Problem]:
    """``n`` problems from the training split (``held_out=False``) or the evaluation split."""
    if difficulty < 2:
        raise ValueError(f"task.difficulty = {difficulty} is invalid; allowed: >= 2 (operands per problem)")
    out: list[Problem] = []
    while len(out) < n:
        p = Problem(tuple(int(x) for x in rng.integers(0, max_value + 1, size=difficulty)))
        if is_held_out(p) == held_out:
            out.append(p)
    return out


def random_solution(rng: np.random.Generator, problem: Problem) -> str:
    """A solution with a uniformly random order of summation (SFT data for the teacher)."""
    return problem.solution(tuple(int(i) for i in rng.permutation(len(problem.operands))))


def verify(problem: Problem, response: str) -> bool:
    """True iff the response ends with ``A=<the correct sum>``."""
    match = _ANSWER.search(response.strip())
    return match is not None and int(match.group(1)) == problem.answer
