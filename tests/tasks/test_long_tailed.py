"""The built-in task's long-tailed lengths (``task.lengths = long_tailed``): the law of the
operand count, its config errors, the widths that hold its worst case, and the shipped
long-task teacher."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax import configs
from asyncopd_jax.cli import _initialise_from, main
from asyncopd_jax.config import ConfigError, TaskConfig, load_config
from asyncopd_jax.pipeline.model_loading import load_model_and_tokenizer
from asyncopd_jax.tasks.arith import (
    Problem,
    is_held_out,
    long_tailed_probabilities,
    operand_counts,
    sample_problems,
)
from asyncopd_jax.tasks.builtin import TaskData, length_buckets, model_config, new_model
from asyncopd_jax.tasks.tokenizer import build_tokenizer

LONG = TaskConfig(lengths="long_tailed", difficulty=2, max_operands=40, tail_exponent=2.0)


def test_the_law_is_the_documented_zipf_law():
    p = long_tailed_probabilities(2, 40, 2.0)
    j = np.arange(1, 40)
    np.testing.assert_allclose(p, j**-2.0 / np.sum(j**-2.0))
    # the figures in arith's docstring
    assert round(p[0], 3) == 0.617 and round(p[8:].sum(), 3) == 0.057 and round(p[18:].sum(), 3) == 0.018
    assert round(p[-1], 4) == 0.0004
    np.testing.assert_allclose(long_tailed_probabilities(3, 7, 0.0), np.full(5, 0.2))  # exponent 0: uniform


def test_drawn_counts_are_heavy_tailed_as_documented():
    n = 50_000
    counts = operand_counts(np.random.default_rng(0), n, 2, 40, 2.0)
    assert counts.min() == 2 and counts.max() <= 40
    cdf = np.cumsum(long_tailed_probabilities(2, 40, 2.0))
    assert [2 + int(np.searchsorted(cdf, q)) for q in (0.5, 0.9, 0.99)] == [2, 6, 25]  # median, p90, p99
    # (the p99 sits at a step of the CDF: 0.9894 at 24, 0.9904 at 25, so a sample's may be 26)
    assert [int(np.quantile(counts, q)) for q in (0.5, 0.9)] == [2, 6] and 24 <= np.quantile(counts, 0.99) <= 26
    for k in (2, 3, 6, 10, 20, 30):  # the empirical CDF is the formula's, within 4 standard errors
        p = cdf[k - 2]
        assert abs(np.mean(counts <= k) - p) < 4 * np.sqrt(p * (1 - p) / n), k
    # heavy: P(k >= 20) = 0.018 (a geometric law with the same P(2): 3e-8)
    assert np.mean(counts >= 20) > 0.012


def test_long_tailed_problems_respect_the_bounds_the_split_and_distinct_operands():
    rng = np.random.default_rng(1)
    for held_out in (False, True):
        problems = sample_problems(
            rng, 400, 3, 99, held_out=held_out, lengths="long_tailed", max_operands=12, tail_exponent=1.0
        )
        ks = [len(p.operands) for p in problems]
        assert min(ks) == 3 and max(ks) == 12
        assert all(is_held_out(p) == held_out for p in problems)
        assert all(len(set(p.operands)) == len(p.operands) for p in problems)
        assert all(0 <= v <= 99 for p in problems for v in p.operands)


def test_fixed_lengths_are_unchanged():
    """The demo's problems: ``difficulty`` operands each, the same draw as before the option."""
    rng = np.random.default_rng(0)
    problems = sample_problems(rng, 3, 3, 99, held_out=False)
    assert all(len(p.operands) == 3 for p in problems)
    data = TaskData(TaskConfig(), build_tokenizer())
    assert (data.prompt_slots, data.max_new_tokens) == (11, 27)
    # the byte-pair tokenizer's prompts are shorter; its answers get as many tokens as
    # characters (a student distilled from the character teacher writes one a token)
    merges = TaskData(TaskConfig(), build_tokenizer("merges"))
    assert (merges.prompt_slots, merges.max_new_tokens) == (7, 27)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"lengths": "zipf"}, r"task.lengths = 'zipf' is invalid; allowed: fixed, long_tailed"),
        ({"lengths": "long_tailed", "difficulty": 1}, r"task.difficulty = 1 is invalid; allowed: >= 2"),
        (
            {"lengths": "long_tailed", "difficulty": 5, "max_operands": 4},
            r"task.max_operands = 4 is invalid; allowed: task.difficulty \(5\) to task.max_value \+ 1 \(100",
        ),
        (
            {"lengths": "long_tailed", "max_value": 9, "max_operands": 11},
            r"task.max_operands = 11 is invalid; allowed: task.difficulty \(3\) to task.max_value \+ 1 \(10",
        ),
        ({"lengths": "long_tailed", "tail_exponent": -1}, r"task.tail_exponent = -1.0 is invalid; allowed: >= 0"),
    ],
)
def test_config_errors_name_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"task.{k}={v}" for k, v in fields.items()])


