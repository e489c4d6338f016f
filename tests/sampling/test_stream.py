"""A stream of groups through the continuous engine: each group answers as it would alone,
is handed back as soon as its last answer ends, and the decode narrows as slots empty."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from asyncopd_jax.sampling import prompt_keys, run_stream
from asyncopd_jax.sampling.stream import ContinuousStream
from tests.sampling.test_continuous import MODEL, PROMPT_SLOTS, PROMPTS, _assert_same_answer, _engine, _params

GROUPS = [PROMPTS[0:4], PROMPTS[4:6], PROMPTS[6:9]]


def _stream(**changes) -> ContinuousStream:
    return _engine(_params(**changes)).open_stream(MODEL[1], version=0, prompt_slots=PROMPT_SLOTS)


def test_each_group_of_a_stream_answers_as_it_would_alone():
    """Three groups through 3 slots, the second submitted mid-stream: every answer equals its
    group's own `generate` with the same keys (slots refilled across groups, narrowed rows)."""
    stream = _stream()
    keys = [prompt_keys(jax.random.key(10 + g), len(group)) for g, group in enumerate(GROUPS)]
    stream.submit(0, GROUPS[0], keys[0])
    done = dict(stream.step())
    stream.submit(1, GROUPS[1], keys[1])
    stream.submit(2, GROUPS[2], keys[2])
    done.update(run_stream(stream))
    assert sorted(done) == [0, 1, 2] and stream.idle and stream.pending_groups == 0
    assert stream.stats.refills == sum(map(len, GROUPS)) - 3
    for g, group in enumerate(GROUPS):
        alone = _engine(_params()).generate(MODEL[1], group, None, keys=keys[g], prompt_slots=PROMPT_SLOTS)
        for row in range(len(group)):
            _assert_same_answer(done[g], row, alone, row)


def test_a_group_is_handed_back_by_the_step_after_its_last_answer_ends():
    """With a slot per prompt and one decode step per chunk, every prompt starts at step 0:
    a group comes back from the step after the chunk of its longest answer (which reads that
    chunk, dispatches the next and then hands the group back), not when the stream goes idle."""
    stream = _stream(slots=len(PROMPTS), chunk_steps=1)
    for g, group in enumerate(GROUPS):
        stream.submit(g, group, prompt_keys(jax.random.key(20 + g), len(group)))
    handed_back: dict[int, int] = {}
    batches = {}
    step = 0
    while not stream.idle:
        step += 1
        for g, batch in stream.step():
            handed_back[g], batches[g] = step, batch
    longest = {g: int(np.asarray(b.response_mask).sum(1).max()) for g, b in batches.items()}
    assert handed_back == {g: n + 1 for g, n in longest.items()}
    assert len(set(longest.values())) > 1, longest  # the groups end at different steps


def test_the_decode_narrows_to_the_slots_in_flight():
    """As the last answers drain, the decode runs the occupied slots (a power of two), not all."""
    stream = _stream(slots=8, chunk_steps=1)
    stream.submit(0, PROMPTS[:8], prompt_keys(jax.random.key(0), 9)[:8])  # uneven answers (test_continuous)
    widths = []
    while not stream.idle:
        stream.step()
        if stream.unread is not None:  # the chunk just dispatched: the slots in flight, the rows it decodes
            widths.append((stream.in_flight, len(stream.unread.rows)))
    assert all(rows == 1 << (n - 1).bit_length() for n, rows in widths), widths
    assert stream.stats.row_steps == sum(rows for _, rows in widths)  # one step per chunk
    assert stream.stats.row_steps < 8 * stream.stats.decode_steps


def test_a_stream_needs_slots():
    with pytest.raises(ValueError, match="a stream needs slots >= 1"):
        _stream(slots=0)
