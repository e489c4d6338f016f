"""The sampling core's rules that the end-to-end sampler tests do not reach: the recompute
after a swap while the last answers drain, the programs the plan lowers.

Written for mutants of ``asyncopd_jax/sampling/`` that survived the sampled mutation run of
2026-11-26 (docs/log/mutation-history.md, "Sampled scores of the newer areas (2026-11-26)").
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.sampling import ContinuousSampler, SamplingParams
from tests.tiny_models import slot_sampling, tiny_decoder

# Prompts of 1 to 5 tokens whose answers (this student, stop tokens 51 and 54) end after 3
# to 12 tokens: slots finish at different times, the last ones drain with idle slots beside.
DRAIN_PROMPTS = [
    [5, 6, 7, 8, 9],
    [10, 11],
    [12, 13, 14],
    [15],
    [16, 17],
    [18, 19, 20, 21],
    [22],
    [23, 24],
    [25, 26, 27],
]


MODEL = nnx.split(tiny_decoder(0, scale=0.7))


@functools.cache
def _drain_engine() -> ContinuousSampler:
    """3 slots, pages of 4 tokens, 2-step chunks: one engine (its compiled programs) for every key."""
    params = slot_sampling()
    return ContinuousSampler(MODEL[0], params)


@pytest.mark.parametrize("seed", [2, 5])
def test_a_swap_while_slots_drain_rewrites_the_sequences_in_flight_only(seed):
    """Bug guarded: the recompute after a weight swap writing the first token of every idle
    slot (``where(active, written, 1)`` instead of 0) into the page its table row still
    names: a page the slot released and another sequence now holds, whose keys and values
    it overwrites. Identical weights are swapped in before every chunk, also while the last
    answers drain (slots idle, their pages reused), so every answer must stay as it is.
    Whether the stale write lands after the owner's own depends on which slot finished:
    under these keys it does (seen failing with the bug for each of them)."""
    engine, state, key = _drain_engine(), MODEL[1], jax.random.key(seed)
    plain = engine.generate(state, DRAIN_PROMPTS, key, prompt_slots=6)
    swapped = engine.generate(state, DRAIN_PROMPTS, key, prompt_slots=6, weight_source=lambda v: (v + 1, state))
    assert np.asarray(swapped.token_version).max() > 3  # swapped in again and again while answers went on
    for field in ("response_mask", "response_tokens", "candidate_ids"):
        np.testing.assert_array_equal(getattr(swapped, field), getattr(plain, field), err_msg=field)
    np.testing.assert_allclose(swapped.behavior_logp, plain.behavior_logp, atol=1e-5)


def test_one_slot_per_prompt_lowers_the_programs_for_a_groups_rows():
    """Bug guarded: the continuous engine's programs for ``asyncopd plan`` sized by
    ``decode_rows(None)`` instead of the group's rows: the same while ``sampling.slots`` is
    set, but with ``slots = 0`` (one slot per prompt of a group) there is no slot count and
    the plan cannot lower the sampler."""
    graphdef, state = MODEL
    engine = ContinuousSampler(graphdef, SamplingParams(max_new_tokens=8, engine="continuous", slots=0, page_size=4))
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    calls = engine.abstract_calls(abstract, 5, 6)
    _, (_, carry, _), _ = calls["decode"]
    # 5 slots (one per prompt), each up to 6 + 8 tokens: 4 pages of 4 tokens a sequence; a
    # queue of 10
    shapes = (carry.slots.prompts.shape, carry.pages.table.shape, carry.queue.prompts.shape)
    assert shapes == ((5, 6), (5, 4), (10, 6))
