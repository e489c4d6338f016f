"""Tool calls in a model's own format, parsed from a student turn's text, and the tools'
outputs rendered back.

Qwen3 (Hermes-style, as Qwen3's documentation and chat template write it): the assistant
writes each call as a JSON object on its own between ``<tool_call>`` and ``</tool_call>``::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

and each output goes back between ``<tool_response>`` and ``</tool_response>`` (the chat
template puts them in a ``user`` turn; that wrapping is the rollout's, through the template).
A call that does not parse is returned as an error, which the environment answers as an
observation (the student sees what was wrong), never an exception.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re

from asyncopd_jax.environments.protocol import ToolCall

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """A turn's tool calls, in order, and what was wrong with those that did not parse
    (``errors``: one line each, naming the call by its place)."""

    calls: list[ToolCall]
    errors: list[str]

    @property
    def any(self) -> bool:
        """Whether the turn tried to call a tool at all."""
        return bool(self.calls or self.errors)


def parse_hermes(text: str) -> ParsedTurn:
    """The ``<tool_call>`` blocks of ``text`` (module docstring). ``arguments`` may be a JSON
    object or a string holding one (some models write it so); a block without a closing tag
    is an error."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for k, match in enumerate(_CALL.finditer(text)):
        where = f"tool call {k + 1}"
        try:
            body = json.loads(match.group(1))
        except ValueError as err:
            errors.append(f"{where} is not JSON: {err}")
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
            errors.append(f'{where} must be an object with a "name" string, got {match.group(1).strip()[:80]}')
            continue
        arguments = body.get("arguments", {})
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):  # not JSON: refused below, as not an object
                arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            errors.append(f'{where} ({body["name"]}): "arguments" must be an object, got {str(arguments)[:80]}')
            continue
        calls.append(ToolCall(body["name"], arguments))
    opened, closed = text.count("<tool_call>"), text.count("</tool_call>")
    if opened > closed:
        errors.append(f"{opened - closed} <tool_call> without </tool_call>")
    return ParsedTurn(calls, errors)


def render_hermes(outputs: list[str]) -> str:
    """The tools' outputs, each between ``<tool_response>`` tags, one after another."""
    return "\n".join(f"<tool_response>\n{output}\n</tool_response>" for output in outputs)
