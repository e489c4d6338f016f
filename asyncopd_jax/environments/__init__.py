"""Environments of multi-turn rollouts: the protocol, tool calls in a model's format, the
built-in tools, and the worker pool that runs environment steps off the decode loop."""

from asyncopd_jax.environments.calculator import Calculator
from asyncopd_jax.environments.chat_turns import observation_ids, observation_text
from asyncopd_jax.environments.pool import EnvironmentPool
from asyncopd_jax.environments.protocol import Environment, Observation, Tool, ToolCall
from asyncopd_jax.environments.sandbox import PythonSandbox, SandboxLimits
from asyncopd_jax.environments.tool_calls import ParsedTurn, parse_hermes, render_hermes
from asyncopd_jax.environments.tool_environment import ToolEnvironment

__all__ = [
    "Calculator",
    "Environment",
    "EnvironmentPool",
    "Observation",
    "ParsedTurn",
    "PythonSandbox",
    "SandboxLimits",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "observation_ids",
    "observation_text",
    "parse_hermes",
    "render_hermes",
]
