"""The interface both engines offer (``Engine``, ``RolloutStream``) and the lean host loop
behind it: one device-to-host read per decode call, the next call dispatched before the
last one is read, prompts uploaded only with the call that hands them in."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading

import jax
import numpy as np
import pytest
from jax._src.array import ArrayImpl

from asyncopd_jax.sampling import Engine, make_sampler, prompt_keys, run_stream
from tests.sampling.test_continuous import MODEL, PROMPT_SLOTS, PROMPTS, _assert_same_answer, _params

ENGINES = ["static", "continuous"]
GROUPS = [PROMPTS[0:4], PROMPTS[4:6], PROMPTS[6:9]]


@functools.cache
def _engine(engine: str) -> Engine:
    """The continuous engine of test_continuous (3 slots, 2-step chunks), or the static one."""
    params = _params() if engine == "continuous" else dataclasses.replace(_params(), engine="static", slots=0)
    return make_sampler(MODEL[0], params)


def _keys(g: int):
    return prompt_keys(jax.random.key(30 + g), len(GROUPS[g]))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_stream_hands_back_each_group_as_generate_samples_it(engine):
    """Groups through one stream, one of them submitted while another decodes, a swap to
    identical weights between chunks: each group's batch is `generate`'s, versions aside."""
    e = _engine(engine)
    stream = e.open_stream(MODEL[1], version=0, prompt_slots=PROMPT_SLOTS, slots=e.decode_rows(4))
    assert stream.idle and stream.wants_prompts and stream.pending_groups == 0
    stream.submit(0, GROUPS[0], _keys(0))
    done = dict(stream.step())
    # the static engine decodes one group at a time; the continuous one has 3 slots, 4 queued
    assert stream.wants_prompts == (engine == "continuous")
    stream.submit(1, GROUPS[1], _keys(1))
    stream.submit(2, GROUPS[2], _keys(2))
    assert stream.queued == (sum(map(len, GROUPS[1:])) if engine == "static" else 9 - 3)
    done.update(stream.step())
    stream.swap(1, MODEL[1])
    assert stream.version == 1
    done.update(run_stream(stream))
    assert sorted(done) == [0, 1, 2] and stream.idle and stream.pending_groups == 0
    for g, group in enumerate(GROUPS):
        alone = e.generate(MODEL[1], group, None, keys=_keys(g), prompt_slots=PROMPT_SLOTS)
        got = dataclasses.replace(done[g], token_version=alone.token_version)
        for row in range(len(group)):
            _assert_same_answer(got, row, alone, row)
    versions = np.asarray(done[0].token_version)[np.asarray(done[0].response_mask)]
    assert set(versions.tolist()) == {0, 1}  # group 0 straddles the swap


# The shape each program is called at, read from its arguments as `program_shapes` states it.
CALL_SHAPES = {
    "static": {
        "prefill": lambda args, kw: args[1].shape,  # the prompts [B, P]
        "decode": lambda args, kw: (args[1].prompt_tokens.shape[0], args[1].prompt_slots),
        "recompute": lambda args, kw: (args[1].prompt_tokens.shape[0], args[1].prompt_slots),
    },
    "continuous": {
        "run": lambda args, kw: args[1].slots.active.shape,  # [S]
        "recompute": lambda args, kw: args[1].slots.active.shape,
    },
}


@pytest.mark.parametrize("engine", ENGINES)
def test_a_stream_compiles_only_the_shapes_its_engine_lists(engine, monkeypatch):
    """Groups of 3 through a stream (on the continuous engine 5 slots, 5 pages per sequence:
    3 slots decoding, then 5, then fewer as answers drain), a swap between chunks: each
    program is called only at shapes `program_shapes` lists (the bound `asyncopd plan`
    states), and compiled at most once per shape: on the continuous engine, once."""
    params = dataclasses.replace(_params(), slots=5)
    if engine == "static":
        params = dataclasses.replace(params, engine="static", slots=0)
    e = make_sampler(MODEL[0], params)  # a fresh engine: its compiles are this test's
    called: dict[str, set] = {name: set() for name in e.programs}
    for name, program in e.programs.items():

        def recorded(*args, _name=name, _program=program, **kw):
            called[_name].add(tuple(CALL_SHAPES[engine][_name](args, kw)))
            return _program(*args, **kw)

        monkeypatch.setattr(e, name, recorded)
    groups = [PROMPTS[0:3], PROMPTS[3:6], PROMPTS[6:9]]
    stream = e.open_stream(MODEL[1], version=0, prompt_slots=PROMPT_SLOTS, slots=e.decode_rows(3))
    stream.submit(0, groups[0], prompt_keys(jax.random.key(40), 3))
    done = stream.step()  # 3 slots of 5 decoding
    for g in (1, 2):
        stream.submit(g, groups[g], prompt_keys(jax.random.key(40 + g), 3))
    done += stream.step()
    stream.swap(1, MODEL[1])
    done += run_stream(stream)
    assert sorted(tag for tag, _ in done) == [0, 1, 2]
    monkeypatch.undo()
    listed = e.program_shapes(3, PROMPT_SLOTS)
    assert sorted(listed) == sorted(e.programs)
    for name, shapes in called.items():
        assert shapes <= set(listed[name]), (name, shapes - set(listed[name]))
        assert e.compiled[name] <= len(shapes), (name, e.compiled[name], shapes)
    if engine == "continuous":  # admissions of 3 and of 1, 2 pages and 5 read: branches, not shapes
        assert e.compiled == {"run": 1, "recompute": 1}, e.compiled
    else:
        assert len(called["decode"]) >= 1, called  # the bound is met, not vacuous


@pytest.mark.parametrize("engine", ENGINES)
def test_both_engines_lower_the_same_programs(engine):
    """`asyncopd plan` asks either engine the same: rows per decode, and three programs."""
    e = _engine(engine)
    assert e.decode_rows(8) == (8 if engine == "static" else 3)
    graphdef, state = MODEL
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    lowered = e.lower(abstract, 8, PROMPT_SLOTS)
    assert sorted(lowered) == ["decode", "prefill", "recompute"]
    assert all(isinstance(x, jax.stages.Lowered) for x in lowered.values())


def _explicit_only(method, name: str, explicit: threading.local):
    """``method`` of ``jax.Array`` failing unless called inside ``jax.device_get``."""

    def guarded(self, *args, **kwargs):
        assert getattr(explicit, "on", False), f"an implicit device-to-host read ({name})"
        return method(self, *args, **kwargs)

    return guarded


@contextlib.contextmanager
def counted_reads(monkeypatch: pytest.MonkeyPatch):
    """The explicit ``jax.device_get`` calls made inside, counted; an implicit device-to-host
    read of a ``jax.Array`` (``int(x)``, ``bool(x)``, ``np.asarray(x)``, ...) raises. (A
    transfer guard would say the same on an accelerator; on the CPU nothing is transferred.)"""
    reads: list[int] = []
    explicit = threading.local()
    device_get = jax.device_get

    def counted(x):
        reads.append(1)
        explicit.on = True
        try:
            return device_get(x)
        finally:
            explicit.on = False

    with monkeypatch.context() as patch:
        patch.setattr(jax, "device_get", counted)
        for name in ("__int__", "__bool__", "__float__", "__index__", "__array__", "tolist", "item"):
            patch.setattr(ArrayImpl, name, _explicit_only(getattr(ArrayImpl, name), name, explicit))
        yield reads


@pytest.mark.parametrize("engine", ENGINES)
def test_a_chunk_costs_one_device_to_host_read(engine, monkeypatch):
    """A stream reads each call (a chunk) with one explicit ``jax.device_get``, and nothing
    else: the continuous engine's admissions, pages and preemptions happen on the device."""
    e = _engine(engine)
    stream = e.open_stream(MODEL[1], version=0, prompt_slots=PROMPT_SLOTS, slots=e.decode_rows(4))
    for g in range(3):
        stream.submit(g, GROUPS[g], _keys(g))
    with counted_reads(monkeypatch) as reads:
        done = run_stream(stream)
    assert len(done) == 3
    assert len(reads) == stream.stats.chunks > 3, (len(reads), stream.stats.chunks)


