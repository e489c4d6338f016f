"""A dataset task with tools (``environment.tools``): calls in Qwen3's ``<tool_call>`` format,
answered in the chat template's tool turn, and its held-out rollouts multi-turn through the
continuous engine. The tokenizer's template is the one written for the tests from Qwen3's
documented format (``tests/environments/test_chat_turns.py``), not downloaded."""

from __future__ import annotations

import copy
import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.config import TaskConfig, load_config
from asyncopd_jax.config_checks import ConfigError
from asyncopd_jax.environments import Calculator
from asyncopd_jax.environments.chat_turns import observation_text
from asyncopd_jax.environments.pool import EnvironmentPool
from asyncopd_jax.environments.toolbox import make_tools
from asyncopd_jax.models import Decoder, save_pretrained
from asyncopd_jax.pipeline.trainer import Trainer
from asyncopd_jax.tasks import make_task
from asyncopd_jax.tasks.dataset_task import DatasetTask
from tests.environments.test_chat_turns import QWEN3_STYLE
from tests.environments.test_sandbox import needs_isolation
from tests.tiny_models import tiny_config, tiny_decoder
from tests.tiny_tokenizers import byte_level_bpe
from tests.waits import SHORT_WAITS

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'


@pytest.fixture(scope="module")
def qwen3_style():
    tokenizer = copy.deepcopy(byte_level_bpe())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])  # added, not special: as Qwen3's tokenizer has them
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = QWEN3_STYLE
    return tokenizer


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "problems.jsonl"
    rows = [
        {"prompt": f"what is {a} times {b}?", "answer": str(a * b)} for a, b in zip(range(11, 51), range(60, 20, -1))
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return TaskConfig(name="dataset", path=str(path), eval_fraction=0.2, max_turns=3)


def _task(qwen3_style, dataset, tools=None):
    tools = [Calculator()] if tools is None else tools
    return DatasetTask(dataset, qwen3_style, max_new_tokens=48, tools=tools)


def test_a_call_is_answered_in_the_templates_tool_turn(qwen3_style, dataset):
    task = _task(qwen3_style, dataset)
    assert task.tool_call_ids == (qwen3_style.convert_tokens_to_ids("<tool_call>"),)
    turn_ids = qwen3_style.encode(CALL, add_special_tokens=False) + [task.eos_id]
    turns = task.turns(EnvironmentPool(workers=1))
    text = turns.text(turn_ids)
    assert text.startswith("<tool_call>") and text.endswith("<|im_end|>")  # the markers kept for the parser
    environment = task.environment(task.train_items[0])
    observation = environment.step(text)
    assert observation.calls == 1 and observation.error is None and not observation.done
    assert observation.text == observation_text(qwen3_style, ["408"], "<|im_end|>")
    assert qwen3_style.decode(turns.observation_ids(observation)) == observation.text
    assert environment.step("the answer is 408<|im_end|>").done  # a turn without a call ends the episode
    turns.pool.close()


@needs_isolation
def test_the_python_tool_runs_a_call_in_the_sandbox(qwen3_style, dataset):
    task = _task(qwen3_style, dataset, tools=make_tools(["calculator", "python"]))
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(12 * 34)"}}</tool_call><|im_end|>'
    observation = task.environment(task.train_items[0]).step(call)
    assert observation.error is None and observation.text == observation_text(qwen3_style, ["408\n"], "<|im_end|>")


def test_without_tools_the_dataset_task_is_single_turn(qwen3_style, dataset):
    assert _task(qwen3_style, dataset, tools=()).tool_call_ids == ()


def test_a_tokenizer_that_cannot_call_or_answer_a_tool_is_refused_in_one_line(qwen3_style, dataset):
    no_call = copy.deepcopy(byte_level_bpe())
    no_call.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    no_call.eos_token, no_call.chat_template = "<|im_end|>", QWEN3_STYLE
    with pytest.raises(ValueError, match=r"writes <tool_call> as \d+ tokens, not one"):
        _task(no_call, dataset)
    no_template = copy.deepcopy(qwen3_style)
    no_template.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match="does not write an assistant turn|closes an assistant turn|tool"):
        _task(no_template, dataset)


def test_environment_tools_are_named_built_in_tools_for_a_dataset_task(dataset):
    assert [tool.name for tool in make_tools(["calculator"])] == ["calculator"]
    with pytest.raises(ConfigError, match=r"environment.tools = \['bash'\] is invalid; allowed: distinct names"):
        load_config("demo", ["environment.tools=[bash]"])
    with pytest.raises(ConfigError, match="environment.tools = \\['calculator'\\] is for task.name = dataset"):
        load_config("demo", ["environment.tools=[calculator]"])
    cfg = load_config("demo", ["task.name=dataset", f"task.path={dataset.path}", "environment.tools=[calculator]"])
    assert cfg.environment.tools == ("calculator",)


