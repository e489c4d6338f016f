"""The device-side bookkeeping of the continuous engine against NumPy oracles: pages taken
from and pushed back on the free stack, the prefix of the queue that fits, the slots to
admit into and to preempt."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax.sampling.schedule import (
    Pages,
    idle_first,
    newest,
    pages_for,
    prefix_within,
    release_pages,
    take_pages,
)


def _pages(table, owned, free, top) -> Pages:
    return Pages(
        jnp.asarray(table, jnp.int32), jnp.asarray(owned, jnp.int32), jnp.asarray(free, jnp.int32), jnp.int32(top)
    )


def _oracle_take(table, owned, free, top, slot, need):
    """Row by row: each slot pops its pages off the top of the stack into its next columns."""
    table, owned, free = table.copy(), owned.copy(), list(free[:top])
    for s, n in zip(slot, need):
        if s >= len(owned):
            continue
        for _ in range(n):
            table[s, owned[s]] = free.pop()
            owned[s] += 1
    return table, owned, len(free)


def _oracle_release(table, owned, free, top, gone):
    """Slot by slot: each released slot pushes its pages on the stack, in table order."""
    free, top = free.copy(), top
    for s in np.flatnonzero(gone):
        for j in range(owned[s]):
            free[top] = table[s, j]
            top += 1
    return free, np.where(gone, 0, owned), top


def test_empty_pages_hand_out_page_zero_first_and_never_the_last():
    p = Pages.empty(slots=2, per_sequence=3, pool=6)
    assert int(p.top) == 5 and np.asarray(p.free)[4] == 0 and 5 not in np.asarray(p.free).tolist()
    assert (np.asarray(p.table) == 5).all()


@pytest.mark.parametrize("seed", range(4))
def test_take_pages_matches_popping_them_one_by_one(seed):
    rng = np.random.default_rng(seed)
    slots, per_sequence, pool = 5, 6, 40
    owned = rng.integers(0, 3, slots)
    table = rng.integers(0, pool, (slots, per_sequence))
    free = rng.permutation(pool)
    top = 30
    slot = np.asarray([3, 0, slots, 4])  # slot S: padding
    need = np.asarray([2, 3, 2, 0])
    want = _oracle_take(table, owned, free, top, slot, need)
    got = take_pages(_pages(table, owned, free, top), jnp.asarray(slot), jnp.asarray(need))
    np.testing.assert_array_equal(np.asarray(got.table), want[0])
    np.testing.assert_array_equal(np.asarray(got.owned), want[1])
    assert int(got.top) == top - 5  # the padding row takes none


@pytest.mark.parametrize("seed", range(4))
def test_release_pages_matches_pushing_them_one_by_one(seed):
    rng = np.random.default_rng(seed)
    slots, per_sequence, pool = 5, 6, 40
    owned = rng.integers(0, per_sequence + 1, slots)
    table = rng.integers(0, pool, (slots, per_sequence))
    free = rng.permutation(pool)
    top = 4
    gone = rng.random(slots) < 0.6
    want_free, want_owned, want_top = _oracle_release(table, owned, free, top, gone)
    got = release_pages(_pages(table, owned, free, top), jnp.asarray(gone))
    assert int(got.top) == want_top
    np.testing.assert_array_equal(np.asarray(got.free)[:want_top], want_free[:want_top])
    np.testing.assert_array_equal(np.asarray(got.owned), want_owned)
    np.testing.assert_array_equal(np.asarray(got.table), table)  # rows keep naming their pages


def test_pages_taken_then_released_leave_the_stack_as_it_was():
    p = Pages.empty(slots=3, per_sequence=4, pool=13)
    taken = take_pages(p, jnp.asarray([0, 2]), jnp.asarray([3, 2]))
    assert sorted(np.asarray(taken.table)[[0, 0, 0, 2, 2], [0, 1, 2, 0, 1]].tolist()) == [0, 1, 2, 3, 4]
    back = release_pages(taken, jnp.asarray([True, False, True]))
    assert int(back.top) == int(p.top)
    assert sorted(np.asarray(back.free).tolist()) == list(range(12))


@pytest.mark.parametrize(
    ("need", "budget", "want"), [([2, 1, 3], 3, 2), ([2, 1, 3], 6, 3), ([4, 1], 3, 0), ([1, 1], -1, 0)]
)
def test_prefix_within(need, budget, want):
    """The longest prefix that fits, not the most rows (``[4, 1]`` in 3: none, in order)."""
    assert int(prefix_within(jnp.asarray(need), jnp.int32(budget))) == want


def test_idle_first_and_newest():
    active = jnp.asarray([True, False, True, False, False])
    assert np.asarray(idle_first(active)).tolist() == [1, 3, 4, 0, 2]
    admitted = jnp.asarray([7, 9, 3, 1, 0])
    assert int(newest(active, admitted)) == 0  # slot 1 is newer but idle


def test_pages_for():
    assert np.asarray(pages_for(jnp.asarray([0, 1, 4, 5]), 4)).tolist() == [0, 1, 1, 2]