def test_the_static_stream_dispatches_the_next_chunk_before_it_reads_the_last(monkeypatch):
    """A static stream's step dispatches chunk k + 1, then reads chunk k (the device never
    waits for the host); the continuous stream's order: tests/sampling/test_stream.py."""
    e = _engine("static")
    events: list[str] = []
    decode, device_get = e.decode, jax.device_get
    monkeypatch.setattr(e, "decode", lambda *a: events.append("dispatch") or decode(*a))
    monkeypatch.setattr(jax, "device_get", lambda x: events.append("read") or device_get(x))
    stream = e.open_stream(MODEL[1], version=0, prompt_slots=PROMPT_SLOTS)
    stream.submit(0, GROUPS[0], _keys(0))
    run_stream(stream)
    chunks = -(-_params().max_new_tokens // _params().chunk_steps)
    assert 2 < events.count("read") <= chunks
    # dispatch 1, then (dispatch k + 1, read k) per chunk; a chunk ending at T is read alone
    rest = events[1:]
    if len(rest) % 2:
        assert rest.pop() == "read"
    assert events[0] == "dispatch" and rest == ["dispatch", "read"] * (len(rest) // 2), events


def test_prompts_go_to_the_device_only_with_the_call_that_hands_them_in(monkeypatch):
    """9 prompts through 3 slots (a queue of 6 on the device), one step a call: the host
    uploads prompts in the calls that hand some in (the first 6, then the other 3 once 3
    answers were read) and nothing in the others, and the answers are the static engine's
    (which has no queue)."""
    e = make_sampler(MODEL[0], _params(chunk_steps=1))
    stream = e.open_stream(MODEL[1], version=0, prompt_slots=PROMPT_SLOTS)
    stream.submit(0, PROMPTS, prompt_keys(jax.random.key(0), len(PROMPTS)))
    uploads: list[int] = []  # per step: arrays put on the device
    put = e.put
    monkeypatch.setattr(e, "put", lambda x, *axes: uploads.__setitem__(-1, uploads[-1] + 1) or put(x, *axes))
    handed: list[int] = []  # per step: prompts handed in
    done = []
    while not stream.idle:
        uploads.append(0)
        backlog = len(stream.backlog)
        done += stream.step()
        handed.append(backlog - len(stream.backlog))
    assert handed[0] == 6 and sum(handed) == 9 and stream.stats.chunks > 3, handed
    assert [u > 0 for u in uploads] == [h > 0 for h in handed], (uploads, handed)
    ((_, batch),) = done
    alone = _engine("static").generate(MODEL[1], PROMPTS, jax.random.key(0), prompt_slots=PROMPT_SLOTS)
    for row in range(len(PROMPTS)):
        _assert_same_answer(batch, row, alone, row)
