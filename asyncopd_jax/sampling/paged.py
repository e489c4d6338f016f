"""The continuous engine's compiled programs: ``S`` slots decoding over a paged KV cache.

Each slot is its own sequence, from position 0 (no left padding):

    slot s:  prompt tokens 0 .. len−1 | response token t at position len + t

Its keys and values live in pages of one shared pool (:mod:`asyncopd_jax.models.paged_attention`),
found through the slot's row of a page table that the host keeps
(:class:`~asyncopd_jax.sampling.stream.ContinuousStream`), so the cache holds the tokens
written, not ``S × (P + T)`` slots. The programs: a prefill of new prompts into their pages
(:attr:`PagedPrograms.admit`), a chunk of decode steps (:attr:`PagedPrograms.decode`,
which samples with the shared :func:`~asyncopd_jax.sampling.decode.sample_token`) and the
rewrite of the pages in flight after a weight swap (:attr:`PagedPrograms.recompute`).

Shapes: S slots, W rows one decode runs (S, or fewer as the last answers drain), P prompt
slots, T = max_new_tokens, C = chunk_steps, M pages per sequence
(``⌈(P + T) / page_size⌉``), V vocabulary, N candidates, K student top-K.
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

Array = jax.Array


def slots_axes(path: Sequence[Any], x: Any) -> Logical:
    """The layout of a leaf of :class:`Slots`: the pool's key/value heads over ``tensor``
    (either layout: the head axis is the third), every other array whole on each device."""
    if any(getattr(key, "name", None) == "pages" for key in path):
        return (None, None, "act_heads") + (None,) * (len(x.shape) - 3)
    return (None,) * len(x.shape)


def constrain_slots(slots: Slots) -> Slots:
    """``slots`` laid out by :func:`slots_axes` on the mesh traced under (none: unchanged)."""
    return jax.tree_util.tree_map_with_path(lambda path, x: constrain(x, slots_axes(path, x)), slots)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """What the decode loop carries for ``S`` slots (donated between calls)."""

    cache: PagedKVCache
    prompts: Array  # [S, P] int32, each prompt from slot position 0
    prompt_len: Array  # [S] int32
    keys: Array  # [S] PRNG keys of the slots' prompts
    written: Array  # [S] int32 tokens in the cache (prompt + response tokens fed back)
    active: Array  # [S] bool: still decoding
    next_logits: Array  # [S, V] fp32: the distribution of each slot's next token
    records: Records  # [S, T, ...] (past a slot's length: an earlier occupant's, never read)

    def rows(self) -> dict[str, Any]:
        """Everything with a row per slot (all but the pool), by field."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "cache"}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Admission:
    """``R`` prompts entering slots (rows with ``slot = S`` are bucket padding: dropped)."""

    slot: Array  # [R] int32
    prompts: Array  # [R, P] int32
    prompt_len: Array  # [R] int32 (0 for padding)
    keys: Array  # [R] PRNG keys


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Progress:
    """What a decode chunk tells the host, in one transfer: each slot's state after it, and
    the records the chunk wrote (the host keeps the answers: it never reads ``[S, T]``)."""

    active: Array  # [S] bool
    length: Array  # [S] int32 answer tokens
    steps: Array  # scalar int32: decode steps run
    sampled: Array  # scalar int32: tokens sampled (every slot's, kept or not)
    start: Array  # [W] int32 the decoded rows' lengths before the chunk
    new: dict[str, Array]  # [W, C, ...] the per-token records at columns start .. start + C − 1


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


def window(field: Array, start: Array, width: int) -> Array:
    """``field [W, T, ...]``'s columns ``start .. start + width − 1`` of each row
    (``[W, width, ...]``; columns past T repeat the last one)."""
    index = jnp.minimum(start[:, None] + jnp.arange(width)[None], field.shape[1] - 1)
    return jnp.take_along_axis(field, index.reshape(index.shape + (1,) * (field.ndim - 2)), axis=1)


