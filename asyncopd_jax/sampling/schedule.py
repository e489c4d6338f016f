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

    prompts: Array  # [Q, C] int32, each context (a prompt, or a continuation's trajectory) from position 0
    prompt_len: Array  # [Q] int32
    begin: Array  # [Q] int32 the answer column its turn starts at (context tokens past the prompt)
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


def queue_positions(queue: Queue, count: Array, front: Array) -> tuple[Array, Array, Array]:
    """Ring positions of ``R`` incoming entries, the first ``count`` of them real: those
    marked ``front [R]`` (multi-turn continuations, whose trajectories are under way) ahead
    of the waiting prompts, in order, the others behind them. Returns the positions ``[R]``
    (``Q``: not queued), the new head and the new tail."""
    size = queue.prompts.shape[0]
    real = jnp.arange(front.shape[0]) < count
    ahead, behind = real & front, real & ~front
    head = queue.head - jnp.sum(ahead, dtype=jnp.int32)
    at = jnp.where(ahead, head + jnp.cumsum(ahead) - 1, queue.tail + jnp.cumsum(behind) - 1)
    return jnp.where(real, jnp.mod(at, size), size), head, queue.tail + jnp.sum(behind, dtype=jnp.int32)


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
    """The pages of table rows ``gone [≤ S + Z]`` (bool; rows past it: kept) pushed back on
    the stack. Their table rows keep naming them: entries past a sequence's own pages are
    read under the causal mask only."""
    gone = jnp.pad(gone, (0, pages.owned.shape[0] - gone.shape[0]))
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


# --- multi-turn: sequences parked while their environment answers -------------------------
#
# A slot whose turn called a tool (``SamplingParams.tool_call_ids``) parks: its sequence
# leaves the slot, which the next queued prompt may take, and its pages move to one of Z
# rows of the page table after the S slots' (``table [S + Z, M]``), held until the
# observation comes back as a continuation (its pages move into the slot that admits it)
# or the host releases them (the episode ended). Pages run short: the oldest parked
# sequence is evicted first (its continuation is then prefilled from position 0).


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Parked:
    """``Z`` parked sequences, entry ``z`` holding its pages in table row ``S + z``."""

    row: Array  # [Z] int32 the stream row parked (-1: a free entry)
    written: Array  # [Z] int32 tokens in its pages
    version: Array  # [Z] int32 the weights' version its pages were written under
    order: Array  # [Z] int32 when it parked (parks so far, then): the oldest is evicted first

    @classmethod
    def empty(cls, entries: int) -> Parked:
        free = jnp.full((entries,), -1, jnp.int32)
        return cls(row=free, written=jnp.zeros_like(free), version=jnp.zeros_like(free), order=jnp.zeros_like(free))

    @property
    def used(self) -> Array:
        return self.row >= 0

    def find(self, row: Array) -> Array:
        """The entries ``[R]`` holding stream rows ``row [R]`` (``Z``: not parked)."""
        match = (self.row[None, :] == row[:, None]) & self.used[None, :]
        return jnp.where(jnp.any(match, axis=1), jnp.argmax(match, axis=1), self.row.shape[0]).astype(jnp.int32)


def evict(pages: Pages, parked: Parked, gone: Array) -> tuple[Pages, Parked]:
    """Parked entries ``gone [Z]`` (bool) freed, their pages pushed back on the stack."""
    slots = pages.table.shape[0] - parked.row.shape[0]
    rows = jnp.concatenate([jnp.zeros((slots,), bool), gone & parked.used])
    return release_pages(pages, rows), dataclasses.replace(parked, row=jnp.where(gone, -1, parked.row))


def oldest_parked(parked: Parked, count: Array) -> Array:
    """``[Z]`` bool: the ``count`` parked entries that parked first."""
    rank = jnp.argsort(jnp.argsort(jnp.where(parked.used, parked.order, jnp.iinfo(jnp.int32).max)))
    return parked.used & (rank < count)


def park(
    pages: Pages, parked: Parked, going: Array, row: Array, written: Array, version: Array, parks: Array
) -> tuple[Pages, Parked, Array]:
    """Slots ``going [S]`` (bool) parked: the oldest parked entries evicted while too few are
    free, then each slot's pages moved to a free entry's table row (``row``, ``written [S]``:
    the slots' stream rows and tokens in their pages; ``version``: the weights'; ``parks``:
    parks so far). Returns the pages, the entries and how many were evicted."""
    slots, entries = going.shape[0], parked.row.shape[0]
    short = jnp.maximum(jnp.sum(going) - jnp.sum(~parked.used), 0)
    gone = oldest_parked(parked, short)
    pages, parked = evict(pages, parked, gone)
    rank = jnp.cumsum(going) - 1  # the k-th parking slot takes the k-th free entry
    entry = jnp.where(going, idle_first(parked.used)[jnp.clip(rank, 0, entries - 1)], entries)  # others dropped
    table_row = slots + entry
    table = pages.table.at[table_row].set(pages.table[:slots], mode="drop")
    owned = pages.owned.at[table_row].set(pages.owned[:slots], mode="drop")
    owned = owned.at[:slots].set(jnp.where(going, 0, owned[:slots]))
    ordered = parks + rank
    parked = Parked(
        row=parked.row.at[entry].set(row, mode="drop"),
        written=parked.written.at[entry].set(written, mode="drop"),
        version=parked.version.at[entry].set(version, mode="drop"),
        order=parked.order.at[entry].set(ordered, mode="drop"),
    )
    return dataclasses.replace(pages, table=table, owned=owned), parked, jnp.sum(gone, dtype=jnp.int32)


def unpark(pages: Pages, parked: Parked, home: Array, slot: Array, version: Array) -> tuple[Pages, Parked, Array]:
    """Entries ``home [R]`` (``Z``: none) moved into slots ``slot [R]`` (beyond the table:
    none): their pages into the slots' table rows, the entries freed. Returns the pages, the
    entries and ``[R]`` the tokens already in each slot's pages under weights ``version``
    (a sequence parked under older weights is rewritten from position 0)."""
    slots, entries = pages.table.shape[0] - parked.row.shape[0], parked.row.shape[0]
    moving = (home < entries) & (slot < slots)
    source = slots + jnp.minimum(home, entries - 1)
    target = jnp.where(moving, slot, pages.table.shape[0])  # others dropped
    table = pages.table.at[target].set(pages.table[source], mode="drop")
    owned = pages.owned.at[target].set(pages.owned[source], mode="drop")
    owned = owned.at[jnp.where(moving, source, pages.table.shape[0])].set(0, mode="drop")
    entry = jnp.where(moving, home, entries)
    fresh = moving & (parked.version[jnp.minimum(home, entries - 1)] == version)
    start = jnp.where(fresh, parked.written[jnp.minimum(home, entries - 1)], 0)
    parked = dataclasses.replace(parked, row=parked.row.at[entry].set(-1, mode="drop"))
    return dataclasses.replace(pages, table=table, owned=owned), parked, start
