"""The host side of continuous batching: a stream of prompt groups through the engine's slots.

A :class:`RolloutStream` keeps one :class:`~asyncopd_jax.sampling.ContinuousSampler`'s
slots and page pool alive across groups. Groups of prompts are submitted whenever the
caller likes (a rollout stage: as the capacity rule allows); their prompts queue for
slots in submission order; :meth:`RolloutStream.step` runs one chunk and returns the
groups whose every answer has now ended, while the other groups go on decoding:

    submit(g1) submit(g2)          step → []        step → [g2]       step → [g1]
    queue: g1 g1 g1 g2 g2  ──▶  slots decoding  ──▶  g2's short answers  ──▶  g1's long
                                                     ended: g2 handed on     answer ended

Per chunk (of at most ``chunk_steps`` decode steps):

1. every decoding slot gets the pages its next chunk may write (preempting the most
   recently admitted sequence if the pool runs short: it is re-queued in front, and
   re-sampled from its start);
2. queued prompts enter free slots (one batched prefill into their pages);
3. the occupied slots decode, gathered into the fewest rows (a power of two) that hold
   them, so that the decode's width follows the sequences in flight as the last answers
   drain; the chunk leaves early once an eighth of the slots more are free and prompts
   wait, so a finished slot idles only until the next refill;
4. the slots that finished hand their answers back and free their pages.

Between chunks the caller may :meth:`~RolloutStream.swap` in newer weights: the pages of
every slot in flight are rewritten under them (the written tokens only).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.models.partitioning import mesh_context
from asyncopd_jax.sampling.continuous import Admission, EngineStats, bucket
from asyncopd_jax.sampling.sampler import WeightSource, left_pad

if TYPE_CHECKING:
    from asyncopd_jax.sampling.continuous import ContinuousSampler

Array = jax.Array


@dataclasses.dataclass
class _Group:
    """A submitted group: its stream rows and its prompts as the batch records them."""

    tag: Any
    rows: list[int]
    prompt_tokens: np.ndarray  # [G, P] left-padded
    prompt_mask: np.ndarray  # [G, P]
    waiting: int  # answers not yet ended


class RolloutStream:
    """Continuous batching kept running across groups of prompts (module docstring).

    Args:
      engine: the compiled pieces (:class:`~asyncopd_jax.sampling.ContinuousSampler`).
      state: the weights to sample with (until :meth:`swap`).
      version: their policy version, recorded per token.
      prompt_slots: ``P``, the longest prompt any group may have.
      slots: ``S``, sequences decoded at once (default: ``engine.params.slots``).
    """

    def __init__(
        self,
        engine: ContinuousSampler,
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
        self.trash = pool - 1  # table entries past a sequence's pages point here
        self.free = list(range(pool - 2, -1, -1))  # a stack: page 0 is handed out first
        self.table = np.full((self.slots, self.per_sequence), self.trash, np.int32)
        self.owned: list[list[int]] = [[] for _ in range(self.slots)]
        self.row_of: list[int | None] = [None] * self.slots  # the stream row a slot holds
        self.admitted_at = [0] * self.slots
        self.written = np.zeros(self.slots, np.int64)
        self.queue: collections.deque[int] = collections.deque()  # stream rows waiting for a slot
        # per stream row, until its group is handed back
        self.prompts: dict[int, np.ndarray] = {}  # [P] from position 0
        self.lengths: dict[int, int] = {}
        self.keys: dict[int, np.ndarray] = {}  # the key's data
        self.group_of: dict[int, int] = {}
        self.records: dict[int, dict[str, np.ndarray]] = {}
        self.groups: dict[int, _Group] = {}
        self._rows = 0
        self._groups = 0
        self.stats = EngineStats(slots=self.slots, pool_pages=pool - 1)
        self.admissions = 0
        self.carry = engine._empty(state, self.slots, prompt_slots, pool)

    # --- what the caller sees -------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Prompts waiting for a slot."""
        return len(self.queue)

    @property
    def in_flight(self) -> int:
        """Slots holding a prompt."""
        return self.slots - self.row_of.count(None)

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing decoding."""
        return not self.queue and self.in_flight == 0

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
        self.groups[group] = _Group(tag, rows, ids, mask, len(prompts))
        for row, prompt, key in zip(rows, prompts, data):
            self.prompts[row] = np.full(self.prompt_slots, self.engine.pad_id, np.int32)
            self.prompts[row][: len(prompt)] = prompt
            self.lengths[row], self.keys[row], self.group_of[row] = len(prompt), key, group
            self.queue.append(row)

    def swap(self, version: int, state: nnx.State) -> None:
        """Sample with ``state`` (policy ``version``) from the next chunk on; the pages of the
        slots in flight are rewritten under it."""
        self.version, self.state = version, state
        if self.in_flight:
            with mesh_context(self.engine.mesh):
                self.carry = self.engine._recompute(self.state, self.carry, self.table_now())

    def step(self) -> list[tuple[Any, RolloutBatch]]:
        """Run one chunk; the groups (tag, batch) whose last answer ended in it."""
        if self.idle:
            return []
        engine, p = self.engine, self.engine.params
        with mesh_context(engine.mesh):
            self.make_room(p.chunk_steps)
            self.admit(p.chunk_steps)
            self.stats.peak_pages = max(self.stats.peak_pages, self.stats.pool_pages - len(self.free))
            rows = self.decode_rows()
            occupied = self.in_flight
            refill = max(1, self.slots // 8)
            waiting = bool(self.queue)
            self.carry = engine._decode(
                self.state,
                self.carry,
                jnp.asarray(self.table[rows, : self.columns()]),
                jnp.asarray(rows),
                jnp.int32(self.version),
                jnp.int32(p.chunk_steps),
                # leave once `refill` more of the rows are free than now (slots the pool
                # cannot fill yet stay free: counting them would end the chunk at once)
                jnp.int32(len(rows) - occupied + refill if waiting else len(rows) + 1),
            )
            active, written, steps, sampled = jax.device_get(
                (self.carry.active, self.carry.written, self.carry.steps_run, self.carry.sampled)
            )
            self.written = np.asarray(written, np.int64)
            self.stats.decode_steps += int(steps)
            self.stats.row_steps += int(steps) * len(rows)
            self.stats.waiting_row_steps += int(steps) * len(rows) * waiting
            self.stats.waiting_tokens += int(sampled) * waiting
            self.stats.chunks += 1
            return self.collect(np.asarray(active))

    def run(self, weight_source: WeightSource | None = None) -> list[tuple[Any, RolloutBatch]]:
        """Step until idle; between chunks, swap in the weights ``weight_source`` offers.
        Returns every group handed back, in the order they ended."""
        done: list[tuple[Any, RolloutBatch]] = []
        while not self.idle:
            done += self.step()
            if weight_source is not None and not self.idle:
                update = weight_source(self.version)
                if update is not None and update[0] != self.version:
                    self.swap(*update)
        return done

    # --- pages and slots ------------------------------------------------------------------

    def pages_for(self, tokens: int, row: int) -> int:
        """Pages that hold ``tokens`` tokens of stream row ``row``'s sequence (its last answer
        token is never written: at most ``len + T − 1``)."""
        cap = self.lengths[row] + self.engine.params.max_new_tokens - 1
        return -(-min(tokens, cap) // self.engine.params.page_size)

    def columns(self) -> int:
        """Page-table columns a call needs: the most pages a slot holds, rounded up to a power
        of two (few compiled shapes). Attention reads ``columns × page_size`` tokens per
        slot, so its work follows the longest sequence in flight, not ``P + T``."""
        return bucket(max(max(len(pages) for pages in self.owned), 1), self.per_sequence)

    def table_now(self) -> Array:
        """The page table, cut to :meth:`columns` (the columns past it hold no page)."""
        return jnp.asarray(self.table[:, : self.columns()])

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

    def release(self, slot: int) -> None:
        self.free.extend(reversed(self.owned[slot]))
        self.owned[slot] = []
        self.table[slot] = self.trash
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
            self.carry = self.engine._evict(self.carry, jnp.asarray(gone))
            self.release(victim)
            self.stats.preemptions += 1
        for s in range(self.slots):
            if self.row_of[s] is not None:
                self.grow(s, len(self.owned[s]) + self.shortfall(s, steps))

    def admit(self, steps: int) -> None:
        """Queued prompts into free slots, while the pool has their pages."""
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
            chosen.append((slot, row))
        if not chosen:
            return
        size = bucket(len(chosen), self.slots)
        slot_ids = np.full(size, self.slots, np.int32)  # padding rows: slot S, dropped
        prompts = np.full((size, self.prompt_slots), self.engine.pad_id, np.int32)
        lengths = np.zeros(size, np.int32)
        keys = np.repeat(self.keys[chosen[0][1]][None], size, axis=0)
        table = np.full((size, self.columns()), self.trash, np.int32)
        for i, (slot, row) in enumerate(chosen):
            slot_ids[i], prompts[i], lengths[i], keys[i] = slot, self.prompts[row], self.lengths[row], self.keys[row]
            table[i] = self.table[slot, : table.shape[1]]
        new = Admission(
            slot=jnp.asarray(slot_ids),
            prompts=jnp.asarray(prompts),
            prompt_len=jnp.asarray(lengths),
            keys=jax.random.wrap_key_data(jnp.asarray(keys)),
            page_table=jnp.asarray(table),
        )
        self.carry = self.engine._admit(self.state, self.carry, new)
        self.stats.prefill_tokens += int(lengths.sum())

    def collect(self, active: np.ndarray) -> list[tuple[Any, RolloutBatch]]:
        """Take the answers of slots that finished, free their slots and pages; the groups
        whose last answer this was."""
        done = [s for s in range(self.slots) if self.row_of[s] is not None and not active[s]]
        if not done:
            return []
        size = bucket(len(done), self.slots)
        index = np.asarray(done + [done[0]] * (size - len(done)), np.int32)
        rows = jax.device_get(self.engine._rows(self.carry, index))
        ended: list[tuple[Any, RolloutBatch]] = []
        for i, slot in enumerate(done):
            row = self.held(slot)
            record = {name: value[i] for name, value in rows.items()}
            self.records[row] = record
            self.stats.tokens += int(record["step"])
            self.release(slot)
            group = self.group_of[row]
            self.groups[group].waiting -= 1
            if self.groups[group].waiting == 0:
                ended.append(self.hand_back(group))
        return ended

    def hand_back(self, group: int) -> tuple[Any, RolloutBatch]:
        """Group ``group``'s answers as one batch (in its prompts' order); its rows forgotten."""
        g = self.groups.pop(group)
        records = [self.records.pop(row) for row in g.rows]
        for row in g.rows:
            del self.prompts[row], self.lengths[row], self.keys[row], self.group_of[row]
        p = self.engine.params
        steps = np.asarray([r["step"] for r in records])
        response_mask = np.arange(p.max_new_tokens)[None] < steps[:, None]

        def stacked(name: str, fill: int | float = 0) -> Array:
            """A field of every answer, ``fill`` past each answer's end (a slot's earlier
            occupant may have left records there)."""
            values = np.stack([r[name] for r in records])
            keep = response_mask.reshape(response_mask.shape + (1,) * (values.ndim - 2))
            return jnp.asarray(np.where(keep, values, np.asarray(fill, values.dtype)))

        return g.tag, RolloutBatch(
            prompt_tokens=jnp.asarray(g.prompt_tokens),
            prompt_mask=jnp.asarray(g.prompt_mask),
            response_tokens=stacked("tokens", self.engine.pad_id),
            response_mask=jnp.asarray(response_mask),
            behavior_logp=stacked("logp"),
            token_version=stacked("versions"),
            candidate_ids=stacked("candidate_ids") if p.num_candidates else None,
            candidate_behavior_logp=stacked("candidate_logp") if p.num_candidates else None,
            student_topk_ids=stacked("topk_ids") if p.student_topk else None,
            student_topk_behavior_logp=stacked("topk_logp") if p.student_topk else None,
        )
