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

Long-tailed lengths (``task.lengths = long_tailed``): each problem's operand count ``k`` is
drawn from ``m = task.difficulty`` to ``M = task.max_operands`` by a Zipf law truncated at M,

    P(k) = (k − m + 1) ** −α / Σ_{j=1}^{M−m+1} j ** −α        (α = task.tail_exponent),

and its operands are distinct values (a chain of 40 additions is easier to follow when no
value repeats; so M ≤ max_value + 1). At α = 2, m = 2, M = 40 (``configs/long_tailed.yaml``):
P(2) = 0.617, P(k ≥ 10) = 0.057, P(k ≥ 20) = 0.018, P(40) = 0.0004; the operand count's
median, p90 and p99 are 2, 6 and 25. The answer (the chain of partial sums with its
``<eos>``, one token per character, ~12 per operand once the sums have three digits), over
100,000 problems drawn with seed 0: median 16 tokens, p90 60, p99 280, max 484, min 10;
the worst case (40 operands of 99) is 494 tokens after a 122-token prompt.
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


def long_tailed_probabilities(minimum: int, maximum: int, exponent: float) -> np.ndarray:
    """P(k) for ``k = minimum … maximum`` operands under the long-tailed law (index ``k - minimum``):
    ``P(k) ∝ (k − minimum + 1) ** −exponent``, a Zipf law truncated at ``maximum``."""
    weights = np.arange(1, maximum - minimum + 2, dtype=np.float64) ** -exponent
    return weights / weights.sum()


def operand_counts(rng: np.random.Generator, n: int, minimum: int, maximum: int, exponent: float) -> np.ndarray:
    """``n`` operand counts drawn independently from :func:`long_tailed_probabilities`."""
    probabilities = long_tailed_probabilities(minimum, maximum, exponent)
    return minimum + rng.choice(len(probabilities), size=n, p=probabilities)


def problems_with_counts(
    rng: np.random.Generator, counts, max_value: int, *, held_out: bool, distinct: bool = False
) -> list[Problem]:
    """One problem of ``counts[i]`` operands per count, from the given split (operands redrawn
    until the problem falls in it); ``distinct``: no operand value twice in a problem."""
    out: list[Problem] = []
    for k in counts:
        while True:
            if distinct:
                values = rng.choice(max_value + 1, size=int(k), replace=False)
            else:
                values = rng.integers(0, max_value + 1, size=int(k))
            p = Problem(tuple(int(x) for x in values))
            if is_held_out(p) == held_out:
                out.append(p)
                break
    return out


def sample_problems(
    rng: np.random.Generator,
    n: int,
    difficulty: int,
    max_value: int,
    *,
    held_out: bool,
    lengths: str = "fixed",
    max_operands: int = 40,
    tail_exponent: float = 2.0,
) -> list[Problem]:
    """``n`` problems from the training split (``held_out=False``) or the evaluation split.

    ``lengths="fixed"``: ``difficulty`` operands each. ``lengths="long_tailed"``: the operand
    count of each problem is drawn from :func:`long_tailed_probabilities` with
    ``minimum = difficulty`` and ``maximum = max_operands`` (see the module docstring).
    """
    if difficulty < 2:
        raise ValueError(f"task.difficulty = {difficulty} is invalid; allowed: >= 2 (operands per problem)")
    if lengths == "long_tailed":
        counts = operand_counts(rng, n, difficulty, max_operands, tail_exponent)
        return problems_with_counts(rng, counts, max_value, held_out=held_out, distinct=True)
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
