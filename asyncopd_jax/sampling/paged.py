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

Multi-turn (``params.tool_call_ids``): in step 4 a turn that called a tool goes to the
outbox too, but its slot *parks*: the slot is freed for the next queued prompt while its
pages move to a parked row of the table (:func:`~asyncopd_jax.sampling.schedule.park`).
The host hands the observation back as a queued *continuation* (the whole context so far,
and ``begin``: the answer column its turn starts at); admitted, it takes its pages along
and step 1 prefills only the stop token and the observation: what the pages lack. A
parked sequence written under older weights is prefilled whole; one whose pages were
taken back (step 2 evicts the oldest parked before it preempts a busy slot) too. Answer
token t of a trajectory is drawn with ``fold_in(key, t)`` as ever, t counting the
observations' columns: the same trajectory however the slots, pages and calls fell.

Shapes: :mod:`~asyncopd_jax.sampling.carry` (M pages per sequence: ``⌈(P + T) / page_size⌉``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from asyncopd_jax.models.decoder import Decoder
from asyncopd_jax.models.paged_attention import PagedImplementation, PagedKVCache, PagedWrite
from asyncopd_jax.sampling.carry import Counts, Finished, Incoming, Scheduled, Slots, constrain_slots
from asyncopd_jax.sampling.decode import sample_token
from asyncopd_jax.sampling.distribution import SamplingParams
from asyncopd_jax.sampling.engine import Programs
from asyncopd_jax.sampling.records import Records
from asyncopd_jax.sampling.schedule import (
    Pages,
    Parked,
    Queue,
    evict,
    idle_first,
    newest,
    oldest_parked,
    pages_for,
    park,
    prefix_within,
    queue_positions,
    release_pages,
    take_pages,
    unpark,
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


def fill_pages(
    model: Decoder,
    cache: PagedKVCache,
    tokens: Array,
    lengths: Array,
    page_table: Array,
    chunk: int,
    implementation: PagedImplementation,
    starts: Array | None = None,
) -> tuple[PagedKVCache, Array]:
    """Write ``R`` sequences' tokens ``starts .. lengths − 1`` into their pages, ``chunk``
    tokens per forward; the logits at each sequence's last token.

    Args:
      tokens: ``[R, L]`` int32, sequence r's tokens from position 0.
      lengths: ``[R]`` int32 in ``[0, L]`` (nothing to write: the logits are garbage).
      page_table: ``[R, M]`` the sequences' pages.
      starts: ``[R]`` int32 tokens already in the pages (default 0): a parked sequence's
        continuation writes only what was added since.

    Returns:
      ``(cache, logits [R, V] fp32 at position lengths − 1)``. The trip count
      ``⌈max(lengths − starts) / chunk⌉`` is dynamic: the work follows the longest write.
    """
    rows, width = tokens.shape
    size = min(chunk, width)
    starts = jnp.zeros((rows,), jnp.int32) if starts is None else jnp.minimum(starts, lengths)
    padded = jnp.pad(tokens, ((0, 0), (0, size)))  # every row's chunk lies inside the array

    def body(i, state: tuple[PagedKVCache, Array]) -> tuple[PagedKVCache, Array]:
        cache, last = state
        start = starts + i * size  # [R]
        columns = jnp.minimum(start, width)[:, None] + jnp.arange(size)[None]
        piece = jnp.take_along_axis(padded, columns, axis=1)
        where = PagedWrite(page_table, start, jnp.clip(lengths - start, 0, size))
        hidden, cache = model.forward_paged(piece, cache, where, implementation)
        at = lengths - 1 - start  # the last token's row in this chunk, if it is here
        here = (at >= 0) & (at < size)
        picked = jnp.take_along_axis(hidden, jnp.clip(at, 0, size - 1)[:, None, None], axis=1)[:, 0]
        return cache, jnp.where(here[:, None], picked, last)

    first = (cache, jnp.zeros((rows, model.config.hidden_size), model.compute_dtype))
    cache, last = jax.lax.fori_loop(0, (jnp.max(lengths - starts) + size - 1) // size, body, first)
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

    @property
    def multi_turn(self) -> bool:
        """Whether a turn that calls a tool parks for its observation (``params.tool_call_ids``)."""
        return bool(self.params.tool_call_ids)

    def parked_entries(self, slots: int) -> int:
        """``Z``: sequences parked at once (``2 S`` multi-turn; 0 single-turn)."""
        return 2 * slots if self.multi_turn else 0

    def context_slots(self, prompt_slots: int) -> int:
        """``C``: the widest context a queued entry holds (a multi-turn continuation's whole
        trajectory, ``P + T``; else the prompt, ``P``)."""
        return prompt_slots + (self.params.max_new_tokens if self.multi_turn else 0)

    def pool_pages(self, slots: int, prompt_slots: int) -> int:
        """Pages in the pool for ``slots`` slots (the last page is a never-allocated target
        for table entries past a sequence's pages); by default every slot's and parked
        sequence's longest sequence."""
        worst = (slots + self.parked_entries(slots)) * self.pages_per_sequence(prompt_slots)
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
        queue, context, parked = 2 * slots, self.context_slots(prompt_slots), self.parked_entries(slots)
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
                prompts=jnp.zeros((slots, context), jnp.int32),
                prompt_len=jnp.zeros((slots,), jnp.int32),
                begin=jnp.zeros((slots,), jnp.int32),
                keys=jax.random.split(jax.random.key(0), slots),
                row=jnp.full((slots,), -1, jnp.int32),
                admitted=jnp.zeros((slots,), jnp.int32),
                written=jnp.zeros((slots,), jnp.int32),
                active=jnp.zeros((slots,), bool),
                called=jnp.zeros((slots,), bool),
                next_logits=jnp.zeros((slots, head.shape[1]), jnp.float32),
                records=Records.empty(p, slots, self.pad_id),
            ),
            pages=Pages.empty(slots + parked, per_sequence, pool),
            queue=Queue(
                prompts=jnp.zeros((queue, context), jnp.int32),
                prompt_len=jnp.zeros((queue,), jnp.int32),
                begin=jnp.zeros((queue,), jnp.int32),
                keys=jax.random.split(jax.random.key(0), queue),
                row=jnp.full((queue,), -1, jnp.int32),
                head=jnp.int32(0),
                tail=jnp.int32(0),
            ),
            parked=Parked.empty(parked),
            admissions=jnp.int32(0),
            parks=jnp.int32(0),
        )

    # --- one step's parts -----------------------------------------------------------------

    def _admit(
        self, model: Decoder, carry: Scheduled, counts: Counts, n: Array, width: int, version: Array
    ) -> tuple[Scheduled, Counts]:
        """The first ``n ≤ width`` queued prompts into the first ``n`` idle slots, their
        pages taken (enough for the context and the first answer token) and prefilled. A
        continuation whose sequence is parked takes its pages along and prefills only what
        was added since (unless the weights changed meanwhile)."""
        s, q, p = carry.slots, carry.queue, self.params
        rows, per_sequence = carry.pages.table.shape
        take = jnp.arange(width) < n
        slot = jnp.where(take, idle_first(s.active)[:width], rows)  # padding rows: past the table, dropped
        at = q.at(jnp.arange(width))
        begin = jnp.where(take, q.begin[at], 0)
        length = jnp.where(take, q.prompt_len[at] + begin, 0)  # the context's tokens
        pages, parked, start = carry.pages, carry.parked, jnp.zeros_like(length)
        if self.multi_turn:
            pages, parked, start = unpark(pages, parked, parked.find(q.row[at]), slot, version)
        held = jnp.take(pages.owned, slot, mode="clip")
        need = jnp.where(take, jnp.maximum(jnp.minimum(pages_for(length + 1, p.page_size), per_sequence) - held, 0), 0)
        pages = take_pages(pages, slot, need)
        prompt_columns = min(-(-s.prompts.shape[1] // p.page_size), per_sequence)
        table = jnp.take(pages.table, slot, axis=0, mode="clip")[:, :prompt_columns]  # padding rows write nothing
        chunk = min(p.recompute_chunk, s.prompts.shape[1])
        cache, logits = fill_pages(
            model, s.cache, q.prompts[at], length, table, chunk, self.implementation, starts=start
        )

        def put(field: Array, value: Any) -> Array:
            return field.at[slot].set(value, mode="drop")

        admitted = dataclasses.replace(
            s,
            cache=cache,
            prompts=put(s.prompts, q.prompts[at]),
            prompt_len=put(s.prompt_len, q.prompt_len[at]),
            begin=put(s.begin, begin),
            keys=put(s.keys, q.keys[at]),
            row=put(s.row, q.row[at]),
            admitted=put(s.admitted, carry.admissions + 1 + jnp.arange(width, dtype=jnp.int32)),
            written=put(s.written, length),
            active=put(s.active, True),
            called=put(s.called, False),
            next_logits=put(s.next_logits, logits),
            records=dataclasses.replace(s.records, length=put(s.records.length, begin)),
        )
        refills = jnp.sum(take & (jnp.take(s.admitted, slot, mode="clip") > 0), dtype=jnp.int32)
        carry = dataclasses.replace(
            carry,
            slots=admitted,
            pages=pages,
            parked=parked,
            queue=dataclasses.replace(q, head=q.head + n),
            admissions=carry.admissions + n,
        )
        return carry, counts.add(
            refills=refills,
            prefill_tokens=jnp.sum(length - start, dtype=jnp.int32),
            resumes=jnp.sum(take & (start > 0), dtype=jnp.int32),
        )

    def _growing(self, carry: Scheduled) -> Array:
        """``[S]`` the busy slots whose next token starts a page."""
        s = carry.slots
        return s.active & (s.written // self.params.page_size >= carry.pages.owned[: s.active.shape[0]])

    def _admission(self, model: Decoder, carry: Scheduled, counts: Counts, version: Array) -> tuple[Scheduled, Counts]:
        """As many queued prompts as there are idle slots and free pages for (beside a page
        for each busy slot whose next token starts one), admitted in prefills of the widths
        :func:`admission_widths` lists, widest first (``n = 5``: 4, then 1), so that no
        prefill row is padding. Each width is a loop of at most one trip, not a branch: a
        ``lax.cond`` or ``lax.switch`` copies the pool it passes on (XLA:CPU, 4 MiB a layer
        at the long-tailed task's 32 slots), a loop updates it in place."""
        s, q, p = carry.slots, carry.queue, self.params
        slots, per_sequence = s.active.shape[0], carry.pages.table.shape[1]
        budget = carry.pages.top - jnp.sum(self._growing(carry), dtype=jnp.int32)
        room = jnp.minimum(slots - jnp.sum(s.active, dtype=jnp.int32), q.size)
        at = q.at(jnp.arange(slots))
        need = jnp.minimum(pages_for(q.prompt_len[at] + q.begin[at] + 1, p.page_size), per_sequence)
        if self.multi_turn:  # a parked sequence brings its own pages
            held = jnp.take(carry.pages.owned, slots + carry.parked.find(q.row[at]), mode="fill", fill_value=0)
            need = jnp.maximum(need - held, 0)
        offer = jnp.arange(slots)
        n = prefix_within(jnp.where(offer < room, need, carry.pages.free.shape[0] + 1), budget)
        for width in admission_widths(slots):  # after the wider ones, fewer than twice `width` are left

            def admit(loop: tuple[Scheduled, Counts, Array], width: int = width) -> tuple[Scheduled, Counts, Array]:
                carry, counts, left = loop
                carry, counts = self._admit(model, carry, counts, jnp.int32(width), width, version)
                return carry, counts, left - width

            def enough(loop: tuple[Scheduled, Counts, Array], width: int = width) -> Array:
                return loop[2] >= width

            carry, counts, n = jax.lax.while_loop(enough, admit, (carry, counts, n))
        return carry, counts

    def _grow(self, carry: Scheduled, counts: Counts) -> tuple[Scheduled, Counts]:
        """A page for every busy slot whose next token starts one; while the free stack has
        too few, the oldest parked sequence's pages are taken back, then the most recently
        admitted sequence goes back in front of the queue."""
        growing = self._growing

        def short(loop: tuple[Scheduled, Counts]) -> Array:
            carry, _ = loop
            return jnp.sum(growing(carry), dtype=jnp.int32) > carry.pages.top

        if self.multi_turn:

            def parked_short(loop: tuple[Scheduled, Counts]) -> Array:
                return short(loop) & jnp.any(loop[0].parked.used)

            def take_back(loop: tuple[Scheduled, Counts]) -> tuple[Scheduled, Counts]:
                carry, counts = loop
                pages, parked = evict(carry.pages, carry.parked, oldest_parked(carry.parked, jnp.int32(1)))
                return dataclasses.replace(carry, pages=pages, parked=parked), counts.add(evictions=jnp.int32(1))

            carry, counts = jax.lax.while_loop(parked_short, take_back, (carry, counts))

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
                begin=q.begin.at[front].set(s.begin[victim]),
                keys=q.keys.at[front].set(s.keys[victim]),
                row=q.row.at[front].set(s.row[victim]),
                head=q.head - 1,
            )
            carry = dataclasses.replace(
                carry,
                slots=dataclasses.replace(s, active=s.active & ~gone),
                pages=release_pages(carry.pages, gone),
                queue=queue,
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

    def _decode(self, model: Decoder, carry: Scheduled, version: Array) -> tuple[Scheduled, Array, Array]:
        """Every busy slot's next token sampled, recorded and fed back (its keys and values
        written, unless it ends the answer), at the narrowest of :meth:`decode_widths` that
        holds them (one loop of at most one trip per width: :func:`once_if`); the slots whose
        turn ended ``[S]`` and, of those, the ones that park for a tool's answer ``[S]``."""
        s = carry.slots
        slots = s.active.shape[0]
        widths = self.decode_widths(slots)
        chosen = self.decode_width(s.active)
        busy_first = idle_first(~s.active)
        ended = parking = jnp.zeros((slots,), bool)
        table = carry.pages.table[:slots]
        for width in widths:
            rows = None if width == slots else busy_first[:width]

            def decode(s: Slots, ended: Array, parking: Array, rows: Array | None = rows) -> tuple[Slots, Array, Array]:
                return self._decode_rows(model, s, table, version, rows)

            s, ended, parking = once_if(chosen == width, decode, s, ended, parking)
        return dataclasses.replace(carry, slots=s), ended, parking

    def _decode_rows(
        self, model: Decoder, s: Slots, table: Array, version: Array, rows: Array | None
    ) -> tuple[Slots, Array, Array]:
        """Slots ``rows [W]`` (None: every slot) decoded one token: gathered, decoded and
        scattered back (the pool is shared, not copied); the slots whose turn ended ``[S]``
        and those that park: the turn ended on a stop token, sampled one of
        ``tool_call_ids`` and left room in the answer for more."""
        p = self.params
        every = rows is None
        take = (lambda x: x) if every else (lambda x: x[rows])
        records = jax.tree_util.tree_map(take, s.records)
        active, written = take(s.active), take(s.written)
        logits, keys = take(s.next_logits), take(s.keys)
        records, token, finished = sample_token(p, self.pad_id, logits, keys, active, records, version)
        called = take(s.called) | (active & jnp.isin(token, jnp.asarray(p.tool_call_ids or (-1,), jnp.int32)))
        stopped = jnp.isin(token, jnp.asarray(p.stop_token_ids or (-1,), jnp.int32))
        parks = finished & called & stopped & (records.length < records.tokens.shape[1]) & self.multi_turn
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
            called=put(s.called, called),
            records=jax.tree_util.tree_map(put, s.records, records),
        )
        nothing = jnp.zeros_like(s.active)
        return decoded, put(nothing, active & ~going), put(nothing, parks)

    def _hand_over(
        self, s: Slots, held: tuple[Pages, Parked, Array], out: Finished, ended: Array, parking: Array, version: Array
    ) -> tuple[tuple[Pages, Parked, Array], Finished]:
        """The turns of slots ``ended [S]`` into the outbox; the pages of those that ``parking
        [S]`` moved to parked entries (``held``: the pages, the entries, parks so far), the
        others' freed."""
        pages, parked, parks = held
        at = jnp.where(ended, out.count + jnp.cumsum(ended) - 1, out.row.shape[0])  # others dropped
        counts = out.counts.add(parks=jnp.sum(parking, dtype=jnp.int32))
        if self.multi_turn:
            pages, parked, evicted = park(pages, parked, parking, s.row, s.written, version, parks)
            counts = counts.add(evictions=evicted)
        out = dataclasses.replace(
            out,
            records=jax.tree_util.tree_map(lambda box, x: box.at[at].set(x, mode="drop"), out.records, s.records),
            row=out.row.at[at].set(s.row, mode="drop"),
            parked=out.parked.at[at].set(parking, mode="drop"),
            count=out.count + jnp.sum(ended, dtype=jnp.int32),
            counts=counts,
        )
        return (release_pages(pages, ended & ~parking), parked, parks + jnp.sum(parking, dtype=jnp.int32)), out

    # --- programs -----------------------------------------------------------------------

    def _run_fn(self, state, carry: Scheduled, incoming: Incoming, version: Array) -> tuple[Scheduled, Finished]:
        """Queue ``incoming``'s prompts, then decode (module docstring) until ``chunk_steps``
        steps ran, nothing is queued or decoding, or ``S`` answers ended."""
        model = self._model(state)
        slots = carry.slots.active.shape[0]
        q = carry.queue
        # a continuation (its turn starts past column 0) goes ahead of the waiting prompts
        at, head, tail = queue_positions(q, incoming.count, incoming.begin > 0)
        queue = dataclasses.replace(
            q,
            prompts=q.prompts.at[at].set(incoming.prompts, mode="drop"),
            prompt_len=q.prompt_len.at[at].set(incoming.prompt_len, mode="drop"),
            begin=q.begin.at[at].set(incoming.begin, mode="drop"),
            keys=q.keys.at[at].set(incoming.keys, mode="drop"),
            row=q.row.at[at].set(incoming.row, mode="drop"),
            head=head,
            tail=tail,
        )
        carry = dataclasses.replace(carry, queue=queue)
        if self.multi_turn:  # episodes over: their parked pages freed
            pages, parked = evict(carry.pages, carry.parked, jnp.isin(carry.parked.row, incoming.release))
            carry = dataclasses.replace(carry, pages=pages, parked=parked)
        out = Finished(
            records=Records.empty(self.params, 2 * slots, self.pad_id),
            row=jnp.full((2 * slots,), -1, jnp.int32),
            parked=jnp.zeros((2 * slots,), bool),
            count=jnp.int32(0),
            counts=Counts.zero(),
        )

        def cond(loop: tuple[Scheduled, Finished]) -> Array:
            carry, out = loop
            busy = jnp.any(carry.slots.active) | (carry.queue.size > 0)
            return (out.counts.steps < self.params.chunk_steps) & busy & (out.count <= slots)

        def body(loop: tuple[Scheduled, Finished]) -> tuple[Scheduled, Finished]:
            carry, out = loop
            carry, counts = self._admission(model, carry, out.counts, version)
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
            carry, ended, parking = self._decode(model, carry, version)
            out = dataclasses.replace(out, counts=counts)
            held, out = once_if(
                jnp.any(ended),
                lambda held, o: self._hand_over(carry.slots, held, o, ended, parking, version),
                (carry.pages, carry.parked, carry.parks),
                out,
            )
            pages, parked, parks = held
            return constrain_slots(dataclasses.replace(carry, pages=pages, parked=parked, parks=parks)), out

        carry, out = jax.lax.while_loop(cond, body, (constrain_slots(carry), out))
        return constrain_slots(carry), out

    def _recompute_fn(self, state, carry: Scheduled) -> Scheduled:
        """Every decoding slot's written tokens rewritten under new weights ``state``."""
        s, t = carry.slots, self.params.max_new_tokens
        width = s.prompts.shape[1] + (0 if self.multi_turn else t)  # a multi-turn context is P + T wide already
        position = jnp.arange(width)[None]
        in_prompt = position < (s.prompt_len + s.begin)[:, None]  # the context; then the turn's tokens
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
            carry.pages.table[: s.active.shape[0]],
            self.params.recompute_chunk,
            self.implementation,
        )
        slots = dataclasses.replace(s, cache=cache, next_logits=jnp.where(s.active[:, None], logits, s.next_logits))
        return constrain_slots(dataclasses.replace(carry, slots=slots))

    def _prefill_fn(self, state, carry: Scheduled) -> Scheduled:
        """The queue's first ``S`` prompts admitted at once (the widest admission)."""
        slots = carry.slots.active.shape[0]
        n = jnp.minimum(carry.queue.size, slots)
        return constrain_slots(self._admit(self._model(state), carry, Counts.zero(), n, slots, jnp.int32(0))[0])

    def _step_fn(self, state, carry: Scheduled, version: Array) -> Scheduled:
        """One decode step of every slot (what a step of :meth:`run` costs at its full width,
        admission aside)."""
        table = carry.pages.table[: carry.slots.active.shape[0]]
        s = self._decode_rows(self._model(state), carry.slots, table, version, None)[0]
        return constrain_slots(dataclasses.replace(carry, slots=s))
