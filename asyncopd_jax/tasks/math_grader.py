"""Grading a model's answer to a math problem against a reference answer.

The reward of reward-driven RL on user datasets (``GSM8K``-, ``MATH``-style: a final number
or a ``\\boxed{}`` expression). Two steps, both pure Python:

1. :func:`extract_answer` finds the final answer in a response: the content of the last
   ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces allowed), else what follows the last
   "answer is" / "Answer:" / "####", else the last number in the text.
2. :func:`answers_match` compares two answers after :func:`normalize`: numerically where
   both sides read as numbers (``1,000`` = ``1000``, ``\\frac{1}{2}`` = ``1/2`` = ``0.5``,
   ``50\\%`` = ``50``, ``-3`` = ``−3``; relative tolerance 1e-6), else as normalised strings
   (spaces, ``\\left``/``\\right``, ``\\dfrac``/``\\tfrac``, ``\\text{…}`` units and a
   trailing period removed).

Units and words after a number are dropped (``5 cm``, ``$12.50``, ``\\text{ dollars}``), so
an answer is judged by its value. What is *not* attempted: symbolic equivalence of
expressions (``x^2-1`` vs ``(x-1)(x+1)``), intervals and sets beyond string equality.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED = ("\\boxed", "\\fbox")
_ANSWER_CUES = re.compile(r"(?:final answer|the answer|answer)\s*(?:is|:|=)\s*|####\s*", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_SHORT_FRAC = re.compile(r"\\[dt]?frac(\d)(\d)")  # \frac12
_UNIT_TAIL = re.compile(r"(?<=[\d.}])\s*(?:[a-zA-Z][a-zA-Z .]*)$")  # "5 cm", "12 dollars"


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind(cue) for cue in _BOXED)
    if start < 0:
        return None
    open_at = text.find("{", start)
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at + 1 : i]
    return None  # unbalanced: no answer


def extract_answer(response: str) -> str | None:
    """The final answer in a model's response, or ``None`` if it gives none."""
    boxed = _last_boxed(response)
    if boxed is not None:
        return boxed.strip()
    cues = list(_ANSWER_CUES.finditer(response))
    if cues:
        tail = response[cues[-1].end() :].strip()
        line = tail.splitlines()[0].strip() if tail else ""
        if line:
            return line.rstrip(".")
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def normalize(answer: str) -> str:
    """A canonical string for an answer: LaTeX wrappers, units, thousands separators and
    spacing removed; ``\\frac{a}{b}`` written ``(a)/(b)``."""
    s = answer.strip().replace("−", "-").replace("\\!", "").replace("\\,", "").replace("\\ ", " ")
    s = s.strip("$").replace("\\$", "").replace("$", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("^\\circ", "").replace("^{\\circ}", "")
    s = s.replace("\\%", "").replace("%", "")
    s = _TEXT.sub(lambda m: " " + m.group(1), s)
    s = _SHORT_FRAC.sub(r"(\1)/(\2)", s)
    while _FRAC.search(s):
        s = _FRAC.sub(r"(\1)/(\2)", s)
    s = s.strip().rstrip(".").strip()
    s = _UNIT_TAIL.sub("", s).strip()
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):  # 1,000 or 12,345.5 (not a pair "1,2")
        s = s.replace(",", "")
    return re.sub(r"\s+", "", s)


def _as_number(s: str) -> Fraction | None:
    """``s`` (normalised) as an exact number: an integer, a decimal, ``a/b`` or ``(a)/(b)``."""
    m = re.fullmatch(r"\(?(-?\d+(?:\.\d+)?)\)?/\(?(-?\d+(?:\.\d+)?)\)?", s)
    try:
        if m:
            return Fraction(m.group(1)) / Fraction(m.group(2))
        if re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)", s):
            return Fraction(s)
    except ZeroDivisionError:
        return None
    return None


def answers_match(answer: str | None, reference: str, rel_tol: float = 1e-6) -> bool:
    """Whether ``answer`` (as extracted) equals ``reference`` by value or by normalised text."""
    if answer is None:
        return False
    a, b = normalize(answer), normalize(reference)
    if not a:
        return False
    x, y = _as_number(a), _as_number(b)
    if x is not None and y is not None:
        return abs(x - y) <= rel_tol * max(abs(x), abs(y), Fraction(1))
    return a == b


def grade(response: str, reference: str) -> float:
    """The reward of a response: 1.0 if its final answer matches ``reference``, else 0.0."""
    return float(answers_match(extract_answer(response), reference))


__all__ = ["answers_match", "extract_answer", "grade", "normalize"]
