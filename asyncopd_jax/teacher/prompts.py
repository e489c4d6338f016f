"""A teacher-only prompt: the teacher scores the student's answer under a prompt of its own.

The student samples its answer to its own prompt; the teacher may be better placed to judge
that answer with more context (a reference solution, a system prompt, its own chat
template). ``teacher.prompt.template`` is text with ``{field}`` slots filled from the task
item's fields (:meth:`~asyncopd_jax.tasks.prompt_task.PromptTask.fields`: a dataset row's
own fields, dotted names reaching into nested objects; the built-in task's ``prompt``,
``answer`` and ``solution``); ``{{`` and ``}}`` are literal braces. The text then goes
through the teacher tokenizer's chat template (with ``system`` as the system message) when
it has one.

Only the prompt changes: the answer's tokens are the student's (a teacher of another
tokenizer reads them re-tokenised: :mod:`asyncopd_jax.teacher.cross_tokenizer`), so response
position t is the same token under either prompt, and the score cache stays aligned with the
student's positions (:func:`asyncopd_jax.alignment.response_hidden` aligns the teacher's
hidden states to the response whatever the prompt's length).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Literal

from asyncopd_jax.config_checks import StorageLocation

_SLOT = re.compile(r"\{\{|\}\}|\{([A-Za-z0-9_.]*)\}|[{}]")


@dataclasses.dataclass(frozen=True)
class TeacherPrompt:
    """The prompt a teacher scores the student's answers under (``teacher.prompt``).

    Attributes:
      template: text with ``{field}`` slots (module docstring); '' : the student's own
        prompt tokens, unchanged.
      system: the system message of the teacher's chat template ('' : none).
      chat_template: whether the rendered text goes through the teacher tokenizer's chat
        template: ``auto`` (when it has one), ``on`` (an error if it has none), ``off``.
      tokenizer: the directory whose tokenizer encodes the prompt ('' : the teacher's
        tokenizer: ``teacher.tokenizer``, else its own directory, else, for a served
        teacher, the student's). Its vocabulary must be the teacher's.
    """

    template: str = ""
    system: str = ""
    chat_template: Literal["auto", "on", "off"] = "auto"
    tokenizer: StorageLocation = ""

    def __post_init__(self) -> None:
        if self.system and not self.template:
            raise ValueError(
                f"prompt.system = {self.system!r} is set without prompt.template; allowed: a template too (the "
                "system message is part of the teacher's own prompt; without a template the teacher scores under "
                "the student's prompt tokens, unchanged)"
            )
        slots(self.template)  # an unmatched brace fails here, when the config is read

    @property
    def own(self) -> bool:
        """Whether the teacher has a prompt of its own (else it scores under the student's)."""
        return bool(self.template)


def slots(template: str) -> list[str]:
    """The field names ``template`` fills, in order; a ``ValueError`` for a lone brace."""
    names = []
    for match in _SLOT.finditer(template):
        token = match.group(0)
        if token in ("{{", "}}"):
            continue
        if match.group(1) is None or not match.group(1):
            what = f"a lone {token!r}" if match.group(1) is None else "an empty slot {}"
            raise ValueError(
                f"prompt.template {template!r}: {what} at character {match.start() + 1}; allowed: "
                "{field} slots, and {{ or }} for a literal brace"
            )
        names.append(match.group(1))
    return names


def field(fields: Mapping[str, Any], name: str) -> Any:
    """``fields[name]``, following dots into nested mappings; ``KeyError(name)`` if absent."""
    value: Any = fields
    for part in name.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(name)
        value = value[part]
    return value


def render(template: str, fields: Mapping[str, Any]) -> str:
    """``template`` with each ``{name}`` replaced by ``str(field(fields, name))``.

    Raises ``KeyError(name)`` for the first slot ``fields`` lacks."""

    def fill(match: re.Match) -> str:
        token = match.group(0)
        if token in ("{{", "}}"):
            return token[0]
        return str(field(fields, match.group(1)))

    slots(template)
    return _SLOT.sub(fill, template)


__all__ = ["TeacherPrompt", "field", "render", "slots"]
