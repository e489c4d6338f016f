"""The tool task through the tools tokenizer: SFT trajectories mark the observations as
environment tokens, the rollouts' turns and observations convert both ways, and the
accuracy is measured multi-turn with the calculator answering."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.config import TaskConfig
from asyncopd_jax.environments import EnvironmentPool
from asyncopd_jax.models import from_pretrained, load_tokenizer
from asyncopd_jax.tasks import ToolTaskData, make_task, prompt_task
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.tasks.tokenizer import build_tokenizer
from asyncopd_jax.tasks.tool_arith import ToolProblem


@pytest.fixture(scope="module")
def data() -> ToolTaskData:
    config = TaskConfig(name="tools", max_value=60, eval_prompts=12)
    task = make_task(config, build_tokenizer("tools"), max_new_tokens=8)
    assert isinstance(task, ToolTaskData)
    return task


@pytest.mark.parametrize("habit", ["whole", "steps"])
def test_sft_trajectories_hold_the_observations_as_environment_tokens(data, habit):
    batch = data.sft_batch(np.random.default_rng(0), 6, habit)
    tokens, student = np.asarray(batch.response_tokens), np.asarray(batch.response_mask)
    environment = np.asarray(batch.environment_mask)
    tokenizer = data.tokenizer
    for row in range(6):
        said = tokenizer.decode(tokens[row][student[row]], skip_special_tokens=True)
        heard = tokenizer.decode(tokens[row][environment[row]])
        assert said.startswith("C:") and "A=" in said and heard.startswith("R:") and heard.endswith(";")
        assert heard.count("R:") == (1 if habit == "whole" else 2)
        assert (tokens[row][student[row]] == data.eos_id).sum() == heard.count("R:") + 1  # every turn ends on EOS
    assert not (student & environment).any()
    assert data.max_new_tokens >= int((student | environment).sum(axis=1).max())


def test_turns_convert_a_turns_ids_to_text_and_an_observation_to_ids(data):
    turns = data.turns(EnvironmentPool(workers=1))
    ids = data.tokenizer.encode("C:12*34+5") + [data.eos_id]
    assert turns.text(ids) == "C:12*34+5"
    observation = data.environment(ToolProblem(12, 34, 5)).step(turns.text(ids))
    assert data.tokenizer.decode(turns.observation_ids(observation)) == "R:413;"
    assert data.tool_call_ids == (data.tokenizer.convert_tokens_to_ids("C"),)
    turns.pool.close()


@pytest.mark.extended  # ~10 s of compiles: CI's second step (the demo_tools runs there evaluate multi-turn too)
def test_accuracy_is_measured_multi_turn(data, monkeypatch):
    """The shipped tool teacher answers every held-out problem with one call, its
    observation and the answer the calculator gave: all correct."""
    monkeypatch.setattr(prompt_task, "EVAL_SLOTS", 4)  # the engine's compile follows its slots: 11 s, not 27
    graphdef, params = nnx.split(from_pretrained(resolve_model_path("builtin:teacher_tools")))
    batch = data.rollout(graphdef, params, data.eval_items, temperature=0.0, seed=0)
    environment = np.asarray(batch.environment_mask)
    assert (np.diff(environment.astype(int), axis=1) == 1).sum(axis=1).tolist() == [1] * len(data.eval_items)
    assert np.asarray(batch.tool_calls).tolist() == [1] * len(data.eval_items)
    assert data.accuracy(graphdef, params) == 1.0


def test_the_tool_task_needs_its_tokenizer():
    with pytest.raises(ValueError, match="has no token holding 'C'"):
        ToolTaskData(TaskConfig(name="tools"), build_tokenizer("characters"))


def test_merged_tokens_that_write_a_call_all_open_one():
    """Under the byte-pair tokenizer the call's ``C`` is merged (``C:``, ``C:1``, …): every
    token holding it opens a call, and a teacher trajectory's first token is one of them."""
    merged = ToolTaskData(TaskConfig(name="tools"), build_tokenizer("tools_merges"))
    tokens = merged.tokenizer.convert_ids_to_tokens(list(merged.tool_call_ids))
    assert len(tokens) > 3 and all("C" in t for t in tokens) and "C:" in tokens
    batch = merged.sft_batch(np.random.default_rng(0), 8)
    assert np.isin(np.asarray(batch.response_tokens)[:, 0], merged.tool_call_ids).all()


@pytest.mark.parametrize(
    "model, kind", [("teacher_tools", "tools"), ("student_tools", "tools"), ("student_tools_bpe", "tools_merges")]
)
def test_each_shipped_tool_model_has_the_tokenizer_its_kind_builds(model, kind):
    """The merges are learned at build time: a change to their corpus would leave the shipped
    student's embedding reading other tokens."""
    shipped = load_tokenizer(resolve_model_path(f"builtin:{model}"))
    assert shipped.backend_tokenizer.to_str() == build_tokenizer(kind).backend_tokenizer.to_str()


def test_without_tools_the_task_is_single_turn_and_the_none_habit_answers_at_once():
    task = TaskConfig(name="tools", tools=False, tool_habit="none")
    data = ToolTaskData(task, build_tokenizer("tools"))
    assert data.tool_call_ids == ()
    batch = data.sft_batch(np.random.default_rng(0), 4)
    assert not np.asarray(batch.environment_mask).any()
    text = data.tokenizer.decode(np.asarray(batch.response_tokens)[0], skip_special_tokens=True)
    assert text.startswith("A=") and "C" not in text
