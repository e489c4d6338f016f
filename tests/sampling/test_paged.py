"""The continuous engine's scheduler, one part at a time, against a host-side oracle of its
rules (asyncopd_jax/sampling/paged.py's docstrings):

- admission: as many queued prompts as there are idle slots and free pages for, after one
  page is set aside for each busy slot whose next token starts a page;
- growth: each such slot gets its page; while the stack has too few, the busy sequence
  admitted last is preempted (its pages freed, its prompt back in front of the queue).

Each part runs on states built here, random ones included, so that a wrong victim or a
reservation one page off shows in what the part returns, not as a slower or endless run."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.sampling import ContinuousSampler, SamplingParams
from asyncopd_jax.sampling.carry import Counts, Scheduled
from asyncopd_jax.sampling.schedule import pages_for, take_pages
from tests.tiny_models import tiny_decoder

SLOTS, PAGE, PROMPT_SLOTS, NEW = 6, 4, 6, 10
PER_SEQUENCE = -(-(PROMPT_SLOTS + NEW) // PAGE)  # 4
POOL = SLOTS * PER_SEQUENCE + 1
MODEL = nnx.split(tiny_decoder(0, scale=0.7))


@functools.cache
def _engine() -> ContinuousSampler:
    params = SamplingParams(max_new_tokens=NEW, engine="continuous", slots=SLOTS, page_size=PAGE, chunk_steps=2)
    return ContinuousSampler(MODEL[0], params)


@dataclasses.dataclass
class State:
    """A scheduler state, as the host-side oracle reads it (one entry per slot)."""

    active: list[bool]
    admitted: list[int]  # admission numbers, distinct among the busy slots
    written: list[int]  # tokens in the cache
    owned: list[int]  # pages held
    queued: list[int]  # the queued prompts' lengths, in order
    free: int  # pages on the free stack

    def growing(self) -> list[bool]:
        """The busy slots whose next token starts a page they do not hold yet."""
        return [a and w // PAGE >= o for a, w, o in zip(self.active, self.written, self.owned, strict=True)]


def _random_state(rng: np.random.Generator, reserve: bool) -> State:
    """Busy slots holding the pages of what they wrote (half of them at a page boundary),
    idle ones holding none, a queue, and a free stack of at most what the pool has left:
    0 to 3 pages, or (``reserve``) the growing slots' pages and 0 to 6 more."""
    active = list(rng.random(SLOTS) < 0.6)
    written, owned = [], []
    for busy in active:
        w = int(rng.integers(1, PROMPT_SLOTS + NEW)) if busy else 0
        if busy and rng.random() < 0.5:
            w = min(PAGE * max(1, w // PAGE), PROMPT_SLOTS + NEW - 1)  # the next token starts a page
        written.append(w)
        owned.append(min(int(pages_for(w, PAGE)), PER_SEQUENCE) if busy else 0)
    left = POOL - 1 - sum(owned)
    growing = sum(b and w // PAGE >= o for b, w, o in zip(active, written, owned, strict=True))
    free = min(left, (growing if reserve else 0) + int(rng.integers(0, 7 if reserve else 4)))
    order = rng.permutation(np.arange(1, SLOTS + 1)) + int(rng.integers(0, 20))
    queued = [int(n) for n in rng.integers(1, PROMPT_SLOTS + 1, size=int(rng.integers(0, 2 * SLOTS + 1)))]
    return State(active, [int(a) if b else 0 for a, b in zip(order, active, strict=True)], written, owned, queued, free)


def _scheduled(state: State) -> Scheduled:
    """The engine's carry holding ``state``: pages given out as ``owned`` says (``free`` left
    on the stack), the queue filled with prompts of the lengths given, rows 100, 101, …"""
    engine = _engine()
    carry = engine.empty(MODEL[1], SLOTS, PROMPT_SLOTS, POOL)
    pages = take_pages(carry.pages, jnp.arange(SLOTS), jnp.asarray(state.owned, jnp.int32))
    spare = int(pages.top) - state.free  # pages neither free nor a busy slot's: taken by idle slots' rows
    pages = dataclasses.replace(pages, top=pages.top - spare)
    q = carry.queue
    n = len(state.queued)
    lengths = np.zeros(q.prompt_len.shape, np.int32)
    lengths[:n] = state.queued
    prompts = np.where(np.arange(PROMPT_SLOTS)[None] < lengths[:, None], 7, 0).astype(np.int32)
    s = carry.slots
    slots = dataclasses.replace(
        s,
        active=jnp.asarray(state.active),
        admitted=jnp.asarray(state.admitted, jnp.int32),
        written=jnp.asarray(state.written, jnp.int32),
        prompt_len=jnp.asarray([min(w, PROMPT_SLOTS) for w in state.written], jnp.int32),
        row=jnp.arange(SLOTS, dtype=jnp.int32),
    )
    queue = dataclasses.replace(
        q,
        prompts=jnp.asarray(prompts),
        prompt_len=jnp.asarray(lengths),
        row=jnp.arange(100, 100 + q.row.shape[0], dtype=jnp.int32),
        tail=jnp.int32(n),
    )
    admissions = jnp.int32(max(state.admitted, default=0))
    return dataclasses.replace(carry, slots=slots, pages=pages, queue=queue, admissions=admissions)


def _grow_oracle(state: State) -> tuple[list[int], list[int], int]:
    """The victims in the order preempted, every slot's pages after, the free pages after."""
    active, owned, free = list(state.active), list(state.owned), state.free
    victims = []
    while sum(g for g, a in zip(state.growing(), active, strict=True) if a) > free:
        victim = max((i for i in range(SLOTS) if active[i]), key=lambda i: state.admitted[i])
        victims.append(victim)
        active[victim], free, owned[victim] = False, free + owned[victim], 0
    for i in range(SLOTS):
        if active[i] and state.growing()[i]:
            owned[i], free = owned[i] + 1, free - 1
    return victims, owned, free


@pytest.mark.parametrize("seed", range(4))
def test_growth_preempts_the_busy_sequences_admitted_last_until_every_growing_slot_has_a_page(seed):
    """Random states (tight pools among them): the victims, in order, are the busy slots of
    the highest admission numbers; each goes back to the front of the queue, so the queue
    starts with the victims, the last preempted first; the survivors that start a page hold
    one more; the free stack is what is left."""
    rng = np.random.default_rng(seed)
    grow = jax.jit(lambda carry: _engine()._grow(carry, Counts.zero()))
    preempting = 0
    for _ in range(12):
        state = _random_state(rng, reserve=False)
        victims, owned, free = _grow_oracle(state)
        carry, counts = grow(_scheduled(state))
        assert int(counts.preemptions) == len(victims), (state, victims)
        survivors = [a and i not in victims for i, a in enumerate(state.active)]
        np.testing.assert_array_equal(np.asarray(carry.slots.active), survivors)
        np.testing.assert_array_equal(np.asarray(carry.pages.owned), owned)
        assert int(carry.pages.top) == free
        q = carry.queue
        front = [int(q.row[(int(q.head) + j) % q.row.shape[0]]) for j in range(len(victims))]
        assert front == victims[::-1], (front, victims)  # a victim's row is its slot here
        assert int(q.size) == len(state.queued) + len(victims)
        preempting += bool(victims)
    assert preempting >= 2  # the states exercise preemption, not only growth


def test_growth_preempts_the_newest_even_where_it_is_not_the_last_busy_slot():
    """Slots admitted 3, 9, 5, 2 (slot 1 the newest), all four at a page boundary, one free
    page: slot 1 goes first (4 pages back), then the three others grow by a page each."""
    state = State(
        active=[True, True, True, True, False, False],
        admitted=[3, 9, 5, 2, 0, 0],
        written=[8, 12, 8, 4, 0, 0],
        owned=[2, 3, 2, 1, 0, 0],
        queued=[2],
        free=1,
    )
    assert _grow_oracle(state) == ([1], [3, 0, 3, 2, 0, 0], 1)
    carry, counts = jax.jit(lambda c: _engine()._grow(c, Counts.zero()))(_scheduled(state))
    assert int(counts.preemptions) == 1
    np.testing.assert_array_equal(np.asarray(carry.slots.active), [True, False, True, True, False, False])
    np.testing.assert_array_equal(np.asarray(carry.pages.owned), [3, 0, 3, 2, 0, 0])
    assert int(carry.queue.row[int(carry.queue.head)]) == 1


def _admission_oracle(state: State) -> int:
    """Prompts admitted: of the queue's first (idle slots) prompts, the longest prefix whose
    pages (prompt and one answer token) fit the free stack less a page per growing slot."""
    budget = state.free - sum(state.growing())
    room = min(state.active.count(False), len(state.queued))
    n, used = 0, 0
    for length in state.queued[:room]:
        need = min(int(pages_for(length + 1, PAGE)), PER_SEQUENCE)
        if used + need > budget:
            break
        n, used = n + 1, used + need
    return n


@pytest.mark.parametrize("seed", range(3))
def test_admission_sets_a_page_aside_for_each_busy_slot_that_starts_one(seed):
    """Random states, and the growth after it: the admitted prompts are the oracle's (their
    pages taken from the stack, the idle slots filled in order), and growth then preempts
    no one that was busy before, having kept a page for each slot at a page boundary."""
    rng = np.random.default_rng(100 + seed)
    engine = _engine()

    def step(state, carry):
        carry, counts = engine._admission(engine._model(state), carry, Counts.zero(), jnp.int32(0))
        return engine._grow(carry, counts)

    step = jax.jit(step)
    boundary = 0
    for _ in range(12):
        state = _random_state(rng, reserve=True)
        n = _admission_oracle(state)
        queued = state.queued[:n]
        need = sum(min(int(pages_for(length + 1, PAGE)), PER_SEQUENCE) for length in queued)
        carry, counts = step(MODEL[1], _scheduled(state))
        if sum(state.growing()) > state.free:  # short already: growth preempts (the test above)
            assert n == 0 and int(carry.queue.head) <= 0
            continue
        assert int(carry.queue.head) == n, (state, n)
        assert int(carry.admissions) - max(state.admitted, default=0) == n
        idle = [i for i, a in enumerate(state.active) if not a][:n]
        np.testing.assert_array_equal(np.asarray(carry.slots.row)[idle], np.arange(100, 100 + n))
        assert int(counts.preemptions) == 0, state
        grown = sum(state.growing())
        assert int(carry.pages.top) == state.free - need - grown
        boundary += (
            bool(n)
            and grown > 0
            and state.free - need - grown < min(pages_for(length + 1, PAGE) for length in state.queued[n:] or [PAGE])
        )
    assert boundary >= 2  # states where the reserved pages held a prompt back


def test_a_prompt_waits_where_it_would_take_a_growing_slots_page():
    """Slots 0 and 1 busy at a page boundary (8 and 4 tokens written, 2 and 1 pages held),
    5 free pages, prompts of 3, 3 and 6 tokens queued (1, 1 and 2 pages with their first
    answer token): two pages are set aside, so the first two prompts enter (2 pages) and the
    third waits; growth then gives slots 0 and 1 their pages, preempting no one."""
    state = State(
        active=[True, True, False, False, False, False],
        admitted=[1, 2, 0, 0, 0, 0],
        written=[8, 4, 0, 0, 0, 0],
        owned=[2, 1, 0, 0, 0, 0],
        queued=[3, 3, 6],
        free=5,
    )
    assert _admission_oracle(state) == 2
    engine = _engine()

    @jax.jit
    def step(weights, carry):
        carry, counts = engine._admission(engine._model(weights), carry, Counts.zero(), jnp.int32(0))
        return engine._grow(carry, counts)

    carry, counts = step(MODEL[1], _scheduled(state))
    assert int(carry.queue.head) == 2 and int(counts.preemptions) == 0
    np.testing.assert_array_equal(np.asarray(carry.slots.active), [True] * 4 + [False] * 2)
    np.testing.assert_array_equal(np.asarray(carry.pages.owned), [3, 2, 1, 1, 0, 0])
    assert int(carry.pages.top) == 1
