"""The continuous engine's bookkeeping on the device: a ring of queued prompts, a stack of
free pages, the page table, and the choice of the slots to admit into and to preempt.

Small pure functions over fixed shapes, so that admission, page allocation and preemption
run inside the decode loop (:meth:`~asyncopd_jax.sampling.paged.PagedPrograms.run`) and the
host never plans a step. Shapes: S slots, M pages per sequence, N pages in the pool (the
stack's capacity), Q queue entries, P prompt slots, R rows at once.

The free stack holds page ids in ``free[0 .. top − 1]``, the next page handed out at
``top − 1``; the queue holds its prompts at ring positions ``head .. tail − 1`` (mod Q).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Queue:
    """Prompts waiting for a slot, a ring of ``Q`` entries (a preempted prompt goes back in
    front: ``head − 1``)."""

    prompts: Array  # [Q, P] int32, each prompt from position 0
    prompt_len: Array  # [Q] int32
    keys: Array  # [Q] PRNG keys
    row: Array  # [Q] int32 the stream row (the host's name for the prompt)
    head: Array  # scalar int32: the ring position of the first waiting prompt
    tail: Array  # scalar int32: one past the last

    @property
    def size(self) -> Array:
        return self.tail - self.head

    def at(self, offset: Array) -> Array:
        """Ring positions of the entries ``offset [R]`` after the head."""
        return jnp.mod(self.head + offset, self.prompts.shape[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pages:
    """The page table and the free stack."""

    table: Array  # [S, M] int32 each slot's pages (entries past `owned`: stale, read under the mask only)
    owned: Array  # [S] int32 pages a slot holds
    free: Array  # [N] int32 the free stack
    top: Array  # scalar int32 free pages

    @classmethod
    def empty(cls, slots: int, per_sequence: int, pool: int) -> Pages:
        """Every page of a pool of ``pool`` free but the last, which table entries point to
        until a sequence holds them (it is never handed out, so never written)."""
        return cls(
            table=jnp.full((slots, per_sequence), pool - 1, jnp.int32),
            owned=jnp.zeros((slots,), jnp.int32),
            free=jnp.arange(pool - 2, -1, -1, dtype=jnp.int32),  # page 0 handed out first
            top=jnp.int32(pool - 1),
        )


def pages_for(tokens: Array, page_size: int) -> Array:  # ⌈tokens / page_size⌉
    """Pages that hold ``tokens [...]`` tokens each."""
    return (tokens + page_size - 1) // page_size


def prefix_within(need: Array, budget: Array) -> Array:
    """How many of ``need [R]`` (in order) fit in ``budget`` together: the longest prefix
    whose sum is at most ``budget``."""
    return jnp.sum(jnp.cumsum(need) <= budget, dtype=jnp.int32)


def take_pages(pages: Pages, slot: Array, need: Array) -> Pages:
    """Slots ``slot [R]`` (``S``: padding, dropped) each given ``need [R]`` more pages from
    the top of the stack, appended to their table rows; the stack must hold ``sum(need)``."""
    per_sequence = pages.table.shape[1]
    need = jnp.where(slot < pages.table.shape[0], need, 0)
    column = jnp.arange(per_sequence)[None]  # [1, M]
    before = (jnp.cumsum(need) - need)[:, None]  # [R, 1] pages taken by the rows before
    taken = pages.free[jnp.clip(pages.top - 1 - before - column, 0, pages.free.shape[0] - 1)]  # [R, M]
    owned = jnp.take(pages.owned, slot, mode="clip")[:, None]
    at = owned + column  # the table columns the new pages go to
    mine = column < need[:, None]
    rows = jnp.where(mine, slot[:, None], pages.table.shape[0])  # others dropped
    table = pages.table.at[rows, jnp.minimum(at, per_sequence - 1)].set(taken, mode="drop")
    return dataclasses.replace(
        pages,
        table=table,
        owned=pages.owned.at[slot].add(need, mode="drop"),
        top=pages.top - jnp.sum(need, dtype=jnp.int32),
    )


def release_pages(pages: Pages, gone: Array) -> Pages:
    """The pages of slots ``gone [S]`` (bool) pushed back on the stack. Their table rows keep
    naming them: entries past a sequence's own pages are read under the causal mask only."""
    count = jnp.where(gone, pages.owned, 0)  # [S]
    before = (jnp.cumsum(count) - count)[:, None]
    column = jnp.arange(pages.table.shape[1])[None]
    at = jnp.where(column < count[:, None], pages.top + before + column, pages.free.shape[0])  # others dropped
    return dataclasses.replace(
        pages,
        free=pages.free.at[at].set(pages.table, mode="drop"),
        owned=jnp.where(gone, 0, pages.owned),
        top=pages.top + jnp.sum(count, dtype=jnp.int32),
    )


def idle_first(active: Array) -> Array:
    """``[S]`` slot ids, the idle ones first (in order), then the busy ones."""
    return jnp.argsort(active, stable=True).astype(jnp.int32)


def newest(active: Array, admitted: Array) -> Array:
    """The busy slot admitted last (the one to preempt; ``admitted [S]``: admission numbers)."""
    return jnp.argmax(jnp.where(active, admitted, -1)).astype(jnp.int32)
