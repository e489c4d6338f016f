"""Continuous batching over a paged KV cache: a fixed number of slots, each refilled with the
next prompt as soon as its answer ends.

The static :class:`~asyncopd_jax.sampling.Sampler` decodes a batch until its longest answer
ends; on long-tailed answer lengths most of its decode work is padding. Here ``S`` slots
decode in one compiled loop, and each slot is its own sequence:

    slot s:  prompt tokens 0 .. len−1 | response token t at position len + t
             (RoPE position = token position: no left padding)

Its keys and values live in pages of one shared pool (:mod:`asyncopd_jax.models.paged_attention`),
which the host hands out as the sequence grows, so the cache holds the tokens written, not
``S × (P + T)`` slots. This module holds the compiled pieces (prefill into pages, a chunk of
decode steps, the rewrite of the pages in flight after a weight swap); the host loop that
hands out slots and pages, refills finished slots and keeps going across groups of prompts
is :class:`~asyncopd_jax.sampling.stream.RolloutStream`. :meth:`ContinuousSampler.generate`
runs one group through a fresh stream.

Randomness is per prompt: prompt ``i``'s response token ``t`` is drawn with
``fold_in(key_i, t)``, whichever slot it runs in, whenever it was admitted, so an answer
equals the one that prompt gets when sampled alone with the same key. Everything a rollout
records is what the static sampler records (:class:`~asyncopd_jax.cache.RolloutBatch`).

Shapes: S slots, P prompt slots, T = max_new_tokens, M pages per sequence
(``⌈(P + T) / page_size⌉``), V vocabulary, N candidates, K student top-K.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.estimators import sample_candidates
from asyncopd_jax.models.decoder import Decoder
from asyncopd_jax.models.paged_attention import PagedImplementation, PagedKVCache, PagedWrite
from asyncopd_jax.models.partitioning import Logical, constrain, mesh_context
from asyncopd_jax.sampling.distribution import SamplingParams, sampling_logprobs
from asyncopd_jax.sampling.sampler import SamplerBase, WeightSource, left_pad, side_records

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


def prompt_keys(key: Array, count: int) -> Array:
    """The sampling keys of prompts ``0 .. count − 1`` of a call: ``fold_in(key, i)``."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(count))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """What the decode loop carries for ``S`` slots (donated between calls)."""

    cache: PagedKVCache
    prompts: Array  # [S, P] int32, each prompt from slot position 0
    prompt_len: Array  # [S] int32
    keys: Array  # [S] PRNG keys of the slots' prompts
    step: Array  # [S] int32 response tokens sampled
    written: Array  # [S] int32 tokens in the cache (prompt + response tokens fed back)
    active: Array  # [S] bool: still decoding
    next_logits: Array  # [S, V] fp32: the distribution of response token `step`
    tokens: Array  # [S, T] int32
    logp: Array  # [S, T] fp32 behaviour log-probs
    versions: Array  # [S, T] int32
    candidate_ids: Array  # [S, T, N] int32
    candidate_logp: Array  # [S, T, N] fp32
    topk_ids: Array  # [S, T, K] int32
    topk_logp: Array  # [S, T, K] fp32
    steps_run: Array  # scalar int32: decode steps the last chunk ran
    sampled: Array  # scalar int32: tokens the last chunk sampled (every slot's, kept or not)


# the fields of Slots with a row per slot (the pool and the counters are shared)
PER_SLOT = tuple(f.name for f in dataclasses.fields(Slots) if f.name not in ("cache", "steps_run", "sampled"))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Admission:
    """``R`` prompts entering slots (rows with ``slot = S`` are bucket padding: dropped)."""

    slot: Array  # [R] int32
    prompts: Array  # [R, P] int32
    prompt_len: Array  # [R] int32 (0 for padding)
    keys: Array  # [R] PRNG keys
    page_table: Array  # [R, M] int32


@dataclasses.dataclass
class EngineStats:
    """What a :class:`~asyncopd_jax.sampling.stream.RolloutStream` did (the last
    :meth:`ContinuousSampler.generate`'s: ``last_stats``)."""

    slots: int = 0
    decode_steps: int = 0  # decode steps run
    row_steps: int = 0  # rows decoded, summed over steps (a step decodes the slots in flight, bucketed)
    tokens: int = 0  # response tokens sampled (kept answers only)
    prefill_tokens: int = 0
    refills: int = 0  # prompts that entered a slot an earlier answer had left
    chunks: int = 0
    preemptions: int = 0
    peak_pages: int = 0  # most pages in use at once
    pool_pages: int = 0
    # the chunks that started with prompts waiting (the steady state of a stream, before the
    # last answers drain): their decoded rows and the tokens they sampled
    waiting_row_steps: int = 0
    waiting_tokens: int = 0

    @property
    def utilisation(self) -> float:
        """Answer tokens kept per row decoded, over the whole stream (the last answers'
        drain included): 1.0 when no decoded row is an idle slot."""
        return self.tokens / max(self.row_steps, 1)

    @property
    def steady_utilisation(self) -> float:
        """Tokens sampled per row decoded while prompts were waiting for a slot: what a
        stream that never runs dry (a rollout stage under the capacity rule) keeps busy."""
        return self.waiting_tokens / max(self.waiting_row_steps, 1)


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


def bucket(n: int, limit: int) -> int:
    """The smallest power of two ≥ ``n``, at most ``limit``: few compiled shapes."""
    return min(1 << max(n - 1, 0).bit_length(), limit)


class ContinuousSampler(SamplerBase):
    """Samples responses with continuous batching over a paged KV cache (module docstring).

    A drop-in for :class:`~asyncopd_jax.sampling.Sampler`: the same :meth:`generate`, the
    same :class:`RolloutBatch`, the same interruption by a weight source between chunks.
    ``params.slots`` sequences decode at once (0: one per prompt), ``params.kv_pages`` pages
    of ``params.page_size`` tokens hold their keys and values (0: enough for every slot's
    longest sequence).
    """

    def __init__(
        self, graphdef: nnx.GraphDef, params: SamplingParams, pad_id: int = 0, mesh: jax.sharding.Mesh | None = None
    ):
        super().__init__(graphdef, params, pad_id, mesh)
        self._admit = jax.jit(self._admit_fn, donate_argnums=(1,))
        self._decode = jax.jit(self._decode_fn, donate_argnums=(1,))
        self._recompute = jax.jit(self._recompute_fn, donate_argnums=(1,))
        self._evict = jax.jit(lambda slots, gone: dataclasses.replace(slots, active=slots.active & ~gone))
        self._rows = jax.jit(self._rows_fn)
        self.last_stats = EngineStats()

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

    # --- jitted pieces ------------------------------------------------------------------

    def _empty(self, state: nnx.State, slots: int, prompt_slots: int, pool: int) -> Slots:
        """Idle slots and an empty pool of ``pool`` pages."""
        p, c = self.params, nnx.merge(self.graphdef, state).config
        head = jax.eval_shape(lambda s: self._model(s).lm_head_weight(), state)  # [H, V] in the compute dtype
        t, n, k = p.max_new_tokens, max(p.num_candidates, 1), max(p.student_topk, 1)
        return Slots(
            cache=PagedKVCache.empty(
                self.implementation,
                c.num_hidden_layers,
                c.num_key_value_heads,
                c.head_dim,
                pool,
                p.page_size,
                head.dtype,
            ),
            prompts=jnp.zeros((slots, prompt_slots), jnp.int32),
            prompt_len=jnp.zeros((slots,), jnp.int32),
            keys=jax.random.split(jax.random.key(0), slots),
            step=jnp.zeros((slots,), jnp.int32),
            written=jnp.zeros((slots,), jnp.int32),
            active=jnp.zeros((slots,), bool),
            next_logits=jnp.zeros((slots, head.shape[1]), jnp.float32),
            tokens=jnp.full((slots, t), self.pad_id, jnp.int32),
            logp=jnp.zeros((slots, t), jnp.float32),
            versions=jnp.zeros((slots, t), jnp.int32),
            candidate_ids=jnp.zeros((slots, t, n), jnp.int32),
            candidate_logp=jnp.zeros((slots, t, n), jnp.float32),
            topk_ids=jnp.zeros((slots, t, k), jnp.int32),
            topk_logp=jnp.zeros((slots, t, k), jnp.float32),
            steps_run=jnp.int32(0),
            sampled=jnp.int32(0),
        )

    def _admit_fn(self, state, slots: Slots, new: Admission) -> Slots:
        """Prefill ``new``'s prompts into their pages and start their slots."""
        model = self._model(state)
        chunk = min(self.params.recompute_chunk, new.prompts.shape[1])
        cache, logits = fill_pages(
            model, slots.cache, new.prompts, new.prompt_len, new.page_table, chunk, self.implementation
        )
        put = lambda field, value: field.at[new.slot].set(value, mode="drop")  # noqa: E731
        admitted = dataclasses.replace(
            slots,
            cache=cache,
            prompts=put(slots.prompts, new.prompts),
            prompt_len=put(slots.prompt_len, new.prompt_len),
            keys=put(slots.keys, new.keys),
            step=put(slots.step, 0),
            written=put(slots.written, new.prompt_len),
            active=put(slots.active, True),
            next_logits=put(slots.next_logits, logits),
            tokens=put(slots.tokens, self.pad_id),
            logp=put(slots.logp, 0.0),
            versions=put(slots.versions, 0),
        )
        return constrain_slots(admitted)

    def _recompute_fn(self, state, slots: Slots, page_table: Array) -> Slots:
        """Every decoding slot's written tokens rewritten under new weights ``state``."""
        t = self.params.max_new_tokens
        position = jnp.arange(slots.prompts.shape[1] + t)[None]
        in_prompt = position < slots.prompt_len[:, None]
        sequence = jnp.where(
            in_prompt,
            jnp.take_along_axis(slots.prompts, jnp.minimum(position, slots.prompts.shape[1] - 1), axis=1),
            jnp.take_along_axis(slots.tokens, jnp.clip(position - slots.prompt_len[:, None], 0, t - 1), axis=1),
        )
        lengths = jnp.where(slots.active, slots.written, 0)
        cache, logits = fill_pages(
            self._model(state),
            slots.cache,
            sequence,
            lengths,
            page_table,
            self.params.recompute_chunk,
            self.implementation,
        )
        return constrain_slots(dataclasses.replace(slots, cache=cache, next_logits=logits))

    def _decode_fn(self, state, slots: Slots, page_table: Array, rows: Array, version, max_steps, refill_at) -> Slots:
        """Decode slots ``rows [W]`` (their pages: ``page_table [W, C]``) until ``max_steps``
        steps ran, none of them decodes, or ``refill_at`` of them are free. ``W < S``: the
        rows are gathered, decoded and scattered back (the pool is shared, not copied)."""
        model = self._model(state)
        p = self.params
        t_max = p.max_new_tokens
        stop_ids = jnp.asarray(p.stop_token_ids or (-1,), jnp.int32)
        whole = slots
        narrow = rows.shape[0] < slots.active.shape[0]
        if narrow:
            slots = dataclasses.replace(slots, **{f: getattr(slots, f)[rows] for f in PER_SLOT})
        row = jnp.arange(rows.shape[0])
        implementation = self.implementation

        def cond(c: Slots):
            free = jnp.sum(~c.active)
            return (c.steps_run < max_steps) & jnp.any(c.active) & (free < refill_at)

        def body(c: Slots) -> Slots:
            logp_all = sampling_logprobs(c.next_logits, p)  # [S, V]
            # each slot's draws from its own prompt's key and its own step
            step_keys = jax.vmap(jax.random.fold_in)(c.keys, c.step)
            draws = jax.vmap(lambda key, lp: sample_candidates(key, lp[None], 1 + p.num_candidates)[0][0])(
                step_keys, logp_all
            )  # [S, 1 + N]
            active = c.active
            token = jnp.where(active, draws[:, 0], self.pad_id)
            column = jnp.where(active, c.step, t_max)  # an idle slot's writes land past T: dropped
            put = lambda field, value: field.at[row, column].set(value, mode="drop")  # noqa: E731
            fields = dict(
                tokens=put(c.tokens, token),
                logp=put(c.logp, jnp.take_along_axis(logp_all, token[:, None], axis=-1)[:, 0]),
                versions=put(c.versions, jnp.full_like(token, version)),
            )
            for name, value in side_records(p, c.next_logits, logp_all, draws).items():
                fields[name] = put(getattr(c, name), value)
            finished = active & (jnp.isin(token, stop_ids) | (c.step + 1 >= t_max))
            going = active & ~finished  # only a token that is fed back needs its keys and values
            hidden, cache = model.forward_paged(
                token[:, None], c.cache, PagedWrite(page_table, c.written, going.astype(jnp.int32)), implementation
            )
            return constrain_slots(
                dataclasses.replace(
                    c,
                    cache=cache,
                    next_logits=model.logits(hidden[:, 0]),
                    step=c.step + active,
                    written=c.written + going,
                    active=going,
                    steps_run=c.steps_run + 1,
                    sampled=c.sampled + jnp.sum(active, dtype=jnp.int32),
                    **fields,
                )
            )

        done = jax.lax.while_loop(cond, body, dataclasses.replace(slots, steps_run=jnp.int32(0), sampled=jnp.int32(0)))
        if narrow:
            done = dataclasses.replace(done, **{f: getattr(whole, f).at[rows].set(getattr(done, f)) for f in PER_SLOT})
        return constrain_slots(done)

    def lower(
        self, abstract_state: Any, slots: int, prompt_slots: int, columns: int | None = None
    ) -> dict[str, jax.stages.Lowered]:
        """The engine's functions lowered (not compiled) for ``slots`` slots of prompts of up
        to ``prompt_slots`` tokens and a pool of :meth:`pool_pages` pages, at weights
        ``abstract_state`` (``ShapeDtypeStruct`` s placed on :attr:`mesh`); nothing is
        allocated. For ``asyncopd plan``.

        Args:
          columns: page-table columns (default: every page of the longest sequence, the
            worst case of the attention's reads).

        Returns:
          ``"admit"`` (a prefill of ``slots`` prompts), ``"decode"`` (a chunk of decode
          steps) and ``"recompute"`` (the pages in flight rewritten after a weight swap).
        """
        columns = columns or self.pages_per_sequence(prompt_slots)
        pool = self.pool_pages(slots, prompt_slots)

        def placed(tree: Any, axes_of=lambda path, x: (None,) * len(x.shape)) -> Any:
            return jax.tree_util.tree_map_with_path(
                lambda path, x: jax.ShapeDtypeStruct(
                    x.shape, x.dtype, sharding=self._sharding(axes_of(path, x), x.shape)
                ),
                tree,
            )

        with mesh_context(self.mesh):
            carry = placed(
                jax.eval_shape(lambda s: self._empty(s, slots, prompt_slots, pool), abstract_state), slots_axes
            )
            table = placed(jax.ShapeDtypeStruct((slots, columns), jnp.int32))
            new = placed(
                jax.eval_shape(
                    lambda: Admission(
                        slot=jnp.zeros((slots,), jnp.int32),
                        prompts=jnp.zeros((slots, prompt_slots), jnp.int32),
                        prompt_len=jnp.zeros((slots,), jnp.int32),
                        keys=jax.random.split(jax.random.key(0), slots),
                        page_table=jnp.zeros((slots, columns), jnp.int32),
                    )
                )
            )
            scalar = placed(jax.ShapeDtypeStruct((), jnp.int32))
            rows = placed(jax.ShapeDtypeStruct((slots,), jnp.int32))  # every slot: the widest decode
            return {
                "admit": self._admit.lower(abstract_state, carry, new),
                "decode": self._decode.lower(abstract_state, carry, table, rows, scalar, scalar, scalar),
                "recompute": self._recompute.lower(abstract_state, carry, table),
            }

    @staticmethod
    def _rows_fn(slots: Slots, index: Array) -> dict[str, Array]:
        """The records of slots ``index [R]``."""
        fields = ("step", "tokens", "logp", "versions", "candidate_ids", "candidate_logp", "topk_ids", "topk_logp")
        return {name: getattr(slots, name)[index] for name in fields}

    # --- host loop ----------------------------------------------------------------------

    def generate(
        self,
        state: nnx.State,
        prompts: Sequence[Sequence[int]],
        key: Array,
        *,
        version: int = 0,
        weight_source: WeightSource | None = None,
        prompt_slots: int | None = None,
        keys: Array | None = None,
    ) -> RolloutBatch:
        """Sample one response per prompt (the arguments of :meth:`Sampler.generate`).

        Args:
          key: prompt ``i`` samples with ``fold_in(key, i)`` (:func:`prompt_keys`).
          keys: ``[len(prompts)]`` the prompts' keys, instead of ones derived from ``key``.

        Returns:
          A :class:`RolloutBatch` in the prompts' order (prompts left-padded to
          ``prompt_slots``, as the static sampler gives them).
        """
        from asyncopd_jax.sampling.stream import RolloutStream  # the host side, which builds on this module

        ids, _ = left_pad(prompts, self.pad_id, prompt_slots)  # checks the prompts; the batch's layout
        stream = RolloutStream(
            self, state, version=version, prompt_slots=ids.shape[1], slots=self.params.slots or len(prompts)
        )
        stream.submit(None, prompts, prompt_keys(key, len(prompts)) if keys is None else keys)
        ((_, batch),) = stream.run(weight_source)
        self.last_stats = stream.stats
        return batch
