"""A stream of groups through the continuous engine: each group answers as it would alone,
is handed back as soon as its last answer ends, and the device refills its slots itself."""

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


def test_each_group_of_a_stream_answers_as_it_would_alone(chunk_order):
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


@pytest.mark.extended  # one call per decode step, 18 s: CI's second step
def test_a_group_is_handed_back_by_the_step_after_its_last_answer_ends():
    """With a slot per prompt and one decode step per chunk, every prompt starts at step 0:
    a group comes back from the step after the chunk of its longest answer (which dispatches
    the next chunk, reads that one and hands the group back), not when the stream goes idle."""
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


def test_the_device_refills_a_slot_in_the_step_after_its_answer_ends():
    """6 prompts through 3 slots, all handed in with the first call (a queue of 6), a pool
    with room for all: inside that one call, while prompts wait, every slot decodes at
    every step (an answer that ends is replaced at the next step, without the host)."""
    stream = _stream(chunk_steps=100)
    stream.submit(0, PROMPTS[3:], prompt_keys(jax.random.key(0), 9)[3:])  # uneven answers (test_continuous)
    stream.step()
    stream.step()  # reads the first call
    s = stream.stats
    assert s.chunks == 1 and s.refills > 0 and s.waiting_row_steps > 0, s
    assert s.waiting_tokens == s.waiting_row_steps, s
    ((_, batch),) = run_stream(stream)
    assert stream.stats.refills == 3


def test_the_decode_narrows_to_the_slots_in_flight():
    """8 prompts in 9 slots, all admitted at the first step: at step k the busy slots are the
    answers longer than k, and the step decodes them in the narrowest power of two that
    holds them (not all 9), so the rows decoded are the sum of those widths."""
    stream = _stream(slots=len(PROMPTS), chunk_steps=1)  # the engine of the test above
    stream.submit(0, PROMPTS[:8], prompt_keys(jax.random.key(0), 9)[:8])  # uneven answers (test_continuous)
    ((_, batch),) = run_stream(stream)
    lengths = np.asarray(batch.response_mask).sum(1)
    busy = [int((lengths > k).sum()) for k in range(int(lengths.max()))]
    assert len(set(busy)) > 2, busy
    assert stream.stats.decode_steps == len(busy)
    assert stream.stats.row_steps == sum(1 << (n - 1).bit_length() for n in busy), busy


def test_a_busy_device_gets_the_next_chunk_before_the_last_is_read(chunk_order, monkeypatch):
    """A device still decoding has the next call queued before the host reads the last one;
    a device done with it is read first. One read per step (refills and the drain included)."""
    stream = _stream(slots=4, chunk_steps=2)
    for g, group in enumerate(GROUPS):
        stream.submit(g, group, prompt_keys(jax.random.key(30 + g), len(group)))
    events: list[str] = []
    run, device_get = stream.engine.run, jax.device_get
    monkeypatch.setattr(stream.engine, "run", lambda *a, **k: (events.append("dispatch"), run(*a, **k))[1])
    monkeypatch.setattr(jax, "device_get", lambda x: (events.append("read"), device_get(x))[1])
    steps = []
    while not stream.idle:
        events.clear()
        stream.step()
        steps.append(tuple(events))
    order = ("dispatch", "read") if chunk_order == "ahead" else ("read", "dispatch")
    assert steps[0] == ("dispatch",), steps
    assert set(steps[1:-1]) == {order}, steps
    assert steps[-1] in {order, ("read",)}, steps
    assert stream.stats.refills > 0  # slots were refilled


def test_a_chunk_the_device_finished_is_not_busy():
    stream = _stream()
    stream.submit(0, GROUPS[0], prompt_keys(jax.random.key(0), len(GROUPS[0])))
    stream.step()
    assert stream.unread is not None
    jax.block_until_ready(stream.unread)
    assert not ContinuousStream.device_busy(stream.unread)


def test_a_stream_needs_slots():
    with pytest.raises(ValueError, match="a stream needs slots >= 1"):
        _stream(slots=0)
