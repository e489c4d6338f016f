"""The continuous-batching engine: a slot refilled mid-loop answers as its prompt alone would;
the pool preempts and re-queues when it runs short; pages hold only the tokens written."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.sampling import ContinuousSampler, SamplingParams, prompt_keys
from tests.sampling.conftest import AHEAD_FAST_READ_FIRST_EXTENDED
from tests.tiny_models import tiny_decoder

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15], [16, 17], [18, 19, 20, 21], [22], [23, 24], [25, 26, 27]]
PROMPT_SLOTS = 6
STOPS = (51, 54)  # frequent under this student and key: answers of 3 to 12 tokens


def _params(**changes) -> SamplingParams:
    base = dict(
        temperature=0.8,
        max_new_tokens=12,
        num_candidates=3,
        student_topk=2,
        stop_token_ids=STOPS,
        chunk_steps=2,
        engine="continuous",
        slots=3,
        page_size=4,
    )
    return SamplingParams(**{**base, **changes})


MODEL = nnx.split(tiny_decoder(0, scale=0.7))


@functools.cache
def _engine(params: SamplingParams) -> ContinuousSampler:
    """One engine per parameters: its compiled functions serve every call."""
    return ContinuousSampler(MODEL[0], params)


def _generate(params: SamplingParams, prompts=PROMPTS, key=None, **kwargs):
    state = MODEL[1]
    engine = _engine(params)
    key = jax.random.key(0) if key is None else key
    return engine.generate(state, prompts, key, prompt_slots=PROMPT_SLOTS, **kwargs), engine.last_stats


FIELDS = [
    "response_mask",
    "response_tokens",
    "behavior_logp",
    "token_version",
    "candidate_ids",
    "candidate_behavior_logp",
    "student_topk_ids",
    "student_topk_behavior_logp",
]


def _assert_same_answer(got, row: int, want, want_row: int) -> None:
    for field in FIELDS:
        a, b = np.asarray(getattr(got, field)[row]), np.asarray(getattr(want, field)[want_row])
        if a.dtype.kind == "f":
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=field)
        else:
            np.testing.assert_array_equal(a, b, err_msg=field)


@AHEAD_FAST_READ_FIRST_EXTENDED
def test_a_slot_refilled_mid_loop_answers_as_the_prompt_alone(chunk_order):
    key = jax.random.key(0)
    batch, stats = _generate(_params(), key=key)
    lengths = np.asarray(batch.response_mask).sum(1)
    # uneven answers, so slots were refilled while others still decoded
    assert len(set(lengths.tolist())) > 2 and lengths.min() >= 1, lengths
    assert stats.refills == len(PROMPTS) - 3
    keys = prompt_keys(key, len(PROMPTS))
    for row, prompt in enumerate(PROMPTS):
        alone, _ = _generate(_params(slots=1), prompts=[prompt], keys=keys[row : row + 1])
        _assert_same_answer(batch, row, alone, 0)


def test_keys_follow_the_prompt_not_its_position():
    """Prompts in another order, each with its own key, get the same answers."""
    key = jax.random.key(1)
    batch, _ = _generate(_params(), key=key)
    order = [4, 7, 0, 8, 2, 6, 1, 3, 5]
    keys = prompt_keys(key, len(PROMPTS))[np.asarray(order)]
    shuffled, _ = _generate(_params(), prompts=[PROMPTS[i] for i in order], keys=keys)
    for position, row in enumerate(order):
        _assert_same_answer(shuffled, position, batch, row)


@AHEAD_FAST_READ_FIRST_EXTENDED
def test_a_short_pool_preempts_and_requeues_without_changing_an_answer(chunk_order):
    roomy, roomy_stats = _generate(_params())
    # 3 slots of up to 6 + 12 tokens: 15 pages of 4 tokens each at worst; 6 make them queue
    short, stats = _generate(_params(kv_pages=6))
    assert stats.preemptions > 0 and roomy_stats.preemptions == 0
    assert stats.peak_pages <= 6 < roomy_stats.peak_pages
    for row in range(len(PROMPTS)):
        _assert_same_answer(short, row, roomy, row)


def test_pages_hold_the_tokens_written_not_the_longest_sequence():
    batch, stats = _generate(_params())
    lengths = np.asarray(batch.response_mask).sum(1) + np.asarray(batch.prompt_mask).sum(1)
    # every sequence held at most ⌈its tokens / page⌉ pages, and 3 such held at once at most
    assert stats.peak_pages <= sum(sorted(-(-lengths // 4))[-3:])
    assert stats.pool_pages == 3 * -(-(PROMPT_SLOTS + 12) // 4)


def test_too_small_a_pool_is_refused_by_name():
    with pytest.raises(ValueError, match="sampling.kv_pages = 4 is too few"):
        _generate(_params(kv_pages=4))
