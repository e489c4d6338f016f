"""An environment of tools: each student turn's tool calls run, their outputs are the
observation; a turn that calls none is the answer, and ends the episode.

The calls are parsed in the model's format (:func:`~asyncopd_jax.environments.tool_calls.parse_hermes`
by default); a call that does not parse, names no tool of this environment or raises is
answered with its error as that call's output, so the student reads what went wrong and the
run goes on. ``max_turns`` ends the episode after that many student turns whatever they call.

``render`` writes the outputs as the observation's text: ``<tool_response>`` blocks by
default; for a chat model, the template's whole tool turn after the student's stop token,
``functools.partial(observation_text, tokenizer, stop_text=…)``
(:func:`~asyncopd_jax.environments.chat_turns.observation_text`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from asyncopd_jax.environments.protocol import Observation, Tool
from asyncopd_jax.environments.tool_calls import ParsedTurn, parse_hermes, render_hermes


class ToolEnvironment:
    """One prompt's tools (module docstring)."""

    def __init__(
        self,
        tools: Sequence[Tool],
        max_turns: int = 4,
        parse: Callable[[str], ParsedTurn] = parse_hermes,
        render: Callable[[list[str]], str] = render_hermes,
    ):
        self.tools = {tool.name: tool for tool in tools}
        self.max_turns, self.parse, self.render = max_turns, parse, render
        self.turns = 0

    def step(self, turn: str) -> Observation:
        self.turns += 1
        parsed = self.parse(turn)
        if not parsed.any or self.turns >= self.max_turns:
            return Observation(done=True, calls=len(parsed.calls))
        outputs, errors = [f"error: {e}" for e in parsed.errors], list(parsed.errors)
        for call in parsed.calls:
            tool = self.tools.get(call.name)
            if tool is None:
                message = f"no tool {call.name!r}; the tools: {', '.join(sorted(self.tools))}"
                outputs.append(f"error: {message}")
                errors.append(message)
                continue
            try:
                outputs.append(tool(call.arguments))
            except Exception as err:  # noqa: BLE001 - a tool's failure is the student's observation
                message = f"{call.name}: {err}"
                outputs.append(f"error: {message}")
                errors.append(message)
        return Observation(text=self.render(outputs), error="; ".join(errors) or None, calls=len(parsed.calls))
