"""The two engines share one sampling core and per-prompt keys: a prompt sampled with the same
key gets the same answer, and records the same candidates, top-K and log-probs, from the
static and the continuous engine, whatever its row, its neighbours and the batch's size."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.sampling import Engine, SamplingParams, make_sampler, prompt_keys, run_stream
from tests.sampling.test_continuous import FIELDS, PROMPT_SLOTS, PROMPTS, _assert_same_answer
from tests.tiny_models import tiny_decoder

MODEL = nnx.split(tiny_decoder(0, scale=0.7))
PARAMS = SamplingParams(
    temperature=0.8, max_new_tokens=12, num_candidates=3, student_topk=2, stop_token_ids=(51, 54), chunk_steps=3
)
PROMPT = [12, 13, 14]
KEY = jax.random.key(0)  # the prompt's own key (its answer stops after 7 tokens): fold_in(KEY, t) draws token t


@functools.cache
def _engine(engine: str) -> Engine:
    params = PARAMS if engine == "static" else dataclasses.replace(PARAMS, engine="continuous", slots=3, page_size=4)
    return make_sampler(MODEL[0], params)


def _with_prompt_at(row: int, size: int, seed: int):
    """``size`` prompts with :data:`PROMPT` at ``row`` (its key :data:`KEY`), the others
    drawn from :data:`PROMPTS` with keys of their own."""
    others = [PROMPTS[(seed + i) % len(PROMPTS)] for i in range(size - 1)]
    prompts = others[:row] + [PROMPT] + others[row:]
    keys = prompt_keys(jax.random.key(seed), size)
    return prompts, keys.at[row].set(KEY)


@pytest.mark.parametrize("engine", ["static", "continuous"])
@pytest.mark.parametrize("row,size,seed", [(0, 1, 0), (0, 4, 1), (3, 4, 2), (5, 7, 3)])
def test_a_prompt_answers_the_same_from_either_engine_at_any_row(engine, row, size, seed):
    alone = _engine("static").generate(MODEL[1], [PROMPT], None, keys=KEY[None], prompt_slots=PROMPT_SLOTS)
    assert 1 < int(np.asarray(alone.response_mask).sum()) < PARAMS.max_new_tokens  # stopped early: a real test
    prompts, keys = _with_prompt_at(row, size, seed)
    batch = _engine(engine).generate(MODEL[1], prompts, None, keys=keys, prompt_slots=PROMPT_SLOTS)
    _assert_same_answer(batch, row, alone, 0)
    assert set(FIELDS) >= {"candidate_ids", "student_topk_ids", "behavior_logp", "token_version"}


def test_a_prompt_answers_the_same_from_either_engines_stream_among_other_groups():
    """Through the streams both engines open (the rollout loop's interface), in the second
    group, behind other answers of another group: the same answer as alone."""
    alone = _engine("static").generate(MODEL[1], [PROMPT], None, keys=KEY[None], prompt_slots=PROMPT_SLOTS)
    for engine in ("static", "continuous"):
        stream = _engine(engine).open_stream(MODEL[1], version=0, prompt_slots=PROMPT_SLOTS, slots=3)
        first, first_keys = _with_prompt_at(1, 3, 5)
        second, second_keys = _with_prompt_at(2, 4, 6)
        stream.submit("first", first, first_keys)
        stream.submit("second", second, second_keys)
        done = dict(run_stream(stream))
        _assert_same_answer(done["first"], 1, alone, 0)
        _assert_same_answer(done["second"], 2, alone, 0)
