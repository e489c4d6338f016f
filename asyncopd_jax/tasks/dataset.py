"""User datasets: prompts, and optionally reference answers, from a JSONL or Parquet file.

One example per line (JSONL: a JSON object per non-empty line) or per row (Parquet, read
with ``pyarrow``: ``pip install "asyncopd-jax[parquet]"``). The prompt and answer are
fields of each example, named by the config; a dotted name reaches into nested objects
(``meta.question``). The answer is optional for distillation (the teacher is the signal;
with answers, held-out accuracy is measured too) and required for reward-driven RL.

A fixed, hash-defined share of the examples (by prompt text, so it does not move when the
file is reordered or grows) is held out for evaluation and never trained on, as in the
built-in task.

Bad input fails before anything runs, naming the file, the field and the rows at fault:

    data.jsonl: rows 3, 17 have no field 'question' (task.prompt_field); row 1 has: problem, solution
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from asyncopd_jax.storage.local_copy import resolve_location
from asyncopd_jax.teacher.prompts import field

SUFFIXES = (".jsonl", ".parquet")
_SHOWN_ROWS = 10  # rows named in an error message
_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt of a dataset. ``row``: its 1-based line (JSONL) or row (Parquet)."""

    prompt: str
    answer: str | None
    row: int
    # every field of the row (a teacher-only prompt's template and a routing field read them);
    # left out of equality and hashing: the prompt, answer and row identify an example
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)


class DatasetError(ValueError):
    """A dataset file that cannot be used as configured; the message says where and why."""


@dataclasses.dataclass(frozen=True)
class _BadRow:
    """A row that could not be parsed: what is wrong (``kind``) and the parser's detail.
    Yielded rather than raised, so that every such row of the file is named at once."""

    kind: str
    detail: str


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based row number, parsed row or :class:`_BadRow`) for every non-empty row."""
    if path.suffix == ".jsonl":
        with path.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                try:
                    # utf-8-sig: a byte-order mark some editors write before the first row
                    line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
                except UnicodeDecodeError as err:
                    yield number, _BadRow("not UTF-8 text", f"byte {err.start + 1}")
                    continue
                if not line.strip():
                    continue
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as err:
                    yield number, _BadRow("not valid JSON", f"{err.msg}, column {err.colno}")
    elif path.suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(f'{path}: reading Parquet needs pyarrow: pip install "asyncopd-jax[parquet]"') from None
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as err:  # not Parquet, truncated, …
            raise DatasetError(
                f"{path}: cannot be read as Parquet ({' '.join(str(err).split())}); "
                "the file is truncated or corrupt: write it again"
            ) from None
        for number, row in enumerate(table.to_pylist(), start=1):
            yield number, row
    else:
        raise DatasetError(f"{path}: unsupported dataset format {path.suffix!r}; allowed: {', '.join(SUFFIXES)}")


def rows_text(rows: list[int]) -> str:
    """``row 3`` / ``rows 3, 17`` (at most ten named, then how many more)."""
    shown = ", ".join(map(str, rows[:_SHOWN_ROWS]))
    more = f" and {len(rows) - _SHOWN_ROWS} more" if len(rows) > _SHOWN_ROWS else ""
    return f"row {shown}" if len(rows) == 1 else f"rows {shown}{more}"


def read_examples(
    path: str | Path, prompt_field: str, answer_field: str | None = None, *, require_answers: bool = False
) -> list[Example]:
    """Every example of ``path``; a :class:`DatasetError` naming the rows at fault (all of
    them, not just the first) if any row is not a JSON object (invalid JSON, not UTF-8, an
    array, …), lacks the prompt field (or, with ``require_answers``, the answer field, or
    holds a null answer), or holds a prompt that is not a non-empty string. A Parquet file
    that cannot be read is named too. ``path`` may be a bucket URL (read through its local
    copy, :mod:`asyncopd_jax.storage.local_copy`)."""
    path = resolve_location(path)
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    if require_answers and not answer_field:
        raise DatasetError(f"{path}: task.answer_field must name the reference answers (reward-driven RL needs them)")
    examples: list[Example] = []
    missing: dict[str, list[int]] = {}
    bad: dict[str, list[tuple[int, str]]] = {}  # kind → (row, detail): unparsable rows, non-objects
    not_text: list[int] = []
    null_answers: list[int] = []
    first_keys: tuple[int, list[str]] | None = None  # the first object row: its number and fields
    for number, row in _rows(path):
        if not isinstance(row, (dict, _BadRow)):
            row = _BadRow("not a JSON object", f"a JSON {_JSON_TYPES.get(type(row), type(row).__name__)}")
        if isinstance(row, _BadRow):
            bad.setdefault(row.kind, []).append((number, row.detail))
            continue
        if first_keys is None:
            first_keys = (number, sorted(row))
        try:
            prompt = field(row, prompt_field)
        except KeyError:
            missing.setdefault(f"{prompt_field!r} (task.prompt_field)", []).append(number)
            continue
        answer = None
        if answer_field:
            try:
                answer = field(row, answer_field)
            except KeyError:
                if require_answers:
                    missing.setdefault(f"{answer_field!r} (task.answer_field)", []).append(number)
                    continue
            if answer is None and require_answers:  # a JSON null would pass as "no answer" into the rewards
                null_answers.append(number)
                continue
        if not isinstance(prompt, str) or not prompt.strip():
            not_text.append(number)
            continue
        examples.append(Example(prompt, None if answer is None else str(answer), number, row))
    problems = []
    for kind, rows in bad.items():
        # The parser's detail for the first row only: it differs from row to row.
        numbers, (first, detail) = [n for n, _ in rows], rows[0]
        problems.append(
            f"{rows_text(numbers)} is {kind} ({detail})"
            if len(rows) == 1
            else f"{rows_text(numbers)} are {kind} (row {first}: {detail})"
        )
    problems += [
        f"{rows_text(rows)} have no field {what}" if len(rows) > 1 else f"{rows_text(rows)} has no field {what}"
        for what, rows in missing.items()
    ]
    if not_text:
        problems.append(f"{rows_text(not_text)}: the prompt is not a non-empty string")
    if null_answers:
        problems.append(f"{rows_text(null_answers)}: the answer {answer_field!r} (task.answer_field) is null")
    if problems:
        keys = f"; row {first_keys[0]} has: {', '.join(first_keys[1])}" if first_keys and first_keys[1] else ""
        raise DatasetError(f"{path}: " + "; ".join(problems) + keys)
    if not examples:
        raise DatasetError(f"{path}: no examples (the file is empty)")
    return examples


def is_held_out(example: Example, fraction: float) -> bool:
    """Whether ``example`` belongs to the held-out share (a fixed hash of its prompt)."""
    digest = hashlib.blake2b(example.prompt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def split_held_out(examples: list[Example], fraction: float) -> tuple[list[Example], list[Example]]:
    """(training examples, held-out examples); ``fraction`` of them, by prompt hash, held out."""
    if not 0.0 <= fraction < 1.0:
        raise DatasetError(f"task.eval_fraction = {fraction} is invalid; allowed: 0 <= fraction < 1")
    held = [e for e in examples if is_held_out(e, fraction)]
    train = [e for e in examples if not is_held_out(e, fraction)]
    if not train:
        raise DatasetError(f"every example is held out (task.eval_fraction = {fraction}); nothing to train on")
    return train, held


__all__ = ["DatasetError", "Example", "is_held_out", "read_examples", "rows_text", "split_held_out"]