class PagedPrograms(Programs):
    """The continuous engine's compiled programs (module docstring; arguments:
    :class:`~asyncopd_jax.sampling.engine.Programs`). ``params.slots`` sequences decode at
    once, ``params.kv_pages`` pages of ``params.page_size`` tokens hold their keys and
    values. Every program that takes the slots donates them; each takes the page table
    ``[S, M]`` whole (the host sends it when it changed) and reads its first ``columns``
    columns (static: one program per power of two)."""

    def __init__(
        self, graphdef: nnx.GraphDef, params: SamplingParams, pad_id: int = 0, mesh: jax.sharding.Mesh | None = None
    ):
        super().__init__(graphdef, params, pad_id, mesh)
        self.admit = jax.jit(self._admit_fn, donate_argnums=(1,), static_argnames=("columns",))
        self.decode = jax.jit(self._decode_fn, donate_argnums=(1,), static_argnames=("columns",))
        self.recompute = jax.jit(self._recompute_fn, donate_argnums=(1,), static_argnames=("columns",))
        self.evict = jax.jit(lambda slots, gone: dataclasses.replace(slots, active=slots.active & ~gone))

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

    # --- programs -----------------------------------------------------------------------

    def empty(self, state: nnx.State, slots: int, prompt_slots: int, pool: int) -> Slots:
        """Idle slots and an empty pool of ``pool`` pages."""
        p, c = self.params, nnx.merge(self.graphdef, state).config
        head = jax.eval_shape(lambda s: self._model(s).lm_head_weight(), state)  # [H, V] in the compute dtype
        return Slots(
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
            written=jnp.zeros((slots,), jnp.int32),
            active=jnp.zeros((slots,), bool),
            next_logits=jnp.zeros((slots, head.shape[1]), jnp.float32),
            records=Records.empty(p, slots, self.pad_id),
        )

    def _admit_fn(self, state, slots: Slots, new: Admission, table: Array, *, columns: int) -> Slots:
        """Prefill ``new``'s prompts into their pages and start their slots (their answers
        from length 0: the columns an earlier occupant left are overwritten as they grow)."""
        model = self._model(state)
        chunk = min(self.params.recompute_chunk, new.prompts.shape[1])
        pages = jnp.take(table, new.slot, axis=0, mode="clip")[:, :columns]  # padding rows write nothing
        cache, logits = fill_pages(model, slots.cache, new.prompts, new.prompt_len, pages, chunk, self.implementation)

        def put(field: Array, value: Any) -> Array:
            return field.at[new.slot].set(value, mode="drop")

        admitted = dataclasses.replace(
            slots,
            cache=cache,
            prompts=put(slots.prompts, new.prompts),
            prompt_len=put(slots.prompt_len, new.prompt_len),
            keys=put(slots.keys, new.keys),
            written=put(slots.written, new.prompt_len),
            active=put(slots.active, True),
            next_logits=put(slots.next_logits, logits),
            records=dataclasses.replace(slots.records, length=put(slots.records.length, 0)),
        )
        return constrain_slots(admitted)

    def _recompute_fn(self, state, slots: Slots, table: Array, *, columns: int) -> Slots:
        """Every decoding slot's written tokens rewritten under new weights ``state``."""
        t = self.params.max_new_tokens
        position = jnp.arange(slots.prompts.shape[1] + t)[None]
        in_prompt = position < slots.prompt_len[:, None]
        sequence = jnp.where(
            in_prompt,
            jnp.take_along_axis(slots.prompts, jnp.minimum(position, slots.prompts.shape[1] - 1), axis=1),
            jnp.take_along_axis(slots.records.tokens, jnp.clip(position - slots.prompt_len[:, None], 0, t - 1), axis=1),
        )
        lengths = jnp.where(slots.active, slots.written, 0)
        cache, logits = fill_pages(
            self._model(state),
            slots.cache,
            sequence,
            lengths,
            table[:, :columns],
            self.params.recompute_chunk,
            self.implementation,
        )
        return constrain_slots(dataclasses.replace(slots, cache=cache, next_logits=logits))

    def _decode_fn(
        self, state, slots: Slots, table: Array, rows: Array, version: Array, refill: Array, *, columns: int
    ) -> tuple[Slots, Progress]:
        """Decode slots ``rows [W]`` until ``chunk_steps`` steps ran, none of them decodes, or
        ``refill`` more of them are free than at the start. ``W < S``: the rows are
        gathered, decoded and scattered back (the pool is shared, not copied)."""
        model = self._model(state)
        p = self.params
        implementation = self.implementation
        pages = table[rows, :columns]
        narrow = rows.shape[0] < slots.active.shape[0]
        part = slots
        if narrow:
            part = dataclasses.replace(slots, **jax.tree_util.tree_map(lambda x: x[rows], slots.rows()))
        start = part.records.length
        refill_at = jnp.sum(~part.active) + refill

        def cond(loop: tuple[Slots, Array, Array]) -> Array:
            c, steps, _ = loop
            return (steps < p.chunk_steps) & jnp.any(c.active) & (jnp.sum(~c.active) < refill_at)

        def body(loop: tuple[Slots, Array, Array]) -> tuple[Slots, Array, Array]:
            c, steps, sampled = loop
            sampled = sampled + jnp.sum(c.active, dtype=jnp.int32)
            records, token, finished = sample_token(p, self.pad_id, c.next_logits, c.keys, c.active, c.records, version)
            going = c.active & ~finished  # only a token that is fed back needs its keys and values
            where = PagedWrite(pages, c.written, going.astype(jnp.int32))
            hidden, cache = model.forward_paged(token[:, None], c.cache, where, implementation)
            c = dataclasses.replace(
                c,
                cache=cache,
                next_logits=model.logits(hidden[:, 0]),
                written=c.written + going,
                active=going,
                records=records,
            )
            return constrain_slots(c), steps + 1, sampled

        done, steps, sampled = jax.lax.while_loop(cond, body, (part, jnp.int32(0), jnp.int32(0)))
        width = min(p.chunk_steps, p.max_new_tokens)
        new = {name: window(field, start, width) for name, field in done.records.columns.items()}
        if narrow:
            scattered = jax.tree_util.tree_map(lambda whole, x: whole.at[rows].set(x), slots.rows(), done.rows())
            done = dataclasses.replace(done, **scattered)
        done = constrain_slots(done)
        return done, Progress(done.active, done.records.length, steps, sampled, start, new)
