"""The sampling core's rules that the end-to-end sampler tests do not reach: which slots a
decode runs, the recompute after a swap while the last answers drain.

Written for mutants of ``asyncopd_jax/sampling/`` that survived the sampled mutation run of
2026-11-26 (docs/testing.md, "Sampled scores of the newer areas").
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.sampling import ContinuousSampler, SamplingParams
from asyncopd_jax.sampling.stream import ContinuousStream
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


def _stream_with(row_of: list[int | None]) -> ContinuousStream:
    """A stream's slot bookkeeping alone (no engine, nothing compiled): slot s holds stream
    row ``row_of[s]``, or nothing."""
    stream = ContinuousStream.__new__(ContinuousStream)
    stream.slots, stream.row_of = len(row_of), list(row_of)
    return stream


@pytest.mark.parametrize(
    ("row_of", "want"),
    [
        ([None, 5, None, None, 7, None, None, 9], [1, 4, 7, 0]),  # 3 occupied: 4 rows
        ([None, None, 2, None, None, None, None, None], [2]),  # 1 occupied: 1 row
        ([None, 4, None, None, 6, None, None, None], [1, 4]),  # 2 occupied: 2 rows
        ([0, 1, 2, None, 4, 5, None, 7], list(range(8))),  # 6 occupied: every slot
    ],
)
def test_a_decode_runs_the_occupied_slots_and_idle_ones_up_to_a_power_of_two(row_of, want):
    """Bug guarded: the rows that pad a narrowed decode to a power of two taken from the
    occupied slots instead of the idle ones (``is not None``): an occupied slot then decodes
    in two rows at once, which counts its tokens twice in the stream's statistics and ends
    a chunk early (its finished rows count twice towards the refill)."""
    rows = _stream_with(row_of).decode_rows()
    assert rows.dtype == np.int32
    assert rows.tolist() == want
    assert len(set(rows.tolist())) == len(rows)


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
    _, (_, carry, table, rows, _, _), static = calls["decode"]
    _, (_, _, new, _), _ = calls["prefill"]
    # 5 slots (one per prompt), each up to 6 + 8 tokens: 4 pages of 4 tokens a sequence
    shapes = (carry.prompts.shape, table.shape, rows.shape, new.prompts.shape)
    assert (shapes, static) == (((5, 6), (5, 4), (5,), (5, 6)), {"columns": 4})
