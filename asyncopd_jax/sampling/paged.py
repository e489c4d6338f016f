"""The continuous engine's compiled programs: ``S`` slots decoding over a paged KV cache,
scheduled on the device.

Each slot is its own sequence, from position 0 (no left padding):

    slot s:  prompt tokens 0 .. len−1 | response token t at position len + t

Its keys and values live in pages of one shared pool (:mod:`asyncopd_jax.models.paged_attention`),
found through the slot's row of a page table, so the cache holds the tokens written, not
``S × (P + T)`` slots. One call of :attr:`PagedPrograms.run` is a loop of up to
``chunk_steps`` steps, each of which

1. admits queued prompts into the idle slots (one batched prefill into their pages, at a
   width of a power of two: a ``lax.switch``, so one program), as many as the free pages
   allow beside the pages the busy slots take this step;
2. gives every busy slot the page its next token goes into, preempting the most recently
   admitted sequence while the free stack runs short (its prompt goes back in front of the
   queue: it is re-sampled from its start and draws the same tokens);
3. decodes every slot one token (:func:`~asyncopd_jax.sampling.decode.sample_token`; the
   attention reads the page-table columns the longest sequence holds, rounded up to a
   power of two: another ``lax.switch``);
4. moves each answer that ended into the call's outbox and frees its slot and pages,

with the queue, the free stack and the page table on the device
(:mod:`~asyncopd_jax.sampling.schedule`). The call ends after ``chunk_steps`` steps, when
nothing is queued or decoding, or once ``S`` answers have ended; the host reads the outbox,
its one transfer (:class:`Finished`), and hands in new prompts with the next call
(:class:`~asyncopd_jax.sampling.stream.ContinuousStream`). :attr:`PagedPrograms.recompute`
rewrites the pages in flight after a weight swap.

Shapes: S slots, P prompt slots, T = max_new_tokens, M pages per sequence
(``⌈(P + T) / page_size⌉``), Q = 2S queue entries, F = 2S outbox rows, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from asyncopd_jax.models.decoder import Decoder
from asyncopd_jax.models.paged_attention import PagedImplementation, PagedKVCache, PagedWrite
from asyncopd_jax.models.partitioning import Logical, constrain
from asyncopd_jax.sampling.decode import sample_token
from asyncopd_jax.sampling.distribution import SamplingParams
from asyncopd_jax.sampling.engine import Programs
from asyncopd_jax.sampling.records import Records
from asyncopd_jax.sampling.schedule import (
    Pages,
    Queue,
    idle_first,
    newest,
    pages_for,
    prefix_within,
    release_pages,
    take_pages,
)

Array = jax.Array


def bucket(n: int, limit: int) -> int:
    """The smallest power of two ≥ ``n``, at most ``limit``: few compiled shapes."""
    return min(1 << max(n - 1, 0).bit_length(), limit)


def buckets(limit: int) -> tuple[int, ...]:
    """Every value :func:`bucket` takes for ``n`` in ``1 .. limit``: the powers of two below
    ``limit``, and ``limit``."""
    return tuple(sorted({bucket(n, limit) for n in range(1, limit + 1)}))


def admission_widths(slots: int) -> tuple[int, ...]:
    """The prefill widths an admission into ``slots`` slots is made of, widest first: the
    powers of two up to ``slots`` (any ``n ≤ slots`` is a sum of distinct ones)."""
    return tuple(1 << i for i in reversed(range(slots.bit_length())))


def slots_axes(path: Sequence[Any], x: Any) -> Logical:
    """The layout of a leaf of :class:`Scheduled`: the pool's key/value heads over ``tensor``
    (either layout: the head axis is the third), every other array whole on each device."""
    if any(getattr(key, "name", None) == "cache" for key in path):
        return (None, None, "act_heads") + (None,) * (len(x.shape) - 3)
    return (None,) * len(x.shape)


def constrain_slots(tree: Any) -> Any:
    """``tree`` laid out by :func:`slots_axes` on the mesh traced under (none: unchanged)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: constrain(x, slots_axes(path, x)), tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """``S`` slots: the sequences decoding, their records and the shared pool."""

    cache: PagedKVCache
    prompts: Array  # [S, P] int32, each prompt from slot position 0
    prompt_len: Array  # [S] int32
    keys: Array  # [S] PRNG keys of the slots' prompts
    row: Array  # [S] int32 the stream row each slot holds
    admitted: Array  # [S] int32 the admission that filled the slot last (1, 2, ...; 0: never)
    written: Array  # [S] int32 tokens in the cache (prompt + response tokens fed back)
    active: Array  # [S] bool: holds a sequence still decoding
    next_logits: Array  # [S, V] fp32: the distribution of each slot's next token
    records: Records  # [S, T, ...] (past a slot's length: an earlier occupant's, never read)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Scheduled:
    """Everything the loop carries between calls (donated): the slots, the pages, the queue."""

    slots: Slots
    pages: Pages
    queue: Queue
    admissions: Array  # scalar int32: admissions so far


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Counts:
    """What one call did (scalars int32), for :class:`~asyncopd_jax.sampling.EngineStats`."""

    steps: Array  # decode steps run
    rows: Array  # rows decoded, summed over the steps (each step's width: decode_widths)
    sampled: Array  # tokens sampled (every busy slot's, each step)
    waiting_steps: Array  # steps with prompts still queued after admission
    waiting_sampled: Array  # tokens sampled in those steps
    refills: Array  # admissions into a slot an earlier sequence had held
    preemptions: Array
    prefill_tokens: Array
    peak_pages: Array  # most pages in use at once

    @classmethod
    def zero(cls) -> Counts:
        return cls(*(jnp.int32(0) for _ in dataclasses.fields(cls)))

    def add(self, **more: Array) -> Counts:
        return dataclasses.replace(self, **{k: getattr(self, k) + v for k, v in more.items()})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Finished:
    """What a call hands the host, in one transfer: the answers that ended in it, in the
    order they ended, and what it did."""

    records: Records  # [F, T, ...] answer i of the call in row i (rows ≥ count: unused)
    row: Array  # [F] int32 their stream rows
    count: Array  # scalar int32
    counts: Counts


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Incoming:
    """Prompts handed in with a call: the first ``count`` of ``Q`` rows."""

    prompts: Array  # [Q, P] int32 from position 0
    prompt_len: Array  # [Q] int32
    keys: Array  # [Q] PRNG keys
    row: Array  # [Q] int32 stream rows
    count: Array  # scalar int32


