"""The built-in tools by name, for a config's ``environment.tools`` (a dataset task's tools,
called in the model's own format: Qwen3's ``<tool_call>`` JSON).

* ``calculator``: an arithmetic expression's exact value
  (:class:`~asyncopd_jax.environments.calculator.Calculator`);
* ``python``: a program run in the sandbox
  (:class:`~asyncopd_jax.environments.sandbox.PythonSandbox`). Made at start-up: where the
  sandbox's isolation cannot be set up, the run is refused in one line naming what is
  missing, before anything trains, and never runs the code unsandboxed.
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncopd_jax.environments.calculator import Calculator
from asyncopd_jax.environments.protocol import Tool
from asyncopd_jax.environments.sandbox import PythonSandbox

#: The tools ``environment.tools`` may name.
TOOL_NAMES = ("calculator", "python")


def make_tools(names: Sequence[str]) -> list[Tool]:
    """The tools ``names`` (each of :data:`TOOL_NAMES`), in order.

    Raises:
      ValueError: a name that is not a built-in tool.
      RuntimeError: ``python`` where the sandbox cannot isolate its code (its one line).
    """
    makers = {"calculator": Calculator, "python": PythonSandbox}
    unknown = [name for name in names if name not in makers]
    if unknown:
        raise ValueError(
            f"environment.tools: {', '.join(map(repr, unknown))} is invalid; allowed: {', '.join(TOOL_NAMES)}"
        )
    return [makers[name]() for name in names]


__all__ = ["TOOL_NAMES", "make_tools"]
