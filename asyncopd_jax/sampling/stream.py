"""The host side of continuous batching: a stream of prompt groups through the slots of the
paged programs (:class:`~asyncopd_jax.sampling.paged.PagedPrograms`), which schedule
themselves on the device.

A :class:`ContinuousStream` keeps the slots, the page pool and the device's queue alive
across groups. Groups of prompts are submitted whenever the caller likes (a rollout stage:
as the capacity rule allows); their prompts go to the device's queue in submission order;
each :meth:`~ContinuousStream.step` runs one call of the decode loop and hands back the
groups whose every answer has ended, while the other groups go on decoding:

    submit(g1) submit(g2)          step → []        step → [g2]       step → [g1]
    queue: g1 g1 g1 g2 g2  ──▶  slots decoding  ──▶  g2's short answers  ──▶  g1's long
                                                     ended: g2 handed on     answer ended

The device admits queued prompts into slots, takes and frees pages and preempts, all inside
the loop; the host does three things per step:

1. dispatch the next call, handing in the prompts waiting on the host that fit the device's
   queue (``2 S`` prompts at most on the device: ``S`` decoding and ``S`` queued), and
   rewriting the pages in flight first if weights were swapped in;
2. read the call before it: one transfer (:class:`~asyncopd_jax.sampling.paged.Finished`),
   the answers that ended in it and what it did;
3. hand back the groups whose last answer it read.

So a busy device has the next call queued while the host reads the last one, hands groups
back and the caller works between steps (scoring, polling for weights); a device that has
already finished the call is read first. No answer depends on when a call was dispatched
or read: prompt i's token t is drawn with ``fold_in(keys[i], t)`` whatever its slot, its
admission time or a preemption (re-sampled, it draws the same tokens).

Between steps the caller may :meth:`~ContinuousStream.swap` in newer weights: before the
next call the pages of every slot in flight are rewritten under them (the written tokens
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
from asyncopd_jax.sampling.paged import Finished, Incoming, PagedPrograms
from asyncopd_jax.sampling.records import Records, left_pad, rollout_batch

Array = jax.Array


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
        self.capacity = 2 * self.slots  # prompts on the device at once: the queue's entries
        pool = engine.pool_pages(self.slots, prompt_slots)
        self.backlog: collections.deque[int] = collections.deque()  # stream rows not yet on the device
        self.on_device = 0  # rows handed in whose answers have not been read back
        # per stream row, until its group is handed back
        self.prompts: dict[int, np.ndarray] = {}  # [P] from position 0
        self.lengths: dict[int, int] = {}
        self.keys: dict[int, np.ndarray] = {}  # the key's data
        self.group_of: dict[int, tuple[int, int]] = {}  # (group, index in it)
        self.groups: dict[int, _Group] = {}
        self._rows = 0
        self._groups = 0
        self.stats = EngineStats(slots=self.slots, pool_pages=pool - 1)
        self.stale = False  # weights swapped in since the slots in flight were written
        self.unread: Finished | None = None  # what the call dispatched last returns (unread)
        with mesh_context(engine.mesh):
            self.carry = engine.empty(state, self.slots, prompt_slots, pool)
        self.nothing = self.incoming([])  # a call that hands in no prompts, on the device once

    # --- what the caller sees -------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Prompts waiting for a slot (on the host, or beyond the slots on the device)."""
        return len(self.backlog) + max(self.on_device - self.slots, 0)

    @property
    def in_flight(self) -> int:
        """Slots holding a prompt, at most (as of the last call read)."""
        return min(self.on_device, self.slots)

    @property
    def idle(self) -> bool:
        """Nothing queued, decoding or unread."""
        return not self.backlog and self.on_device == 0 and self.unread is None

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
            self.backlog.append(row)

    def swap(self, version: int, state: nnx.State) -> None:
        """Sample with ``state`` (policy ``version``) from the next call on; the pages of the
        slots in flight are rewritten under it first."""
        self.version, self.state = version, state
        self.stale = self.on_device > 0

    def step(self) -> list[tuple[Any, RolloutBatch]]:
        """Dispatch the next call, then read the one in flight (read it first if the device
        has finished it); the groups (tag, batch) whose last answer ended in the call read."""
        behind, self.unread = self.unread, None
        ended = []
        if behind is not None and not self.device_busy(behind):
            ended, behind = self.read(behind), None
        if self.backlog or self.on_device:
            engine = self.engine
            with mesh_context(engine.mesh):
                if self.stale:
                    self.carry = engine.recompute(self.state, self.carry)
                rows = self.hand_in()
                incoming = self.incoming(rows) if rows else self.nothing
                self.carry, self.unread = engine.run(self.state, self.carry, incoming, np.int32(self.version))
        self.stale = False
        if behind is not None:
            ended += self.read(behind)
        if self.on_device == 0:  # the call just dispatched had nothing to decode: nothing to read
            self.unread = None
        return [self.hand_back(group) for group in ended]

    # --- a call ---------------------------------------------------------------------------

    def hand_in(self) -> list[int]:
        """The rows waiting on the host that the device's queue has room for, in order."""
        rows = [self.backlog.popleft() for _ in range(min(len(self.backlog), self.capacity - self.on_device))]
        self.on_device += len(rows)
        return rows

    def incoming(self, rows: list[int]) -> Incoming:
        """Stream rows ``rows`` as a call's :class:`~asyncopd_jax.sampling.paged.Incoming`
        (the call's one upload)."""
        q = self.capacity
        prompts = np.full((q, self.prompt_slots), self.engine.pad_id, np.int32)
        lengths = np.zeros(q, np.int32)
        names = np.full(q, -1, np.int32)
        keys = np.zeros((q,) + np.shape(jax.random.key_data(jax.random.key(0))), np.uint32)
        for i, row in enumerate(rows):
            prompts[i], lengths[i], names[i], keys[i] = self.prompts[row], self.lengths[row], row, self.keys[row]
        put = self.engine.put
        return Incoming(
            prompts=put(prompts),
            prompt_len=put(lengths),
            keys=jax.random.wrap_key_data(put(keys)),
            row=put(names),
            count=put(np.int32(len(rows))),
        )

    @staticmethod
    def device_busy(call: Finished) -> bool:
        """Whether the device is still running ``call`` (then the next one is dispatched
        before it is read)."""
        count: Any = call.count  # a device array: `jax.Array`'s stub lacks `is_ready`
        return not count.is_ready()

    def read(self, call: Finished) -> list[int]:
        """Take in a call's outbox: its answers into their groups; the groups whose last
        answer this was."""
        done: Finished = jax.device_get(call)  # the call's one read
        c, s = done.counts, self.stats
        s.decode_steps += int(c.steps)
        s.row_steps += int(c.rows)
        s.waiting_row_steps += int(c.waiting_steps) * self.slots
        s.waiting_tokens += int(c.waiting_sampled)
        s.chunks += 1
        s.refills += int(c.refills)
        s.preemptions += int(c.preemptions)
        s.prefill_tokens += int(c.prefill_tokens)
        s.peak_pages = max(s.peak_pages, int(c.peak_pages))
        ended = []
        for i in range(int(done.count)):
            group = self.collect(int(done.row[i]), done.records, i)
            if group is not None:
                ended.append(group)
        return ended

    def collect(self, row: int, records: Records, i: int) -> int | None:
        """Stream row ``row``'s answer (row ``i`` of ``records``) into its group; the group,
        if this was its last answer."""
        group, index = self.group_of[row]
        g = self.groups[group]
        length = int(records.length[i])
        for name, values in records.columns.items():  # past its length the answer keeps the fill
            getattr(g.answers, name)[index, :length] = values[i, :length]
        g.answers.length[index] = length
        self.stats.tokens += length
        self.on_device -= 1
        g.waiting -= 1
        return group if g.waiting == 0 else None

    def hand_back(self, group: int) -> tuple[Any, RolloutBatch]:
        """Group ``group``'s answers as one batch (in its prompts' order); its rows forgotten."""
        g = self.groups.pop(group)
        for row in g.rows:
            del self.prompts[row], self.lengths[row], self.keys[row], self.group_of[row]
        return g.tag, rollout_batch(g.prompt_tokens, g.prompt_mask, g.answers, self.engine.params)