def test_the_widths_hold_the_worst_case():
    data = TaskData(LONG, build_tokenizer())
    worst = Problem((99,) * 40)
    assert data.prompt_slots == len(worst.prompt) == 122
    assert data.max_new_tokens == len(worst.solution(tuple(range(40)))) + 1 == 494
    rng = np.random.default_rng(2)
    problems = sample_problems(rng, 2000, 2, 99, held_out=False, lengths="long_tailed", max_operands=40)
    problems += [Problem(tuple(range(60, 100))), Problem(tuple(range(99, 59, -1)))]  # the longest distinct ones
    for p in problems:
        assert len(p.prompt) <= data.prompt_slots
        assert len(p.solution(tuple(range(len(p.operands))))) + 1 <= data.max_new_tokens
    # every SFT batch fits the worst case and its bucket's budget
    for _ in range(30):
        batch = data.sft_batch(rng, 64)
        rows, answer = batch.response_tokens.shape
        assert batch.prompt_tokens.shape[1] <= data.prompt_slots and answer <= data.max_new_tokens
        assert 1 <= rows <= 64 and (rows == 64 or rows * (answer + batch.prompt_tokens.shape[1]) <= 64 * 128)
    # the long models' context holds the worst prompt + answer; the demo's does not
    assert data.prompt_slots + data.max_new_tokens <= model_config("teacher_long").max_position_embeddings
    assert data.prompt_slots + data.max_new_tokens > model_config("teacher").max_position_embeddings


def test_sft_batches_hold_one_bucket_padded_to_its_worst_case_within_the_budget():
    data = TaskData(TaskConfig(lengths="long_tailed", difficulty=2, tail_exponent=0.0), build_tokenizer())
    rng, seen = np.random.default_rng(3), set()
    for _ in range(40):
        batch = data.sft_batch(rng, 64)
        rows, answer = batch.response_tokens.shape
        lengths = np.asarray(batch.response_mask).sum(1)
        (low, high) = next(b for b in length_buckets(2, 40) if data._widths(b[1])[1] == answer)
        assert batch.prompt_tokens.shape[1] == data._widths(high)[0]
        assert rows == min(64, 64 * 128 // (batch.prompt_tokens.shape[1] + answer))  # 13 rows at 27-40 operands
        # the rows' answers: left to right, `low..high` operands each (k operands: k - 1 '+' in the answer)
        texts = [data.tokenizer.decode(r[m]) for r, m in zip(np.asarray(batch.response_tokens), batch.response_mask)]
        assert all(low <= t.count("+") + 1 <= high for t in texts) and lengths.max() <= answer
        prompts = [data.tokenizer.decode(r[m]) for r, m in zip(np.asarray(batch.prompt_tokens), batch.prompt_mask)]
        for prompt, text in zip(prompts, texts):
            operands = tuple(int(v) for v in prompt.removeprefix("Q:").removesuffix("=").split("+"))
            assert text.removesuffix("<eos>") == Problem(operands).solution(tuple(range(len(operands))))
        seen.add((low, high))
    assert (27, 40) in seen and (2, 2) in seen


def test_length_buckets_cover_the_range_without_gaps():
    for low, high in [(2, 40), (3, 40), (2, 2), (5, 7)]:
        buckets = length_buckets(low, high)
        assert buckets[0][0] == low and buckets[-1][1] == high
        assert all(a[1] + 1 == b[0] for a, b in zip(buckets, buckets[1:]))
        assert all(lo <= hi for lo, hi in buckets)


def test_the_shipped_config_holds_the_longest_answer():
    cfg = load_config(configs.bundled("long_tailed"))
    assert cfg.task.lengths == "long_tailed"
    data = TaskData(cfg.task, build_tokenizer())
    assert cfg.sampling.max_new_tokens >= data.max_new_tokens
    assert (cfg.student.path, cfg.teacher.path) == ("builtin:student_long", "builtin:teacher_long")


def test_the_shipped_long_models_load_and_the_teacher_answers_held_out_problems():
    """``builtin:teacher_long`` (context 1024) answers the first held-out problems of the
    long-tailed config and 3 of 4 of 8-11 operands (it gets ~86 % of those); the warm start
    ``builtin:student_long`` is far worse on the same problems."""
    teacher, tokenizer = load_model_and_tokenizer("builtin:teacher_long", "float32")
    assert teacher.config == model_config("teacher_long")
    data = TaskData(LONG, tokenizer)
    short = list(data.eval_items[:8])
    longer = data._problems_in(np.random.default_rng(0), 4, 8, 11, held_out=True)
    assert all(is_held_out(p) for p in short + longer) and min(len(p.operands) for p in longer) == 8
    graphdef, params = nnx.split(teacher)
    assert data.accuracy(graphdef, params, items=short) == 1.0
    assert data.accuracy(graphdef, params, items=longer) >= 0.75
    student, _ = load_model_and_tokenizer("builtin:student_long", "float32")
    assert student.config == model_config("student_long")
    assert data.accuracy(*nnx.split(student), items=short + longer) <= 0.25


def test_sft_starts_from_a_shipped_model_of_the_same_architecture(capsys, tmp_path):
    """``asyncopd sft --init``: the weights are copied whatever the context; another
    architecture is a one-line error."""
    model = new_model("student_long", 5)
    _initialise_from(model, "builtin:student")
    source, _ = load_model_and_tokenizer("builtin:student", "float32")
    weights = jax.tree.leaves(nnx.state(model, nnx.Param))
    for mine, theirs in zip(weights, jax.tree.leaves(nnx.state(source, nnx.Param)), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    assert model.config.max_position_embeddings == 1024
    argv = ["sft", "--model", "student_long", "--init", "builtin:teacher", "--steps", "1", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "--init builtin:teacher: its config.json is not the architecture of --model" in capsys.readouterr().err