def caller(tokenizer, seed: int = 0) -> Decoder:
    """A tiny decoder over ``tokenizer`` (its EOS its stop) made to open calls, close them and
    end turns often: tied embeddings, one hidden feature the same for every token carries
    through to the last norm, so the rows of ``<tool_call>``, ``</tool_call>`` and
    ``<|im_end|>``, which hold more of it, are likelier next tokens at every position."""
    config = dataclasses.replace(tiny_config(vocab=len(tokenizer) + 4), eos_token_id=tokenizer.eos_token_id)
    model = Decoder(config, rngs=nnx.Rngs(seed))
    nnx.update(model, nnx.state(tiny_decoder(seed, vocab=config.vocab_size, scale=0.7), nnx.Param))
    embedding = model.embed_tokens.embedding
    likely = [tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>", "<|im_end|>")]
    embedding[...] = embedding[...].at[:, 0].set(3.0).at[jnp.asarray(likely), 0].set(4.5)
    return model


@pytest.mark.extended  # a continuous engine's compile, ~20 s: CI's second step
def test_held_out_rollouts_run_multi_turn_in_the_chat_format(qwen3_style, dataset, monkeypatch):
    """The :func:`caller` model's turns park on ``<tool_call>`` … ``<|im_end|>``, each
    observation is the template's tool turn (the calculator's error on a garbled call, as
    the student reads it), and the episode ends after ``task.max_turns``."""
    from asyncopd_jax.tasks import prompt_task

    monkeypatch.setattr(prompt_task, "EVAL_SLOTS", 4)
    task = make_task(dataset, qwen3_style, max_new_tokens=192, tools=[Calculator()])  # room for error turns
    model = caller(qwen3_style)
    graphdef, params = nnx.split(model)
    batch = task.rollout(graphdef, params, task.eval_items, temperature=1.0, seed=0)
    environment, tokens = np.asarray(batch.environment_mask), np.asarray(batch.response_tokens)
    errors = np.asarray(batch.tool_errors)  # garbled calls: each answered with its error
    assert environment.any() and errors.sum() >= 2
    for row in np.flatnonzero(environment.any(axis=1)):
        edges = np.flatnonzero(np.diff(np.concatenate([[0], environment[row].astype(np.int8), [0]])))
        assert 1 <= len(edges) // 2 <= dataset.max_turns - 1  # the last turn's step ends the episode
        for start, stop in zip(edges[::2], edges[1::2]):
            text = qwen3_style.decode(tokens[row, start:stop].tolist())
            assert text.startswith("\n<|im_start|>user\n<tool_response>\nerror: ")
            assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
            assert tokens[row, start - 1] == task.eos_id  # each observation follows the turn's stop token
            turn = tokens[row, :start][~environment[row, :start]]  # what the student wrote before it
            assert task.tool_call_ids[0] in turn.tolist()
    assert np.isfinite(task.accuracy(graphdef, params))
    assert not (np.asarray(batch.response_mask) & environment).any()
    assert jnp.asarray(batch.environment_blocked_seconds).shape == (len(task.eval_items),)


@pytest.mark.e2e  # a whole run: the end-to-end step (-m e2e)
def test_a_dataset_run_with_tools_trains_on_multi_turn_trajectories(qwen3_style, dataset, tmp_path):
    """``task.name: dataset`` with ``environment.tools: [calculator]`` between two
    :func:`caller` models in Hugging Face directories (the tokenizer and its template saved
    with them): the rollouts are multi-turn in Qwen3's format, the teacher scores them and
    the student trains, with the episode figures in ``metrics.jsonl``."""
    for name, seed in (("student", 0), ("teacher", 1)):
        save_pretrained(caller(qwen3_style, seed), tmp_path / name)
        qwen3_style.save_pretrained(tmp_path / name)
    sets = {
        "name": "tools",
        "output_dir": str(tmp_path),
        "student.path": str(tmp_path / "student"),
        "teacher.path": str(tmp_path / "teacher"),
        "task.name": "dataset",
        "task.path": dataset.path,
        "task.max_turns": 3,
        "task.eval_prompts": 4,
        "environment.tools": "[calculator]",
        "sampling.engine": "continuous",
        "sampling.slots": 8,
        "sampling.max_new_tokens": 160,
        "sampling.num_candidates": 0,
        "learner.batch_size": 8,
        "schedule.mode": "sync",
        "train.steps": 3,
        "train.eval_every": 100,
        "train.checkpoint_every": 100,
        **SHORT_WAITS,
    }
    Trainer(load_config("demo", [f"{k}={v}" for k, v in sets.items()]), progress=False).run()
    records = [json.loads(line) for line in (tmp_path / "tools" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["turns_per_answer"] > 1 and r["tool_errors_per_answer"] > 0 and r["observation_tokens_per_answer"] > 10
        assert np.isfinite(r["loss"]) and r["teacher/teacher/turns_per_answer"] == r["turns_per_answer"]
