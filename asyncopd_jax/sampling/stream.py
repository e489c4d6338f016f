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

Multi-turn (``sampling.tool_call_ids``, a stream opened with
:class:`~asyncopd_jax.sampling.episodes.Turns`): a turn that called a tool comes back
parked; the stream runs its environment's step on the worker pool and keeps stepping the
device; each step first takes the observations that are ready and queues their
continuations ahead of new prompts (:mod:`~asyncopd_jax.sampling.episodes`). A group is
handed back when every episode in it has ended.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.environments.protocol import Environment, Observation
from asyncopd_jax.models.partitioning import mesh_context
from asyncopd_jax.sampling.carry import Finished, Incoming
from asyncopd_jax.sampling.engine import EngineStats
from asyncopd_jax.sampling.episodes import Episode, Turns, record_step
from asyncopd_jax.sampling.paged import PagedPrograms
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
    environment: np.ndarray  # [G, T] bool: the columns an environment wrote (multi-turn)
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
      turns: multi-turn rollouts' environments (module docstring); needed exactly when
        ``engine.params.tool_call_ids`` is set.
    """

    #: seconds a step waits for an observation when nothing else is left to do (then the
    #: caller gets control back, to start new groups)
    OBSERVATION_POLL_S = 0.05

    def __init__(
        self,
        engine: PagedPrograms,
        state: nnx.State,
        *,
        version: int,
        prompt_slots: int,
        slots: int | None = None,
        turns: Turns | None = None,
    ):
        p = engine.params
        if engine.multi_turn != (turns is not None):
            raise ValueError(
                "multi-turn rollouts need both sampling.tool_call_ids and the environments' turns"
                if turns is None
                else "environments were given but sampling.tool_call_ids is empty: no turn would ever call them"
            )
        self.engine, self.state, self.version = engine, state, version
        if turns is not None and turns.pool.pending:
            raise ValueError(f"the environments' pool still runs {turns.pool.pending} steps of another stream")
        self.prompt_slots, self.turns = prompt_slots, turns
        self.context_slots = engine.context_slots(prompt_slots)
        self.slots = slots or p.slots
        if self.slots < 1:
            raise ValueError("sampling.slots = 0 means one slot per prompt of a call: a stream needs slots >= 1")
        self.capacity = 2 * self.slots  # prompts on the device at once: the queue's entries
        pool = engine.pool_pages(self.slots, prompt_slots)
        self.backlog: collections.deque[int] = collections.deque()  # stream rows not yet on the device
        self.on_device = 0  # rows handed in whose answers have not been read back
        # per stream row, until its group is handed back
        self.prompts: dict[int, np.ndarray] = {}  # [C] the context from position 0
        self.episodes: dict[int, Episode] = {}  # multi-turn
        self.releases: list[int] = []  # rows whose parked pages the device may free
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
        """Nothing queued, decoding, unread, waiting for an environment or for the device to
        free an ended episode's pages."""
        waiting = self.waiting_on_environments or self.releases
        return not self.backlog and self.on_device == 0 and self.unread is None and not waiting

    @property
    def waiting_on_environments(self) -> int:
        """Episodes whose environment step has not been collected."""
        return self.turns.pool.pending if self.turns is not None else 0

    @property
    def wants_prompts(self) -> bool:
        """Fewer prompts wait than there are slots: a group submitted now starts at once."""
        return self.queued < self.slots

    @property
    def pending_groups(self) -> int:
        """Groups submitted and not yet handed back."""
        return len(self.groups)

    def submit(
        self,
        tag: Any,
        prompts: Sequence[Sequence[int]],
        keys: Array,
        environments: Sequence[Environment] | None = None,
    ) -> None:
        """Queue a group of prompts; :meth:`step` hands it back, tagged ``tag``, once every
        answer has ended.

        Args:
          prompts: ``G`` token lists, each at most ``prompt_slots`` long.
          keys: ``[G]`` the prompts' sampling keys (prompt i's answer token t is drawn with
            ``fold_in(keys[i], t)``, t its column in the trajectory).
          environments: multi-turn: each prompt's environment.
        """
        ids, mask = left_pad(prompts, self.engine.pad_id, self.prompt_slots)  # checks the prompts
        if len(keys) != len(prompts):
            raise ValueError(f"{len(keys)} keys for {len(prompts)} prompts")
        if (environments is not None) != (self.turns is not None) or len(environments or prompts) != len(prompts):
            raise ValueError(
                f"a multi-turn stream needs one environment a prompt ({len(prompts)}), a single-turn one none"
            )
        data = np.asarray(jax.random.key_data(keys))
        group = self._groups
        self._groups += 1
        rows = list(range(self._rows, self._rows + len(prompts)))
        self._rows += len(prompts)
        answers = Records.empty(self.engine.params, len(prompts), self.engine.pad_id, xp=np)
        environment = np.zeros(answers.tokens.shape, bool)
        self.groups[group] = _Group(tag, rows, ids, mask, answers, environment, len(prompts))
        for index, (row, prompt, key) in enumerate(zip(rows, prompts, data)):
            self.prompts[row] = np.full(self.context_slots, self.engine.pad_id, np.int32)
            self.prompts[row][: len(prompt)] = prompt
            self.lengths[row], self.keys[row], self.group_of[row] = len(prompt), key, (group, index)
            if environments is not None:
                self.episodes[row] = Episode(environments[index])
            self.backlog.append(row)

    def swap(self, version: int, state: nnx.State) -> None:
        """Sample with ``state`` (policy ``version``) from the next call on; the pages of the
        slots in flight are rewritten under it first."""
        self.version, self.state = version, state
        self.stale = self.on_device > 0

    def step(self) -> list[tuple[Any, RolloutBatch]]:
        """Dispatch the next call, then read the one in flight (read it first if the device
        has finished it); the groups (tag, batch) whose last answer ended in the call read
        (multi-turn: or whose last episode ended on an observation taken in first)."""
        started = time.monotonic()
        behind, self.unread = self.unread, None
        ended = self.observe(block=behind is None and not self.backlog and self.on_device == 0)
        pending = self.waiting_on_environments
        if behind is not None and not self.device_busy(behind):
            ended, behind = self.read(behind), None
        if self.backlog or self.on_device or self.releases:
            engine = self.engine
            with mesh_context(engine.mesh):
                if self.stale:
                    self.carry = engine.recompute(self.state, self.carry)
                rows = self.hand_in()
                incoming = self.incoming(rows) if rows or self.releases else self.nothing
                self.carry, self.unread = engine.run(self.state, self.carry, incoming, np.int32(self.version))
        self.stale = False
        if behind is not None:
            ended += self.read(behind)
        if self.on_device == 0:  # the call just dispatched had nothing to decode: nothing to read
            self.unread = None
        if pending and self.unread is not None:  # environments ran while the device decoded
            self.stats.episodes.overlapped_seconds += time.monotonic() - started
        return [self.hand_back(group) for group in ended]

    # --- multi-turn -----------------------------------------------------------------------

    def observe(self, block: bool) -> list[int]:
        """Take in the observations that are ready (``block``: nothing else to do, so wait up
        to :attr:`OBSERVATION_POLL_S` for one): each continues its trajectory or ends its
        episode. The groups whose last episode ended."""
        if self.turns is None or not self.turns.pool.pending:
            return []
        if block:
            waited = time.monotonic()
            got = self.turns.pool.wait(self.OBSERVATION_POLL_S)
            self.stats.episodes.waiting_seconds += time.monotonic() - waited
        else:
            got = self.turns.pool.ready()
        ended = []
        for row, observation in got:
            group = self.take_observation(int(row), observation)  # type: ignore[call-overload]
            if group is not None:
                ended.append(group)
        return ended

    def take_observation(self, row: int, observation: Observation) -> int | None:
        """Row ``row``'s observation: its ids appended to the trajectory, which goes back to
        the front of the queue; or, when the episode is done or no room is left for another
        turn, the episode ended and its parked pages released. The group, if this ended its
        last episode."""
        assert self.turns is not None
        episode = self.episodes[row]
        record_step(episode, observation, self.stats.episodes.waiting_seconds)
        group, index = self.group_of[row]
        g = self.groups[group]
        length = int(g.answers.length[index])
        ids = [] if observation.done else self.turns.observation_ids(observation)
        if observation.done or length + len(ids) >= g.answers.tokens.shape[1]:
            episode.truncated = not observation.done
            self.releases.append(row)
            return self.end_episode(row)
        end = length + len(ids)
        g.answers.tokens[index, length:end] = ids
        g.environment[index, length:end] = True
        g.answers.length[index] = end
        start = self.lengths[row]
        self.prompts[row][start + length : start + end] = ids
        episode.begin, episode.observation_tokens = end, episode.observation_tokens + len(ids)
        self.backlog.appendleft(row)  # a trajectory under way before new prompts: less stale
        return None

    def end_episode(self, row: int) -> int | None:
        """Row ``row``'s answer is whole: the group, if it was the last."""
        if row in self.episodes:
            self.stats.episodes.add(self.episodes[row])
        group, _ = self.group_of[row]
        g = self.groups[group]
        g.waiting -= 1
        return group if g.waiting == 0 else None

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
        prompts = np.full((q, self.context_slots), self.engine.pad_id, np.int32)
        lengths, begin = np.zeros(q, np.int32), np.zeros(q, np.int32)
        names, release = np.full(q, -1, np.int32), np.full(q, -1, np.int32)
        keys = np.zeros((q,) + np.shape(jax.random.key_data(jax.random.key(0))), np.uint32)
        for i, row in enumerate(rows):
            prompts[i], lengths[i], names[i], keys[i] = self.prompts[row], self.lengths[row], row, self.keys[row]
            begin[i] = self.episodes[row].begin if row in self.episodes else 0
        released, self.releases = self.releases[:q], self.releases[q:]
        release[: len(released)] = released
        put = self.engine.put
        return Incoming(
            prompts=put(prompts),
            prompt_len=put(lengths),
            begin=put(begin),
            keys=jax.random.wrap_key_data(put(keys)),
            row=put(names),
            count=put(np.int32(len(rows))),
            release=put(release),
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
        s.parks += int(c.parks)
        s.resumes += int(c.resumes)
        s.evictions += int(c.evictions)
        ended = []
        for i in range(int(done.count)):
            group = self.collect(int(done.row[i]), done.records, i, bool(done.parked[i]))
            if group is not None:
                ended.append(group)
        return ended

    def collect(self, row: int, records: Records, i: int, parked: bool) -> int | None:
        """Stream row ``row``'s turn (row ``i`` of ``records``: its columns from the turn's
        start) into its group; a ``parked`` turn goes to its environment. The group, if this
        ended its last answer."""
        group, index = self.group_of[row]
        g = self.groups[group]
        episode = self.episodes.get(row)
        begin, length = (episode.begin if episode else 0), int(records.length[i])
        for name, values in records.columns.items():  # past its length the answer keeps the fill
            getattr(g.answers, name)[index, begin:length] = values[i, begin:length]
        g.answers.length[index] = length
        self.stats.tokens += length - begin
        self.on_device -= 1
        if episode is not None:
            episode.turns += 1
        if not parked:
            return self.end_episode(row)
        assert self.turns is not None and episode is not None
        turn = g.answers.tokens[index, begin:length]
        start = self.lengths[row]
        self.prompts[row][start + begin : start + length] = turn
        episode.asked, episode.waited_when_asked = time.monotonic(), self.stats.episodes.waiting_seconds
        self.turns.pool.submit(row, episode.environment, self.turns.text(turn.tolist()))
        return None

    def hand_back(self, group: int) -> tuple[Any, RolloutBatch]:
        """Group ``group``'s answers as one batch (in its prompts' order); its rows forgotten."""
        g = self.groups.pop(group)
        episodes = [self.episodes.pop(row, None) for row in g.rows]
        for row in g.rows:
            del self.prompts[row], self.lengths[row], self.keys[row], self.group_of[row]
        environment = g.environment if self.turns is not None else None
        batch = rollout_batch(g.prompt_tokens, g.prompt_mask, g.answers, self.engine.params, environment)
        if self.turns is None:
            return g.tag, batch
        ended = [e for e in episodes if e is not None]
        return g.tag, dataclasses.replace(
            batch,
            tool_calls=jnp.asarray([e.tool_calls for e in ended], jnp.int32),
            tool_errors=jnp.asarray([e.tool_errors for e in ended], jnp.int32),
            environment_seconds=jnp.asarray([e.seconds for e in ended], jnp.float32),
            environment_blocked_seconds=jnp.asarray([e.blocked_seconds for e in ended], jnp.float32),
        )