def fill_pages(
    model: Decoder,
    cache: PagedKVCache,
    tokens: Array,
    lengths: Array,
    page_table: Array,
    chunk: int,
    implementation: PagedImplementation,
) -> tuple[PagedKVCache, Array]:
    """Write ``R`` sequences' first ``lengths`` tokens into their pages, ``chunk`` tokens
    per forward; the logits at each sequence's last token.

    Args:
      tokens: ``[R, L]`` int32, sequence r's tokens from position 0.
      lengths: ``[R]`` int32 in ``[0, L]`` (0: nothing written, the logits are garbage).
      page_table: ``[R, M]`` the sequences' pages.

    Returns:
      ``(cache, logits [R, V] fp32 at position lengths − 1)``. The trip count
      ``⌈max(lengths) / chunk⌉`` is dynamic: the work follows the longest sequence.
    """
    rows, width = tokens.shape
    size = min(chunk, width)
    padded = jnp.pad(tokens, ((0, 0), (0, -width % size)))  # every chunk starts inside the array

    def body(i, state: tuple[PagedKVCache, Array]) -> tuple[PagedKVCache, Array]:
        cache, last = state
        start = i * size
        piece = jax.lax.dynamic_slice_in_dim(padded, start, size, axis=1)
        where = PagedWrite(page_table, jnp.full((rows,), start, jnp.int32), jnp.clip(lengths - start, 0, size))
        hidden, cache = model.forward_paged(piece, cache, where, implementation)
        at = lengths - 1 - start  # the last token's row in this chunk, if it is here
        here = (at >= 0) & (at < size)
        picked = jnp.take_along_axis(hidden, jnp.clip(at, 0, size - 1)[:, None, None], axis=1)[:, 0]
        return cache, jnp.where(here[:, None], picked, last)

    first = (cache, jnp.zeros((rows, model.config.hidden_size), model.compute_dtype))
    cache, last = jax.lax.fori_loop(0, (jnp.max(lengths) + size - 1) // size, body, first)
    return cache, model.logits(last)


def once_if(pred: Array, fn: Any, *operands: Any) -> Any:
    """``fn(*operands)`` if ``pred``, else ``operands``: a loop of at most one trip, which
    updates its operands in place where a ``lax.cond`` on XLA:CPU copies them."""

    def body(loop: tuple[Array, Any]) -> tuple[Array, Any]:
        _, operands = loop
        return jnp.bool_(False), fn(*operands)

    _, result = jax.lax.while_loop(lambda loop: loop[0], body, (pred, operands))
    return result


class PagedPrograms(Programs):
    """The continuous engine's compiled programs (module docstring; arguments:
    :class:`~asyncopd_jax.sampling.engine.Programs`). ``params.slots`` sequences decode at
    once, ``params.kv_pages`` pages of ``params.page_size`` tokens hold their keys and
    values. Both programs donate what they carry (:class:`Scheduled`)."""

    def __init__(
        self, graphdef: nnx.GraphDef, params: SamplingParams, pad_id: int = 0, mesh: jax.sharding.Mesh | None = None
    ):
        super().__init__(graphdef, params, pad_id, mesh)
        self.run = jax.jit(self._run_fn, donate_argnums=(1,))
        self.recompute = jax.jit(self._recompute_fn, donate_argnums=(1,))
        # for `asyncopd plan` only: an admission of a whole set of slots, and one decode step
        self.prefill = jax.jit(self._prefill_fn, donate_argnums=(1,))
        self.step = jax.jit(self._step_fn, donate_argnums=(1,))

    @property
    def implementation(self) -> PagedImplementation:
        """The paged attention for the devices sampled on (the mesh's, else JAX's default):
        the Pallas kernel on TPU, the reference elsewhere. It fixes the pool's layout too."""
        platform = self.mesh.devices.flat[0].platform if self.mesh is not None else jax.default_backend()
        return "ragged" if platform == "tpu" else "reference"

    # --- sizes --------------------------------------------------------------------------

    def pages_per_sequence(self, prompt_slots: int) -> int:
        """``M``: pages of the longest sequence, prompt and answer (``⌈(P + T) / page⌉``)."""
        return -(-(prompt_slots + self.params.max_new_tokens) // self.params.page_size)

    def pool_pages(self, slots: int, prompt_slots: int) -> int:
        """Pages in the pool for ``slots`` slots (the last page is a never-allocated target
        for table entries past a sequence's pages)."""
        worst = slots * self.pages_per_sequence(prompt_slots)
        pages = self.params.kv_pages or worst
        if pages < self.pages_per_sequence(prompt_slots):
            raise ValueError(
                f"sampling.kv_pages = {pages} is too few: one sequence of {prompt_slots} prompt and "
                f"{self.params.max_new_tokens} new tokens needs {self.pages_per_sequence(prompt_slots)} pages"
            )
        return min(pages, worst) + 1

    # --- state ----------------------------------------------------------------------------

    def empty(self, state: nnx.State, slots: int, prompt_slots: int, pool: int) -> Scheduled:
        """Idle slots, an empty queue of ``2 · slots`` entries and an empty pool of ``pool`` pages."""
        p, c = self.params, nnx.merge(self.graphdef, state).config
        head = jax.eval_shape(lambda s: self._model(s).lm_head_weight(), state)  # [H, V] in the compute dtype
        per_sequence = self.pages_per_sequence(prompt_slots)
        queue = 2 * slots
        return Scheduled(
            slots=Slots(
                cache=PagedKVCache.empty(
                    self.implementation,
                    c.num_hidden_layers,
                    c.num_key_value_heads,
                    c.head_dim,
                    pool,
                    p.page_size,
                    self.cache_dtype(head.dtype),
                ),
                prompts=jnp.zeros((slots, prompt_slots), jnp.int32),
                prompt_len=jnp.zeros((slots,), jnp.int32),
                keys=jax.random.split(jax.random.key(0), slots),
                row=jnp.full((slots,), -1, jnp.int32),
                admitted=jnp.zeros((slots,), jnp.int32),
                written=jnp.zeros((slots,), jnp.int32),
                active=jnp.zeros((slots,), bool),
                next_logits=jnp.zeros((slots, head.shape[1]), jnp.float32),
                records=Records.empty(p, slots, self.pad_id),
            ),
            pages=Pages.empty(slots, per_sequence, pool),
            queue=Queue(
                prompts=jnp.zeros((queue, prompt_slots), jnp.int32),
                prompt_len=jnp.zeros((queue,), jnp.int32),
                keys=jax.random.split(jax.random.key(0), queue),
                row=jnp.full((queue,), -1, jnp.int32),
                head=jnp.int32(0),
                tail=jnp.int32(0),
            ),
            admissions=jnp.int32(0),
        )

    # --- one step's parts -----------------------------------------------------------------

    def _admit(
        self, model: Decoder, carry: Scheduled, counts: Counts, n: Array, width: int
    ) -> tuple[Scheduled, Counts]:
        """The first ``n ≤ width`` queued prompts into the first ``n`` idle slots, their
        pages taken (enough for the prompt and the first answer token) and prefilled."""
        s, q, p = carry.slots, carry.queue, self.params
        slots, per_sequence = s.active.shape[0], carry.pages.table.shape[1]
        take = jnp.arange(width) < n
        slot = jnp.where(take, idle_first(s.active)[:width], slots)  # padding rows: slot S, dropped
        at = q.at(jnp.arange(width))
        prompt_len = jnp.where(take, q.prompt_len[at], 0)
        need = jnp.where(take, jnp.minimum(pages_for(prompt_len + 1, p.page_size), per_sequence), 0)
        pages = take_pages(carry.pages, slot, need)
        prompt_columns = min(-(-s.prompts.shape[1] // p.page_size), per_sequence)
        table = jnp.take(pages.table, slot, axis=0, mode="clip")[:, :prompt_columns]  # padding rows write nothing
        chunk = min(p.recompute_chunk, s.prompts.shape[1])
        cache, logits = fill_pages(model, s.cache, q.prompts[at], prompt_len, table, chunk, self.implementation)

        def put(field: Array, value: Any) -> Array:
            return field.at[slot].set(value, mode="drop")

        admitted = dataclasses.replace(
            s,
            cache=cache,
            prompts=put(s.prompts, q.prompts[at]),
            prompt_len=put(s.prompt_len, prompt_len),
            keys=put(s.keys, q.keys[at]),
            row=put(s.row, q.row[at]),
            admitted=put(s.admitted, carry.admissions + 1 + jnp.arange(width, dtype=jnp.int32)),
            written=put(s.written, prompt_len),
            active=put(s.active, True),
            next_logits=put(s.next_logits, logits),
            records=dataclasses.replace(s.records, length=put(s.records.length, 0)),
        )
        refills = jnp.sum(take & (jnp.take(s.admitted, slot, mode="clip") > 0), dtype=jnp.int32)
        carry = Scheduled(
            slots=admitted,
            pages=pages,
            queue=dataclasses.replace(q, head=q.head + n),
            admissions=carry.admissions + n,
        )
        return carry, counts.add(refills=refills, prefill_tokens=jnp.sum(prompt_len, dtype=jnp.int32))

    def _admission(self, model: Decoder, carry: Scheduled, counts: Counts) -> tuple[Scheduled, Counts]:
        """As many queued prompts as there are idle slots and free pages for (beside a page
        for each busy slot whose next token starts one), admitted in prefills of the widths
        :func:`admission_widths` lists, widest first (``n = 5``: 4, then 1), so that no
        prefill row is padding. Each width is a loop of at most one trip, not a branch: a
        ``lax.cond`` or ``lax.switch`` copies the pool it passes on (XLA:CPU, 4 MiB a layer
        at the long-tailed task's 32 slots), a loop updates it in place."""
        s, q, p = carry.slots, carry.queue, self.params
        slots, per_sequence = s.active.shape[0], carry.pages.table.shape[1]
        growing = s.active & (s.written // p.page_size >= carry.pages.owned)
        budget = carry.pages.top - jnp.sum(growing, dtype=jnp.int32)
        room = jnp.minimum(slots - jnp.sum(s.active, dtype=jnp.int32), q.size)
        offer = jnp.arange(slots)
        need = jnp.minimum(pages_for(q.prompt_len[q.at(offer)] + 1, p.page_size), per_sequence)
        n = prefix_within(jnp.where(offer < room, need, carry.pages.free.shape[0] + 1), budget)
        for width in admission_widths(slots):  # after the wider ones, fewer than twice `width` are left

            def admit(loop: tuple[Scheduled, Counts, Array], width: int = width) -> tuple[Scheduled, Counts, Array]:
                carry, counts, left = loop
                carry, counts = self._admit(model, carry, counts, jnp.int32(width), width)
                return carry, counts, left - width

            def enough(loop: tuple[Scheduled, Counts, Array], width: int = width) -> Array:
                return loop[2] >= width

            carry, counts, n = jax.lax.while_loop(enough, admit, (carry, counts, n))
        return carry, counts

    def _grow(self, carry: Scheduled, counts: Counts) -> tuple[Scheduled, Counts]:
        """A page for every busy slot whose next token starts one; while the free stack has
        too few, the most recently admitted sequence goes back in front of the queue."""
        page_size = self.params.page_size

        def growing(carry: Scheduled) -> Array:
            return carry.slots.active & (carry.slots.written // page_size >= carry.pages.owned)

        def short(loop: tuple[Scheduled, Counts]) -> Array:
            carry, _ = loop
            return jnp.sum(growing(carry), dtype=jnp.int32) > carry.pages.top

        def preempt(loop: tuple[Scheduled, Counts]) -> tuple[Scheduled, Counts]:
            carry, counts = loop
            s, q = carry.slots, carry.queue
            victim = newest(s.active, s.admitted)
            gone = jnp.arange(s.active.shape[0]) == victim
            front = jnp.mod(q.head - 1, q.prompts.shape[0])
            queue = dataclasses.replace(
                q,
                prompts=q.prompts.at[front].set(s.prompts[victim]),
                prompt_len=q.prompt_len.at[front].set(s.prompt_len[victim]),
                keys=q.keys.at[front].set(s.keys[victim]),
                row=q.row.at[front].set(s.row[victim]),
                head=q.head - 1,
            )
            carry = Scheduled(
                slots=dataclasses.replace(s, active=s.active & ~gone),
                pages=release_pages(carry.pages, gone),
                queue=queue,
                admissions=carry.admissions,
            )
            return carry, counts.add(preemptions=jnp.int32(1))

        carry, counts = jax.lax.while_loop(short, preempt, (carry, counts))
        pages = take_pages(carry.pages, jnp.arange(carry.slots.active.shape[0]), growing(carry).astype(jnp.int32))
        in_use = pages.free.shape[0] - pages.top
        return dataclasses.replace(carry, pages=pages), dataclasses.replace(
            counts, peak_pages=jnp.maximum(counts.peak_pages, in_use)
        )

    def decode_widths(self, slots: int) -> tuple[int, ...]:
        """The rows a decode step may run: the busy slots, rounded up to one of these (the
        powers of two from ``S / 8`` and ``S``), so that the last answers of a stream drain
        at a fraction of the full width's cost. Below 8 slots the saving is small beside
        the compile of another decode: every step runs all ``S``."""
        if slots < 8:
            return (slots,)
        return tuple(w for w in buckets(slots) if w >= slots // 8)

    def decode_width(self, active: Array) -> Array:
        """The narrowest of :meth:`decode_widths` that holds the busy slots ``active [S]``."""
        widths = jnp.asarray(self.decode_widths(active.shape[0]))
        return widths[jnp.searchsorted(widths, jnp.sum(active, dtype=jnp.int32))]

    def _decode(self, model: Decoder, carry: Scheduled, version: Array) -> tuple[Scheduled, Array]:
        """Every busy slot's next token sampled, recorded and fed back (its keys and values
        written, unless it ends the answer), at the narrowest of :meth:`decode_widths` that
        holds them (one loop of at most one trip per width: :func:`once_if`); the slots whose
        answer ended ``[S]``."""
        s = carry.slots
        slots = s.active.shape[0]
        widths = self.decode_widths(slots)
        chosen = self.decode_width(s.active)
        busy_first = idle_first(~s.active)
        ended = jnp.zeros((slots,), bool)
        for width in widths:
            rows = None if width == slots else busy_first[:width]

            def decode(s: Slots, ended: Array, rows: Array | None = rows) -> tuple[Slots, Array]:
                return self._decode_rows(model, s, carry.pages.table, version, rows)

            s, ended = once_if(chosen == width, decode, s, ended)
        return dataclasses.replace(carry, slots=s), ended

    def _decode_rows(
        self, model: Decoder, s: Slots, table: Array, version: Array, rows: Array | None
    ) -> tuple[Slots, Array]:
        """Slots ``rows [W]`` (None: every slot) decoded one token: gathered, decoded and
        scattered back (the pool is shared, not copied); the slots whose answer ended ``[S]``."""
        p = self.params
        every = rows is None
        take = (lambda x: x) if every else (lambda x: x[rows])
        records = jax.tree_util.tree_map(take, s.records)
        active, written = take(s.active), take(s.written)
        logits, keys = take(s.next_logits), take(s.keys)
        records, token, finished = sample_token(p, self.pad_id, logits, keys, active, records, version)
        going = active & ~finished  # only a token that is fed back needs its keys and values
        # an idle row reads from position 0: the attention's extent follows the busy slots
        where = PagedWrite(take(table), jnp.where(active, written, 0), going.astype(jnp.int32))
        hidden, cache = model.forward_paged(token[:, None], s.cache, where, self.implementation)
        logits = model.logits(hidden[:, 0])
        put = (lambda whole, x: x) if every else (lambda whole, x: whole.at[rows].set(x))
        decoded = dataclasses.replace(
            s,
            cache=cache,
            next_logits=put(s.next_logits, logits),
            written=put(s.written, written + going),
            active=put(s.active, going),
            records=jax.tree_util.tree_map(put, s.records, records),
        )
        return decoded, put(jnp.zeros_like(s.active), active & ~going)

    @staticmethod
    def _hand_over(records: Records, row: Array, pages: Pages, out: Finished, ended: Array) -> tuple[Pages, Finished]:
        """The answers of slots ``ended [S]`` (their ``records``, stream ``row`` s) into the
        outbox, their pages freed."""
        at = jnp.where(ended, out.count + jnp.cumsum(ended) - 1, out.row.shape[0])  # others dropped
        out = dataclasses.replace(
            out,
            records=jax.tree_util.tree_map(lambda box, x: box.at[at].set(x, mode="drop"), out.records, records),
            row=out.row.at[at].set(row, mode="drop"),
            count=out.count + jnp.sum(ended, dtype=jnp.int32),
        )
        return release_pages(pages, ended), out

    # --- programs -----------------------------------------------------------------------

    def _run_fn(self, state, carry: Scheduled, incoming: Incoming, version: Array) -> tuple[Scheduled, Finished]:
        """Queue ``incoming``'s prompts, then decode (module docstring) until ``chunk_steps``
        steps ran, nothing is queued or decoding, or ``S`` answers ended."""
        model = self._model(state)
        slots = carry.slots.active.shape[0]
        q = carry.queue
        size = q.prompts.shape[0]
        at = jnp.where(jnp.arange(size) < incoming.count, jnp.mod(q.tail + jnp.arange(size), size), size)
        queue = dataclasses.replace(
            q,
            prompts=q.prompts.at[at].set(incoming.prompts, mode="drop"),
            prompt_len=q.prompt_len.at[at].set(incoming.prompt_len, mode="drop"),
            keys=q.keys.at[at].set(incoming.keys, mode="drop"),
            row=q.row.at[at].set(incoming.row, mode="drop"),
            tail=q.tail + incoming.count,
        )
        carry = dataclasses.replace(carry, queue=queue)
        out = Finished(
            records=Records.empty(self.params, 2 * slots, self.pad_id),
            row=jnp.full((2 * slots,), -1, jnp.int32),
            count=jnp.int32(0),
            counts=Counts.zero(),
        )

        def cond(loop: tuple[Scheduled, Finished]) -> Array:
            carry, out = loop
            busy = jnp.any(carry.slots.active) | (carry.queue.size > 0)
            return (out.counts.steps < self.params.chunk_steps) & busy & (out.count <= slots)

        def body(loop: tuple[Scheduled, Finished]) -> tuple[Scheduled, Finished]:
            carry, out = loop
            carry, counts = self._admission(model, carry, out.counts)
            carry, counts = self._grow(carry, counts)
            busy = jnp.sum(carry.slots.active, dtype=jnp.int32)
            waiting = (carry.queue.size > 0).astype(jnp.int32)
            counts = counts.add(
                steps=jnp.int32(1),
                rows=self.decode_width(carry.slots.active),
                sampled=busy,
                waiting_steps=waiting,
                waiting_sampled=waiting * busy,
            )
            carry, ended = self._decode(model, carry, version)
            out = dataclasses.replace(out, counts=counts)
            records, row = carry.slots.records, carry.slots.row
            pages, out = once_if(
                jnp.any(ended), lambda p, o: self._hand_over(records, row, p, o, ended), carry.pages, out
            )
            return constrain_slots(dataclasses.replace(carry, pages=pages)), out

        carry, out = jax.lax.while_loop(cond, body, (constrain_slots(carry), out))
        return constrain_slots(carry), out

    def _recompute_fn(self, state, carry: Scheduled) -> Scheduled:
        """Every decoding slot's written tokens rewritten under new weights ``state``."""
        s, t = carry.slots, self.params.max_new_tokens
        position = jnp.arange(s.prompts.shape[1] + t)[None]
        in_prompt = position < s.prompt_len[:, None]
        sequence = jnp.where(
            in_prompt,
            jnp.take_along_axis(s.prompts, jnp.minimum(position, s.prompts.shape[1] - 1), axis=1),
            jnp.take_along_axis(s.records.tokens, jnp.clip(position - s.prompt_len[:, None], 0, t - 1), axis=1),
        )
        lengths = jnp.where(s.active, s.written, 0)
        cache, logits = fill_pages(
            self._model(state),
            s.cache,
            sequence,
            lengths,
            carry.pages.table,
            self.params.recompute_chunk,
            self.implementation,
        )
        slots = dataclasses.replace(s, cache=cache, next_logits=jnp.where(s.active[:, None], logits, s.next_logits))
        return constrain_slots(dataclasses.replace(carry, slots=slots))

    def _prefill_fn(self, state, carry: Scheduled) -> Scheduled:
        """The queue's first ``S`` prompts admitted at once (the widest admission)."""
        slots = carry.slots.active.shape[0]
        n = jnp.minimum(carry.queue.size, slots)
        return constrain_slots(self._admit(self._model(state), carry, Counts.zero(), n, slots)[0])

    def _step_fn(self, state, carry: Scheduled, version: Array) -> Scheduled:
        """One decode step of every slot (what a step of :meth:`run` costs at its full width,
        admission aside)."""
        s = self._decode_rows(self._model(state), carry.slots, carry.pages.table, version, None)[0]
        return constrain_slots(dataclasses.replace(carry, slots=s))
