"""The built-in tool task: its teacher trajectories are what its environment answers, its
verifier reads the last turn, and its tokenizer writes every character of it."""

from __future__ import annotations

import numpy as np
import pytest

from asyncopd_jax.tasks.tokenizer import build_tokenizer
from asyncopd_jax.tasks.tool_arith import HABITS, ToolProblem, environment, is_held_out, sample_problems, verify


@pytest.mark.parametrize("habit", HABITS)
def test_a_teacher_trajectory_is_what_the_environment_answers(habit):
    for problem in sample_problems(np.random.default_rng(0), 20, 99, held_out=False):
        env = environment()
        turns = problem.trajectory(habit)
        assert len(turns) == {"none": 1, "whole": 2, "steps": 3}[habit]
        for turn, want in turns:
            observation = env.step(turn)
            assert observation.done == (want == "")
            assert (observation.text or "") == want
            assert observation.error is None
        assert verify(problem, "".join(t + o for t, o in turns))


def test_the_verifier_reads_the_last_turn_and_bad_calls_are_observations():
    p = ToolProblem(37, 58, 12)
    assert p.answer == 2158 and p.prompt == "Q:37*58+12="
    assert verify(p, "C:37*58+12R:2158;A=2158") and not verify(p, "A=2158;A=2157") and not verify(p, "C:37*58+12")
    env = environment()
    bad = env.step("C:37*/58")
    assert bad.text == "R:E;" and bad.error and not bad.done and bad.calls == 1
    assert env.step("C:7/2").text == "R:E;"  # not a whole number: the task's characters only
    assert env.step("A=1").done


def test_splits_are_disjoint_and_the_tokenizer_writes_every_character():
    rng = np.random.default_rng(1)
    train, held = sample_problems(rng, 200, 99, held_out=False), sample_problems(rng, 50, 99, held_out=True)
    assert not any(map(is_held_out, train)) and all(map(is_held_out, held))
    tokenizer = build_tokenizer("tools")
    unk = tokenizer.unk_token_id
    for p in train[:20]:
        text = p.prompt + "".join(t + o for t, o in p.trajectory("steps"))
        assert unk not in tokenizer.encode(text) and tokenizer.decode(tokenizer.encode(text)) == text
    with pytest.raises(ValueError, match="task.max_value"):
        sample_problems(rng, 1, 9, held_out=False)
