"""Environment steps on the worker pool: a slow step does not hold back a fast one, and an
exception, a timeout or an oversized output is an observation, never a crash."""

from __future__ import annotations

import threading
import time

import pytest

from asyncopd_jax.environments import Calculator, EnvironmentPool, Observation, ToolEnvironment


class Scripted:
    """An environment that waits for ``release`` (if given), then answers ``answer`` or raises it."""

    def __init__(self, answer, release: threading.Event | None = None):
        self.answer, self.release = answer, release

    def step(self, turn: str) -> Observation:
        if self.release is not None:
            self.release.wait(10)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_a_slow_step_does_not_hold_back_a_fast_one():
    pool, release = EnvironmentPool(workers=2, timeout_s=30), threading.Event()
    pool.submit("slow", Scripted(Observation(text="late"), release), "turn")
    pool.submit("fast", Scripted(Observation(text="soon")), "turn")
    assert pool.wait(timeout=10) == [("fast", Observation(text="soon"))]
    assert pool.ready() == [] and pool.pending == 1
    release.set()
    assert pool.wait(timeout=10) == [("slow", Observation(text="late"))] and pool.pending == 0
    pool.close()


def test_an_exception_is_an_observation_naming_it():
    pool = EnvironmentPool()
    pool.submit(0, Scripted(RuntimeError("disk on fire")), "turn")
    [(key, observation)] = pool.wait(timeout=10)
    assert key == 0 and observation.error == "RuntimeError: disk on fire" and "disk on fire" in observation.text
    pool.close()


def test_a_step_past_its_timeout_is_answered_with_a_timeout():
    now = [0.0]
    pool, release = EnvironmentPool(timeout_s=5, clock=lambda: now[0]), threading.Event()
    pool.submit("stuck", Scripted(Observation(text="never seen"), release), "turn")
    assert pool.ready() == []
    now[0] = 5.0
    [(key, observation)] = pool.ready()
    assert key == "stuck" and observation.error == "the environment did not answer within 5 s" and not observation.done
    release.set()
    pool.close()


@pytest.mark.parametrize(
    "answer, kept",
    [(Observation(text="x" * 50), {"text": "x" * 8}), (Observation(ids=tuple(range(50))), {"ids": tuple(range(8))})],
)
def test_an_oversized_output_is_cut_and_says_so(answer, kept):
    pool = EnvironmentPool(max_output=8)
    pool.submit(0, Scripted(answer), "turn")
    [(_, observation)] = pool.wait(timeout=10)
    assert all(getattr(observation, k) == v for k, v in kept.items())
    assert observation.error.startswith("the output has 50 ") and observation.error.endswith("kept the first 8")
    pool.close()


def test_one_step_a_slot_at_a_time():
    pool = EnvironmentPool()
    pool.submit(0, Scripted(Observation(), threading.Event()), "turn")
    with pytest.raises(ValueError, match="slot 0 already has a step running"):
        pool.submit(0, Scripted(Observation()), "turn")
    pool.close()


def test_a_tool_environment_answers_calls_and_ends_on_an_answer():
    env = ToolEnvironment([Calculator()], max_turns=4)
    first = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>')
    assert first == Observation(text="<tool_response>\n408\n</tool_response>", calls=1)
    second = env.step(
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
    )
    assert second.error == "no tool 'search'; the tools: calculator; calculator: division by zero" and second.calls == 2
    assert second.text.count("<tool_response>\nerror: ") == 2 and not second.done
    broken = env.step("<tool_call>{not json}</tool_call>")  # a call that does not parse: told, not ended
    assert not broken.done and broken.error.startswith("tool call 1 is not JSON")
    assert env.step("So the answer is 408.") == Observation(done=True)


def test_a_tool_environment_ends_after_max_turns():
    env = ToolEnvironment([Calculator()], max_turns=2)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    assert not env.step(call).done and env.step(call) == Observation(done=True, calls=1)


def test_waiting_with_nothing_pending_returns_at_once():
    start = time.monotonic()
    assert EnvironmentPool().wait(timeout=5) == [] and time.monotonic() - start < 1
