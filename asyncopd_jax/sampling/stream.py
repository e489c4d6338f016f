"""The host side of continuous batching: a stream of prompt groups through the slots of the
paged programs (:class:`~asyncopd_jax.sampling.paged.PagedPrograms`).

A :class:`ContinuousStream` keeps the slots and the page pool alive across groups. Groups
of prompts are submitted whenever the caller likes (a rollout stage: as the capacity rule
allows); their prompts queue for slots in submission order; each :meth:`~ContinuousStream.step`
runs one chunk and hands back the groups whose every answer has ended, while the other
groups go on decoding:

    submit(g1) submit(g2)          step → []        step → [g2]       step → [g1]
    queue: g1 g1 g1 g2 g2  ──▶  slots decoding  ──▶  g2's short answers  ──▶  g1's long
                                                     ended: g2 handed on     answer ended

Per step (the order when the chunk dispatched by the step before is still decoding; when the
device has finished it, step 4 comes first and the rest plans from the slots it left):

1. every decoding slot gets the pages its next two chunks may write (the one in flight and
   the next; preempting the most recently admitted sequence if the pool runs short: it is
   re-queued in front, and re-sampled from its start); the page table goes to the device
   only when it changed;
2. queued prompts enter free slots (one batched prefill into their pages);
3. dispatch the next chunk: the occupied slots decode, gathered into the fewest rows (a
   power of two) that hold them, so that the decode's width follows the sequences in
   flight as the last answers drain; the chunk leaves early once an eighth of the slots
   more are free than at its start and prompts wait, so a finished slot idles briefly;
4. read the chunk before it: one transfer (:class:`~asyncopd_jax.sampling.paged.Progress`)
   of each slot's state and the records the chunk wrote, which the host appends to its
   copy of the answers (the device's ``[S, T]`` records are never read); the slots that
   finished free their slots and pages;
5. hand back the groups whose last answer ended in the chunk read, while the device
   decodes the next one.

So a busy device has the next chunk queued while the host reads the last one, hands groups
back and the caller works between steps (scoring, polling for weights). Planning a chunk
from the slots as they were one chunk earlier changes no answer: prompt i's token t
is drawn with ``fold_in(keys[i], t)`` whatever its slot, its admission time or a
preemption (re-sampled, it draws the same tokens). What it costs: a slot that finished in
the chunk in flight idles one chunk more, each decoding slot holds pages for two chunks,
and a read must not take a slot's records for the sequence that holds it now when the
chunk decoded the one before (a slot freed and refilled, or preempted, meanwhile): each
chunk keeps the admission every slot held when it was dispatched (its ``tenants``), and
a read takes only the slots whose tenant is still there. A device that already finished
the chunk waits on the host either way: then the step reads first, and no slot idles
longer than it must (measured in ``docs/results.md``: ahead always, the slots of a small
model on a GPU were 0.79 used instead of 0.92, and the answers came 0.75× as fast).

Between steps the caller may :meth:`~ContinuousStream.swap` in newer weights: before the
next chunk the pages of every slot in flight are rewritten under them (the written tokens
only).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.models.partitioning import mesh_context
from asyncopd_jax.sampling.engine import EngineStats
from asyncopd_jax.sampling.paged import Admission, PagedPrograms, Progress
from asyncopd_jax.sampling.records import Records, left_pad, rollout_batch

Array = jax.Array


def bucket(n: int, limit: int) -> int:
    """The smallest power of two ≥ ``n``, at most ``limit``: few compiled shapes."""
    return min(1 << max(n - 1, 0).bit_length(), limit)


def buckets(limit: int) -> tuple[int, ...]:
    """Every value :func:`bucket` takes for ``n`` in ``1 .. limit``: the powers of two below
    ``limit``, and ``limit``."""
    return tuple(sorted({bucket(n, limit) for n in range(1, limit + 1)}))


@dataclasses.dataclass
class _Group:
    """A submitted group: its stream rows, its prompts as the batch records them, and its
    answers as they end."""

    tag: Any
    rows: list[int]
    prompt_tokens: np.ndarray  # [G, P] left-padded
    prompt_mask: np.ndarray  # [G, P]
    answers: Records  # [G, T, ...] NumPy
    waiting: int  # answers not yet ended


@dataclasses.dataclass
class _Chunk:
    """A chunk dispatched and not yet read."""

    progress: Progress  # on the device
    rows: np.ndarray  # [W] the slots it decodes
    tenants: np.ndarray  # [S] the admission each slot held when it was dispatched (0: none)
    waiting: bool  # prompts were waiting for a slot when it started


class ContinuousStream:
    """Continuous batching kept running across groups of prompts (module docstring): the
    :class:`~asyncopd_jax.sampling.engine.RolloutStream` protocol.

    Args:
      engine: the compiled programs (a :class:`~asyncopd_jax.sampling.ContinuousSampler`).
      state: the weights to sample with (until :meth:`swap`).
      version: their policy version, recorded per token.
      prompt_slots: ``P``, the longest prompt any group may have.
      slots: ``S``, sequences decoded at once (default: ``engine.params.slots``).
    """

    def __init__(
        self,
        engine: PagedPrograms,
        state: nnx.State,
        *,
        version: int,
        prompt_slots: int,
        slots: int | None = None,
    ):
        p = engine.params
        self.engine, self.state, self.version = engine, state, version
        self.prompt_slots = prompt_slots
        self.slots = slots or p.slots
        if self.slots < 1:
            raise ValueError("sampling.slots = 0 means one slot per prompt of a call: a stream needs slots >= 1")
        self.per_sequence = engine.pages_per_sequence(prompt_slots)
        pool = engine.pool_pages(self.slots, prompt_slots)
        self.trash = pool - 1  # table entries no sequence has held yet point here
        self.free = list(range(pool - 2, -1, -1))  # a stack: page 0 is handed out first
        self.table = np.full((self.slots, self.per_sequence), self.trash, np.int32)
        self.table_on_device: Array | None = None  # the table as last sent (None: changed since)
        self.owned: list[list[int]] = [[] for _ in range(self.slots)]
        self.row_of: list[int | None] = [None] * self.slots  # the stream row a slot holds
        self.admitted_at = [0] * self.slots  # the admission (1, 2, ...) that filled the slot last
        self.written = np.zeros(self.slots, np.int64)  # tokens in a slot's pages, as last read
        # the host's copy of each slot's answer so far, appended to from every chunk read
        self.answers = Records.empty(p, self.slots, engine.pad_id, xp=np)
        self.queue: collections.deque[int] = collections.deque()  # stream rows waiting for a slot
        # per stream row, until its group is handed back
        self.prompts: dict[int, np.ndarray] = {}  # [P] from position 0
        self.lengths: dict[int, int] = {}
        self.keys: dict[int, np.ndarray] = {}  # the key's data
        self.group_of: dict[int, tuple[int, int]] = {}  # (group, index in it)
        self.groups: dict[int, _Group] = {}
        self._rows = 0
        self._groups = 0
        self.stats = EngineStats(slots=self.slots, pool_pages=pool - 1)
        self.admissions = 0
        self.stale = False  # weights swapped in since the slots in flight were written
        self.unread: _Chunk | None = None  # the chunk dispatched last (the step before it read one)
        self.carry = engine.empty(state, self.slots, prompt_slots, pool)

    # --- what the caller sees -------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Prompts waiting for a slot."""
        return len(self.queue)

    @property
    def in_flight(self) -> int:
        """Slots holding a prompt (as of the last chunk read)."""
        return self.slots - self.row_of.count(None)

    @property
    def idle(self) -> bool:
        """Nothing queued, decoding or unread."""
        return not self.queue and self.in_flight == 0 and self.unread is None

    @property
    def wants_prompts(self) -> bool:
        """Fewer prompts wait than there are slots: a group submitted now starts at once."""
        return self.queued < self.slots

    @property
    def pending_groups(self) -> int:
        """Groups submitted and not yet handed back."""
        return len(self.groups)

    def submit(self, tag: Any, prompts: Sequence[Sequence[int]], keys: Array) -> None:
        """Queue a group of prompts; :meth:`step` hands it back, tagged ``tag``, once every
        answer has ended.

        Args:
          prompts: ``G`` token lists, each at most ``prompt_slots`` long.
          keys: ``[G]`` the prompts' sampling keys (prompt i's answer token t is drawn with
            ``fold_in(keys[i], t)``).
        """
        ids, mask = left_pad(prompts, self.engine.pad_id, self.prompt_slots)  # checks the prompts
        if len(keys) != len(prompts):
            raise ValueError(f"{len(keys)} keys for {len(prompts)} prompts")
        data = np.asarray(jax.random.key_data(keys))
        group = self._groups
        self._groups += 1
        rows = list(range(self._rows, self._rows + len(prompts)))
        self._rows += len(prompts)
        answers = Records.empty(self.engine.params, len(prompts), self.engine.pad_id, xp=np)
        self.groups[group] = _Group(tag, rows, ids, mask, answers, len(prompts))
        for index, (row, prompt, key) in enumerate(zip(rows, prompts, data)):
            self.prompts[row] = np.full(self.prompt_slots, self.engine.pad_id, np.int32)
            self.prompts[row][: len(prompt)] = prompt
            self.lengths[row], self.keys[row], self.group_of[row] = len(prompt), key, (group, index)
            self.queue.append(row)

    def swap(self, version: int, state: nnx.State) -> None:
        """Sample with ``state`` (policy ``version``) from the next chunk on; the pages of the
        slots in flight are rewritten under it first."""
        self.version, self.state = version, state
        self.stale = self.in_flight > 0

    def step(self) -> list[tuple[Any, RolloutBatch]]:
        """Dispatch the next chunk, then read the one in flight (read it first if the device
        has finished it); the groups (tag, batch) whose last answer ended in the chunk read."""
        behind, self.unread = self.unread, None
        ended = []
        if behind is not None and not self.device_busy(behind):
            ended, behind = self.read(behind), None
        if self.queue or self.in_flight:
            engine, p = self.engine, self.engine.params
            # the slots are known as of the chunk before `behind`: pages for it and the next
            ahead = p.chunk_steps * (2 if behind is not None else 1)
            with mesh_context(engine.mesh):
                if self.stale and self.in_flight:
                    self.carry = engine.recompute(self.state, self.carry, self.sent_table(), columns=self.columns())
                self.make_room(ahead)
                new = self.plan_admission(p.chunk_steps)  # a new sequence decodes from the next chunk
                table, columns = self.sent_table(), self.columns()
                if new is not None:
                    self.carry = engine.admit(self.state, self.carry, new, table, columns=columns)
                self.stats.peak_pages = max(self.stats.peak_pages, self.stats.pool_pages - len(self.free))
                self.dispatch(table, columns)
        self.stale = False
        if behind is not None:
            ended = self.read(behind)
        if self.in_flight == 0:  # every slot the new chunk decodes ended before it: nothing to read
            self.unread = None
        return [self.hand_back(group) for group in ended]

    # --- a chunk --------------------------------------------------------------------------

    def dispatch(self, table: Array, columns: int) -> None:
        """The next chunk of decode steps over the occupied slots."""
        rows = self.decode_rows()
        waiting = bool(self.queue)
        # leave once `refill` more of the rows are free than at the chunk's start, as the
        # device counts them (slots the pool cannot fill yet, or that ended in the chunk in
        # flight, stay free: counting them would end the chunk at once)
        refill = max(1, self.slots // 8) if waiting else len(rows) + 1
        self.carry, progress = self.engine.decode(
            self.state,
            self.carry,
            table,
            self.engine.put(rows),
            np.int32(self.version),
            np.int32(refill),
            columns=columns,
        )
        self.unread = _Chunk(progress, rows, self.tenants(), waiting)

    @staticmethod
    def device_busy(chunk: _Chunk) -> bool:
        """Whether the device is still decoding ``chunk`` (then the next one is dispatched
        before it is read)."""
        steps: Any = chunk.progress.steps  # a device array: `jax.Array`'s stub lacks `is_ready`
        return not steps.is_ready()

    def tenants(self) -> np.ndarray:
        """``[S]`` the admission each slot holds now (0: none)."""
        return np.asarray([a if r is not None else 0 for a, r in zip(self.admitted_at, self.row_of)], np.int64)

    def read(self, chunk: _Chunk) -> list[int]:
        """Take in ``chunk``, dispatched before the one in flight: its records appended to
        the answers of the slots whose tenant is still the one it decoded, those that
        finished freed; the groups whose last answer this was."""
        progress: Progress = jax.device_get(chunk.progress)  # the chunk's one read
        steps, rows = int(progress.steps), chunk.rows
        self.stats.decode_steps += steps
        self.stats.row_steps += steps * len(rows)
        self.stats.waiting_row_steps += steps * len(rows) * chunk.waiting
        self.stats.waiting_tokens += int(progress.sampled) * chunk.waiting
        self.stats.chunks += 1
        # a slot refilled or preempted since the dispatch holds another sequence now
        same = (chunk.tenants > 0) & (chunk.tenants == self.tenants())  # [S]
        self.append(progress, rows, same[rows])
        prompt_len = np.asarray([self.lengths[r] if r is not None else 0 for r in self.row_of])
        self.written = np.where(same, prompt_len + progress.length, self.written)
        ended = []
        for slot in np.flatnonzero(same & ~progress.active):
            group = self.collect(int(slot))
            if group is not None:
                ended.append(group)
        return ended

    def append(self, progress: Progress, rows: np.ndarray, mine: np.ndarray) -> None:
        """The records a chunk wrote (``progress.new [W, C, ...]``, columns
        ``start .. start + C − 1`` of slots ``rows``) into the host's answers, up to each
        slot's new length, for the rows where ``mine [W]`` (the slot's tenant is the one
        the chunk decoded)."""
        p = self.engine.params
        start = progress.start
        count = np.where(mine, progress.length[rows] - start, 0)  # tokens each row sampled in the chunk
        row, column = np.nonzero(np.arange(min(p.chunk_steps, p.max_new_tokens))[None] < count[:, None])
        slot, at = rows[row], start[row] + column
        for name, values in progress.new.items():
            getattr(self.answers, name)[slot, at] = values[row, column]
        self.answers.length[rows[mine]] = progress.length[rows[mine]]

    def collect(self, slot: int) -> int | None:
        """Slot ``slot``'s finished answer into its group; its slot and pages freed. The
        group, if this was its last answer."""
        group, index = self.group_of[self.held(slot)]
        g = self.groups[group]
        for field in dataclasses.fields(Records):
            getattr(g.answers, field.name)[index] = getattr(self.answers, field.name)[slot]
        self.stats.tokens += int(self.answers.length[slot])
        self.release(slot)
        g.waiting -= 1
        return group if g.waiting == 0 else None

    def hand_back(self, group: int) -> tuple[Any, RolloutBatch]:
        """Group ``group``'s answers as one batch (in its prompts' order); its rows forgotten."""
        g = self.groups.pop(group)
        for row in g.rows:
            del self.prompts[row], self.lengths[row], self.keys[row], self.group_of[row]
        return g.tag, rollout_batch(g.prompt_tokens, g.prompt_mask, g.answers, self.engine.params)

    # --- pages and slots ------------------------------------------------------------------

    def pages_for(self, tokens: int, row: int) -> int:
        """Pages that hold ``tokens`` tokens of stream row ``row``'s sequence (its last answer
        token is never written: at most ``len + T − 1``)."""
        cap = self.lengths[row] + self.engine.params.max_new_tokens - 1
        return -(-min(tokens, cap) // self.engine.params.page_size)

    def columns(self) -> int:
        """Page-table columns a call reads: the most pages a slot holds, rounded up to a power
        of two (few compiled shapes). Attention reads ``columns × page_size`` tokens per
        slot, so its work follows the longest sequence in flight, not ``P + T``."""
        return bucket(max(max(len(pages) for pages in self.owned), 1), self.per_sequence)

    def sent_table(self) -> Array:
        """The page table on the device, sent again only when it changed."""
        if self.table_on_device is None:
            self.table_on_device = self.engine.put(self.table)
        return self.table_on_device

    def decode_rows(self) -> np.ndarray:
        """The slots a decode runs: every slot, or, with fewer in flight, the occupied ones
        and idle ones up to the next power of two (few compiled shapes)."""
        occupied = [s for s in range(self.slots) if self.row_of[s] is not None]
        width = bucket(len(occupied), self.slots)
        if width == self.slots:
            return np.arange(self.slots, dtype=np.int32)
        idle = [s for s in range(self.slots) if self.row_of[s] is None]
        return np.asarray(occupied + idle[: width - len(occupied)], np.int32)

    def grow(self, slot: int, pages: int) -> None:
        while len(self.owned[slot]) < pages:
            page = self.free.pop()
            self.table[slot, len(self.owned[slot])] = page
            self.owned[slot].append(page)
            self.table_on_device = None

    def release(self, slot: int) -> None:
        # the slot's table row keeps naming its pages: entries past a sequence's own pages are
        # read under the causal mask only, never written, so the table need not change
        self.free.extend(reversed(self.owned[slot]))
        self.owned[slot] = []
        self.row_of[slot] = None

    def held(self, slot: int) -> int:
        """The stream row slot ``slot`` holds (only asked of occupied slots)."""
        row = self.row_of[slot]
        assert row is not None, "an idle slot holds no prompt"
        return row

    def shortfall(self, slot: int, steps: int) -> int:
        """Pages decoding slot ``slot`` lacks for its next ``steps`` tokens."""
        have = len(self.owned[slot])
        return max(self.pages_for(int(self.written[slot]) + steps, self.held(slot)) - have, 0)

    def make_room(self, steps: int) -> None:
        """Every decoding slot gets the pages its next ``steps`` tokens need; when the pool
        runs short, the most recently admitted sequence is preempted (re-queued in front)."""
        while True:
            live = [s for s in range(self.slots) if self.row_of[s] is not None]
            if sum(self.shortfall(s, steps) for s in live) <= len(self.free):
                break
            victim = max(live, key=lambda s: self.admitted_at[s])
            self.queue.appendleft(self.held(victim))
            gone = np.zeros(self.slots, bool)
            gone[victim] = True
            self.carry = self.engine.evict(self.carry, self.engine.put(gone))
            self.release(victim)
            self.stats.preemptions += 1
        for s in range(self.slots):
            if self.row_of[s] is not None:
                self.grow(s, len(self.owned[s]) + self.shortfall(s, steps))

    def plan_admission(self, steps: int) -> Admission | None:
        """Queued prompts into free slots, while the pool has their pages: the prompts to
        prefill (None: none)."""
        chosen: list[tuple[int, int]] = []
        for slot in range(self.slots):
            if not self.queue:
                break
            if self.row_of[slot] is not None:
                continue
            row = self.queue[0]
            need = self.pages_for(self.lengths[row] + steps, row)
            if need > len(self.free):
                break
            self.queue.popleft()
            self.stats.refills += self.admitted_at[slot] > 0
            self.row_of[slot] = row
            self.admissions += 1
            self.admitted_at[slot] = self.admissions
            self.written[slot] = self.lengths[row]
            self.grow(slot, need)
            for name, field in self.answers.columns.items():  # the answer starts empty
                field[slot] = self.engine.pad_id if name == "tokens" else 0
            self.answers.length[slot] = 0
            chosen.append((slot, row))
        if not chosen:
            return None
        size = bucket(len(chosen), self.slots)
        slot_ids = np.full(size, self.slots, np.int32)  # padding rows: slot S, dropped
        prompts = np.full((size, self.prompt_slots), self.engine.pad_id, np.int32)
        lengths = np.zeros(size, np.int32)
        keys = np.repeat(self.keys[chosen[0][1]][None], size, axis=0)
        for i, (slot, row) in enumerate(chosen):
            slot_ids[i], prompts[i], lengths[i], keys[i] = slot, self.prompts[row], self.lengths[row], self.keys[row]
        self.stats.prefill_tokens += int(lengths.sum())
        put = self.engine.put
        return Admission(
            slot=put(slot_ids), prompts=put(prompts), prompt_len=put(lengths), keys=jax.random.wrap_key_data(put(keys))
        )
