"""Several teachers: which one scores each prompt, and under which prompt.

A run with ``teachers: [...]`` scores every rollout row with exactly one of them. The
:class:`Router` decides, where the prompts are drawn (the rollout stage's producer, so the
decision travels with the group through the spool to whichever process scores it):

* ``routing.by = mixture``: each prompt draws its teacher with probability
  ``weight / Σ weight`` from the group's own generator (the same group index routes the
  same way in every placement and on a resume);
* ``routing.by = field``: a dataset row names its teacher in the field ``routing.field``
  (``teacher_id`` by default), checked against the teachers' names at start-up.

The answers to one prompt (``rl.samples_per_prompt`` of them) share its teacher. The
result, a :class:`TeacherRoute`, also carries each row's teacher-only prompt
(:mod:`asyncopd_jax.teacher.prompts`) where a teacher has one; the scoring stage
(:class:`asyncopd_jax.teacher.scorer.Scorers`) scores each teacher's rows under it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from asyncopd_jax.teacher.prompts import field, render

# texts → token ids of each, through the teacher's tokenizer (and chat template)
Encoder = Callable[[list[str]], list[list[int]]]


@dataclasses.dataclass(frozen=True)
class RoutingParams:
    """How each prompt picks its teacher when a run has several (``routing``).

    Attributes:
      by: ``mixture`` (at random, by the teachers' weights) or ``field`` (a dataset field).
      field: the dataset field naming each row's teacher (``by = field``; dots reach into
        nested objects).
    """

    by: Literal["mixture", "field"] = "mixture"
    field: str = "teacher_id"


@dataclasses.dataclass(frozen=True)
class TeacherRoute:
    """Which teacher scores each row of a rollout group, and the prompt it scores under.

    Attributes:
      teacher: ``[B]`` int32, each row's teacher (an index into the run's teachers).
      prompt_tokens: ``[B, P']`` int32 left-padded prompts the teachers score under (a row
        whose teacher has no prompt of its own holds the student's), or None: every row
        under the student's prompt.
      prompt_mask: ``[B, P']`` bool, True on real prompt tokens (None with ``prompt_tokens``).
    """

    teacher: np.ndarray
    prompt_tokens: np.ndarray | None = None
    prompt_mask: np.ndarray | None = None

    def rows(self, k: int) -> np.ndarray:
        """The rows teacher ``k`` scores, in order."""
        return np.flatnonzero(self.teacher == k)

    def counts(self, teachers: int) -> np.ndarray:
        """``[teachers]`` rows per teacher."""
        return np.bincount(self.teacher, minlength=teachers)


@dataclasses.dataclass(frozen=True)
class RoutedTeacher:
    """What the router knows of one teacher: its name, its mixture weight, and its prompt
    (``template`` '' : the student's) with the encoder that turns it into token ids."""

    name: str
    weight: float = 1.0
    template: str = ""
    encode: Encoder | None = None


class Router:
    """Routes a group's prompts to the run's teachers (module docstring).

    Args:
      teachers: the run's teachers, in the config's order.
      routing: how prompts pick one.
      fields: an item's fields (:meth:`~asyncopd_jax.tasks.prompt_task.PromptTask.fields`).
      prompt_text: an item's prompt (:meth:`~asyncopd_jax.tasks.prompt_task.PromptTask.prompt_text`),
        the text a teacher with an encoder but no template (one of another tokenizer) is
        prompted with, in its own tokens.
      items: every item the task can draw, or items whose fields are the longest it has
        (:meth:`~asyncopd_jax.tasks.prompt_task.PromptTask.bounding_items`), asked only
        when a route is needed: routing fields are checked on them at start-up, and the
        teacher prompts' width is theirs.
      where: names a list of items in an error (``data.jsonl: rows 3, 7``).
      pad_id: the prompts' padding.
      student_slots: the student's prompt width (``PromptTask.prompt_slots``): a row that
        keeps the student's prompt must fit, and groups keep one width.
    """

    def __init__(
        self,
        teachers: Sequence[RoutedTeacher],
        routing: RoutingParams,
        *,
        fields: Callable[[Any], Mapping[str, Any]],
        prompt_text: Callable[[Any], str] | None = None,
        items: Callable[[], Sequence[Any]],
        where: Callable[[Sequence[Any]], str],
        pad_id: int,
        student_slots: int,
    ):
        self.teachers, self.routing, self.fields, self.where, self.pad_id = (
            list(teachers),
            routing,
            fields,
            where,
            pad_id,
        )
        self.prompt_text = prompt_text
        weights = np.asarray([t.weight for t in self.teachers], np.float64)
        self.p = weights / weights.sum()
        self.by_name = {t.name: k for k, t in enumerate(self.teachers)}
        self._prompts: dict[tuple[int, str], list[int]] = {}  # (teacher, text) → ids
        bounding = items() if self.needed else []
        if self.by_field:
            self._check_fields(bounding)
        own = max((len(self._prompt(k, item)) for item in bounding for k in self._own()), default=0)
        # one width for every group (one compiled shape): the longest teacher prompt or student prompt
        self.prompt_slots = max(own, student_slots)

    @property
    def by_field(self) -> bool:
        return self.routing.by == "field" and len(self.teachers) > 1

    @property
    def needed(self) -> bool:
        """Whether a group needs a route at all (else: one teacher, the student's prompt)."""
        return len(self.teachers) > 1 or bool(self._own())

    def _own(self) -> list[int]:
        """The teachers with a prompt of their own (a template, or the task's prompt in
        their own tokens)."""
        return [k for k, t in enumerate(self.teachers) if t.encode is not None]

    def _check_fields(self, items: Sequence[Any]) -> None:
        """Every item names a teacher in ``routing.field``: a ``ValueError`` naming the rows
        that do not, and the names allowed."""
        missing: list[Any] = []
        unknown: dict[str, list[Any]] = {}
        for item in items:
            try:
                value = field(self.fields(item), self.routing.field)
            except KeyError:
                missing.append(item)
                continue
            if str(value) not in self.by_name:
                unknown.setdefault(str(value), []).append(item)
        problems = [f"{self.where(missing)} have no field {self.routing.field!r} (routing.field)"] if missing else []
        problems += [
            f"{self.where(bad)}: {self.routing.field} = {value!r} names no teacher" for value, bad in unknown.items()
        ]
        if problems:
            raise ValueError("; ".join(problems) + f"; allowed: {', '.join(self.by_name)}")

    def _prompt(self, k: int, item: Any) -> list[int]:
        """Teacher ``k``'s prompt for ``item`` (each distinct text encoded once)."""
        teacher = self.teachers[k]
        assert teacher.encode is not None, "a teacher with a prompt of its own has an encoder"
        if not teacher.template:
            assert self.prompt_text is not None, "a teacher prompted with the task's text needs prompt_text"
            text = self.prompt_text(item)
            if (k, text) not in self._prompts:
                self._prompts[k, text] = teacher.encode([text])[0]
            return self._prompts[k, text]
        try:
            text = render(teacher.template, self.fields(item))
        except KeyError as err:
            raise ValueError(
                f"teacher {teacher.name!r}: prompt.template names the field {err.args[0]!r}, which "
                f"{self.where([item])} lacks; allowed: {', '.join(sorted(self.fields(item)))}"
            ) from None
        if (k, text) not in self._prompts:
            self._prompts[k, text] = teacher.encode([text])[0]
        return self._prompts[k, text]

    def route(
        self, items: Sequence[Any], student_prompts: Sequence[Sequence[int]], rng: np.random.Generator, copies: int = 1
    ) -> TeacherRoute | None:
        """The route of a group whose distinct prompts are ``items`` (token ids
        ``student_prompts``), each answered ``copies`` times in a row (None: no route needed).

        ``rng`` draws the mixture: the group's own generator, so a group routes the same way
        wherever it is drawn."""
        if not self.needed:
            return None
        if self.by_field:
            picks = [self.by_name[str(field(self.fields(item), self.routing.field))] for item in items]
        else:
            picks = rng.choice(len(self.teachers), size=len(items), p=self.p).tolist()
        teacher = np.repeat(np.asarray(picks, np.int32), copies)
        if not self._own():
            return TeacherRoute(teacher)
        width = self.prompt_slots
        tokens = np.full((len(items), width), self.pad_id, np.int32)
        mask = np.zeros((len(items), width), bool)
        for i, (k, item, student) in enumerate(zip(picks, items, student_prompts)):
            ids = self._prompt(k, item) if self.teachers[k].encode is not None else list(student)
            if len(ids) > width:  # a prompt longer than any the task showed at start-up
                raise ValueError(
                    f"teacher {self.teachers[k].name!r}: the prompt of {self.where([item])} is {len(ids)} tokens, "
                    f"longer than the {width} measured at start-up"
                )
            tokens[i, width - len(ids) :], mask[i, width - len(ids) :] = ids, True
        return TeacherRoute(teacher, np.repeat(tokens, copies, axis=0), np.repeat(mask, copies, axis=0))


__all__ = ["Encoder", "RoutedTeacher", "Router", "RoutingParams", "TeacherRoute"]
