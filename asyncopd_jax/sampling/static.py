"""The static engine: a batch of prompts decoded in lockstep over a dense KV cache until its
longest answer ends, interruptible between chunks.

Layout of one generation (B prompts, P prompt slots, T = max_new_tokens, C = P + T):

    cache slot:  0 ........ P−1 | P ........ P+T−1
    content:     left-padded      response token t sits in slot P + t
                 prompts

Row b's prompt has ``len_b`` real tokens at RoPE positions ``0..len_b−1``; its response
token t has position ``len_b + t``. Decoding runs in a ``lax.while_loop`` that stops at
the end of a chunk of ``chunk_steps`` steps or as soon as every row has finished; between
chunks the host may swap in newer weights, after which the cache is rewritten in place
under them (a chunked prefill over the P + t slots written so far) and decoding resumes,
so a response can span several policy versions, recorded per token. Each step samples
with the shared :func:`~asyncopd_jax.sampling.decode.sample_token` (per-prompt keys: row
b's answer is the one its prompt gets alone, or from the continuous engine).

On a ``(data, fsdp, tensor)`` mesh (:mod:`asyncopd_jax.models.partitioning`) the rows lie
over ``data`` and ``fsdp`` (where they divide, else replicated), the weights as they come
(a rollout stage receives them laid out by ``parameter_shardings``: heads, MLP and
vocabulary over ``tensor``), and the KV cache's keys and values ``[B, N_kv, C, D]`` with
rows over ``data`` and ``fsdp`` and key/value heads over ``tensor``.

The host side is :class:`StaticStream`: one group at a time, one chunk per step, the next
chunk dispatched before the host reads the last one's progress.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.models.decoder import Decoder, KVCache
from asyncopd_jax.models.partitioning import Logical, constrain, mesh_context
from asyncopd_jax.sampling.decode import sample_token
from asyncopd_jax.sampling.distribution import SamplingParams
from asyncopd_jax.sampling.engine import BatchFigures, Calls, Engine, EngineStats, ProgramShapes
from asyncopd_jax.sampling.episodes import Turns
from asyncopd_jax.sampling.records import Records, left_pad, rollout_batch

Array = jax.Array

#: The KV cache's keys and values ``[B, N_kv, C, D]``: rows over (data, fsdp), heads over tensor.
CACHE_AXES: Logical = ("batch", "act_heads", None, None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything the decode loop carries (donated between chunks and to the recompute)."""

    cache: KVCache
    prompt_tokens: Array  # [B, P] int32, left-padded
    prompt_mask: Array  # [B, P] bool
    prompt_lengths: Array  # [B] int32
    keys: Array  # [B] PRNG keys of the rows' prompts
    active: Array  # [B] bool: still answering
    next_logits: Array  # [B, V] fp32: the distribution of each row's next token
    step: Array  # scalar int32: decode steps run, the cache slots written past P
    records: Records  # [B, T, ...] what the rows sampled

    @property
    def prompt_slots(self) -> int:
        return self.prompt_tokens.shape[1]


# --- layout ---------------------------------------------------------------------------


def row_axes(ndim: int) -> Logical:
    """The layout of an array of rows: its leading dimension over the batch axes, the rest
    whole (a scalar: replicated)."""
    return ("batch",) + (None,) * (ndim - 1) if ndim else ()


def layout_axes(path: Sequence[Any], x: Any) -> Logical:
    """The logical axes of the leaf ``x`` at ``path`` in a :class:`DecodeState` or
    :class:`KVCache`: the cache's keys and values (``[B, N_kv, C, D]``: the only leaves
    named so with four axes; the rows' PRNG keys are ``[B]``) :data:`CACHE_AXES`, every
    other array by rows (``valid [B, C]``, the ``[B, T, …]`` records), the step replicated."""
    names = {getattr(key, "name", None) for key in path}
    return CACHE_AXES if names & {"keys", "values"} and len(x.shape) == 4 else row_axes(len(x.shape))


def constrain_layout(tree: Any) -> Any:
    """``tree`` (a :class:`DecodeState` or :class:`KVCache`) laid out by :func:`layout_axes`
    on the mesh being traced under; unchanged with none."""
    return jax.tree_util.tree_map_with_path(lambda path, x: constrain(x, layout_axes(path, x)), tree)


# --- the cache's contents ---------------------------------------------------------------


def written_sequence(carry: DecodeState) -> tuple[Array, Array, Array]:
    """What the cache's ``C = P + T`` slots hold, as one sequence: ``tokens``, ``valid``
    (the prompts' real tokens and the response tokens sampled so far) and RoPE
    ``positions``, each ``[B, C]``; left padding gets the positions an unpadded prompt
    would have."""
    tokens = jnp.concatenate([carry.prompt_tokens, carry.records.tokens], axis=1)
    # only tokens already sampled are valid: a row's slots from P + length on are not
    valid = jnp.concatenate([carry.prompt_mask, carry.records.response_mask()], axis=1)
    prompt_positions = jnp.maximum(jnp.cumsum(carry.prompt_mask, axis=1) - 1, 0)
    response_positions = carry.prompt_lengths[:, None] + jnp.arange(carry.records.tokens.shape[1])[None]
    positions = jnp.concatenate([prompt_positions, response_positions], axis=1).astype(jnp.int32)
    return tokens, valid, positions


def chunked_prefill(
    model: Decoder, cache: KVCache, tokens: Array, valid: Array, positions: Array, end: Array, chunk: int
) -> tuple[KVCache, Array]:
    """Rewrite ``cache``'s slots ``[0, end)`` under ``model`` in place, ``chunk`` slots at a
    time; the logits ``[B, V]`` (fp32) at slot ``end − 1``.

    Each chunk is written into the same cache and attends, causally by slot, to the chunks
    before it, already rewritten; slots from ``end`` on that a chunk covers are written as
    ``valid`` says (invalid: nothing attends to them until the decode loop writes them).
    The trip count ``⌈end / chunk⌉`` is dynamic: one compiled loop for every ``end``, whose
    work follows ``end`` (none at ``end = 0``). Each chunk's attention holds
    ``[B, N_q, chunk, C]`` fp32 scores.

    Args:
      tokens, valid, positions: ``[B, C]`` the whole cache's contents
        (:func:`written_sequence`).
      end: scalar int32 in ``[0, C]``: slots written so far.
    """
    b, slots = tokens.shape
    size = min(chunk, slots)

    def body(i, state: tuple[KVCache, Array]) -> tuple[KVCache, Array]:
        cache, _ = state
        # a last chunk that would reach past C is moved back to end at C, rewriting slots an
        # earlier chunk wrote (with the same keys and values)
        start = jnp.minimum(i * size, slots - size)
        take = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=start, slice_size=size, axis=1)
        hidden, cache = model.forward(take(tokens), take(positions), take(valid), cache, start)
        # the last chunk holds slot end − 1 (it starts at or before it and ends at or after end)
        last = jax.lax.dynamic_index_in_dim(hidden, jnp.clip(end - 1 - start, 0, size - 1), axis=1, keepdims=False)
        return constrain_layout(cache), last

    first = (constrain_layout(cache), jnp.zeros((b, model.config.hidden_size), model.compute_dtype))
    cache, last = jax.lax.fori_loop(0, (end + size - 1) // size, body, first)
    return cache, model.logits(last)


class Sampler(Engine):
    """The static engine (module docstring): each group of prompts is one batch, decoded in
    lockstep until its longest answer ends (:class:`~asyncopd_jax.sampling.engine.Engine`
    for the arguments).

    Its compiled programs, called by :class:`StaticStream`: :attr:`prefill`,
    :attr:`decode` (a chunk of steps, donating the carry) and :attr:`recompute` (the
    cache rewritten in place under new weights, donating the carry).
    """

    def __init__(
        self, graphdef: nnx.GraphDef, params: SamplingParams, pad_id: int = 0, mesh: jax.sharding.Mesh | None = None
    ):
        super().__init__(graphdef, params, pad_id, mesh)
        self.prefill = jax.jit(self._prefill_fn)
        self.decode = jax.jit(self._decode_fn, donate_argnums=(1,))
        # the carry is donated: its cache is rewritten in place, never two caches at once
        self.recompute = jax.jit(self._recompute_fn, donate_argnums=(1,))

    def open_stream(
        self,
        state: nnx.State,
        *,
        version: int,
        prompt_slots: int,
        slots: int | None = None,
        turns: Turns | None = None,
    ) -> StaticStream:
        if turns is not None:
            raise ValueError("multi-turn rollouts need sampling.engine = continuous: the static engine parks no turn")
        return StaticStream(self, state, version=version, prompt_slots=prompt_slots, slots=slots)

    def decode_rows(self, rows: int) -> int:
        return rows

    @property
    def programs(self) -> dict[str, Any]:
        return {"prefill": self.prefill, "decode": self.decode, "recompute": self.recompute}

    def program_shapes(self, rows: int, prompt_slots: int) -> ProgramShapes:
        """One shape each: every group decodes as one batch of its ``rows`` rows at
        ``prompt_slots + max_new_tokens`` slots."""
        return {name: ((rows, prompt_slots),) for name in self.programs}

    def put_rows(self, x: np.ndarray | Array) -> Array:
        """Rows onto the mesh, split by rows where they divide."""
        return self.put(x, row_axes(x.ndim))

    # --- jitted pieces ----------------------------------------------------------------

    def _prefill_fn(self, state, prompt_tokens: Array, prompt_mask: Array, keys: Array) -> DecodeState:
        """A fresh carry for ``prompt_tokens, prompt_mask [B, P]`` sampled with ``keys [B]``:
        the prompts prefilled into a cache of P + T slots, nothing sampled yet."""
        model = self._model(state)
        (b, slots_p), t = prompt_tokens.shape, self.params.max_new_tokens
        empty = DecodeState(
            cache=KVCache.empty(model.config, b, slots_p + t, self.cache_dtype(model.compute_dtype)),
            prompt_tokens=prompt_tokens,
            prompt_mask=prompt_mask,
            prompt_lengths=prompt_mask.sum(axis=1).astype(jnp.int32),
            keys=keys,
            active=jnp.ones((b,), bool),
            next_logits=jnp.zeros((b, model.lm_head_weight().shape[1]), jnp.float32),
            step=jnp.int32(0),
            records=Records.empty(self.params, b, self.pad_id),
        )
        # chunks no longer than the prompt: a short prompt's prefill computes its P slots, not P + T
        return self._refill(model, constrain_layout(empty), min(self.params.recompute_chunk, slots_p))

    def _recompute_fn(self, state, carry: DecodeState) -> DecodeState:
        """``carry`` (donated) under new weights ``state``: its cache rewritten in place."""
        return self._refill(self._model(state), carry, self.params.recompute_chunk)

    def _refill(self, model: Decoder, carry: DecodeState, chunk: int) -> DecodeState:
        """``carry`` with its cache rewritten under ``model`` from the tokens written so far
        (slots ``[0, P + step)``, :func:`chunked_prefill`) and the next logits from slot
        ``P + step − 1``, which predicts response token ``step``, in chunks of ``chunk`` slots.
        Slots from ``P + step`` on stay invalid until the decode loop writes them.

        A swap at step s costs a forward over ~P + s slots (rounded up to whole chunks), not
        P + T, in one compiled function whatever s (the trip count is dynamic); none once
        every row has finished (a recompute the stream dispatched before it knew)."""
        tokens, valid, positions = written_sequence(carry)
        end = jnp.where(jnp.any(carry.active), carry.prompt_slots + carry.step, 0)
        cache, next_logits = chunked_prefill(model, carry.cache, tokens, valid, positions, end, chunk)
        return constrain_layout(dataclasses.replace(carry, cache=cache, next_logits=next_logits))

    def _decode_fn(self, state, carry: DecodeState, version: Array, chunk_end: Array) -> tuple[DecodeState, Array]:
        """Decode until ``chunk_end`` steps are written or every row is done (at once, when
        it already is). Returns the carry and its progress ``[steps run, rows active,
        answer tokens]`` (int32 ``[3]``): all the host reads of a chunk."""
        model = self._model(state)

        def cond(c: DecodeState):
            return (c.step < chunk_end) & jnp.any(c.active)

        def body(c: DecodeState) -> DecodeState:
            records, token, finished = sample_token(
                self.params, self.pad_id, c.next_logits, c.keys, c.active, c.records, version
            )
            # every row writes slot P + step; a finished row's token is not valid there
            hidden, cache = model.forward(
                token[:, None],
                (c.prompt_lengths + c.step)[:, None],
                c.active[:, None],
                c.cache,
                c.prompt_slots + c.step,
            )
            new = dataclasses.replace(
                c,
                cache=cache,
                next_logits=model.logits(hidden[:, 0]),
                step=c.step + 1,
                active=c.active & ~finished,
                records=records,
            )
            return constrain_layout(new)

        done = jax.lax.while_loop(cond, body, carry)
        progress = jnp.stack([done.step, jnp.sum(done.active), jnp.sum(done.records.length)]).astype(jnp.int32)
        return done, progress

    # --- ahead of time ------------------------------------------------------------------

    def abstract_calls(self, abstract_state: Any, rows: int, prompt_slots: int) -> Calls:
        ids = self.placed(jax.ShapeDtypeStruct((rows, prompt_slots), jnp.int32), lambda path, x: row_axes(2))
        mask = self.placed(jax.ShapeDtypeStruct((rows, prompt_slots), jnp.bool_), lambda path, x: row_axes(2))
        keys = self.placed(jax.eval_shape(lambda: jax.random.split(jax.random.key(0), rows)), lambda p, x: row_axes(1))
        scalar = self.placed(jax.ShapeDtypeStruct((), jnp.int32), lambda path, x: ())
        carry = self.placed(jax.eval_shape(self.prefill, abstract_state, ids, mask, keys), layout_axes)
        return {
            "prefill": (self.prefill, (abstract_state, ids, mask, keys), {}),
            "decode": (self.decode, (abstract_state, carry, scalar, scalar), {}),
            "recompute": (self.recompute, (abstract_state, carry), {}),
        }

    def decode_cache(self, abstract_state: Any, rows: int, prompt_slots: int) -> None:
        """None: a step of a batch in lockstep reads its whole dense cache, as compiled."""
        return None

    def batch_seconds(self, batch: BatchFigures) -> tuple[float, float, float]:
        """Waves of ``rows`` prompts in lockstep, ⌈prompts / (rows · samplers)⌉ per sampler,
        each a prefill and T compiled decode steps (its longest answer's, at the limit); a
        swap rewrites the whole cache."""
        waves = -(-batch.prompts // (batch.rows * batch.samplers))
        return waves * batch.prefill, waves * self.params.max_new_tokens * batch.decode, 1.0


@dataclasses.dataclass
class _Group:
    """A submitted group: its prompts left-padded ``[G, P]`` and their keys ``[G]``."""

    tag: Any
    ids: np.ndarray
    mask: np.ndarray
    keys: Array


class StaticStream:
    """Groups through the static engine, one at a time, each decoded as one batch of its own
    rows (no refills): the :class:`~asyncopd_jax.sampling.engine.RolloutStream` protocol.

    A step dispatches the next chunk (after the cache's recompute, when weights were swapped
    in), then reads the progress of the chunk before it: one read per chunk, while the
    device decodes. A chunk dispatched after the batch ended (the host could not know) is a
    loop that stops at once; so is its recompute.
    """

    def __init__(self, engine: Sampler, state: nnx.State, *, version: int, prompt_slots: int, slots: int | None = None):
        self.engine, self.state, self.version = engine, state, version
        self.prompt_slots = prompt_slots
        self.queue: collections.deque[_Group] = collections.deque()
        self.group: _Group | None = None  # the group decoding
        self.carry: DecodeState | None = None  # its carry (after it, the last group's)
        self.in_flight: Array | None = None  # the progress of the chunk dispatched last, unread
        self.chunk_end = 0  # the step the chunk dispatched last stops at, at most
        self.steps = 0  # decode steps the group ran, as last read
        self.stale = False  # weights swapped in since the cache was written
        self.slots = slots or 0  # grows to the largest group's rows
        self.stats = EngineStats(slots=self.slots)

    @property
    def queued(self) -> int:
        return sum(len(g.ids) for g in self.queue)

    @property
    def pending_groups(self) -> int:
        return len(self.queue) + (self.group is not None)

    @property
    def idle(self) -> bool:
        return self.group is None and not self.queue

    @property
    def wants_prompts(self) -> bool:
        return self.idle

    def submit(
        self, tag: Any, prompts: Sequence[Sequence[int]], keys: Array, environments: Sequence[Any] | None = None
    ) -> None:
        if environments is not None:
            raise ValueError("the static engine samples single-turn answers: it takes no environments")
        ids, mask = left_pad(prompts, self.engine.pad_id, self.prompt_slots)  # checks the prompts
        if len(keys) != len(prompts):
            raise ValueError(f"{len(keys)} keys for {len(prompts)} prompts")
        self.queue.append(_Group(tag, ids, mask, keys))

    def swap(self, version: int, state: nnx.State) -> None:
        self.version, self.state = version, state
        self.stale = self.group is not None

    def step(self) -> list[tuple[Any, RolloutBatch]]:
        if self.group is None:
            if self.queue:
                self._start(self.queue.popleft())
            return []
        assert self.carry is not None and self.in_flight is not None
        read, self.in_flight = self.in_flight, None
        t_max = self.engine.params.max_new_tokens
        if self.chunk_end < t_max:  # the batch may go on: dispatch before reading
            with mesh_context(self.engine.mesh):
                if self.stale:
                    self.carry = self.engine.recompute(self.state, self.carry)
                self._dispatch()
        self.stale = False
        steps, active, tokens = (int(x) for x in jax.device_get(read))
        rows = self.carry.active.shape[0]
        self.stats.decode_steps += steps - self.steps
        self.stats.row_steps += (steps - self.steps) * rows
        self.stats.chunks += 1
        self.steps = steps
        if active:
            return []
        self.stats.tokens += tokens
        carry, group = self.carry, self.group
        self.group, self.in_flight = None, None
        if self.queue:  # the next group decodes while the caller takes this one
            self._start(self.queue.popleft())
        return [(group.tag, rollout_batch(carry.prompt_tokens, carry.prompt_mask, carry.records, self.engine.params))]

    def _start(self, group: _Group) -> None:
        """Prefill ``group`` and dispatch its first chunk."""
        engine, ids, mask = self.engine, group.ids, group.mask
        self.group, self.steps, self.chunk_end, self.stale = group, 0, 0, False
        self.slots = self.stats.slots = max(self.slots, len(ids))
        self.stats.prefill_tokens += int(mask.sum())
        with mesh_context(engine.mesh):  # traced and run under the mesh: the layout constraints apply
            keys = engine.put_rows(group.keys)
            self.carry = engine.prefill(self.state, engine.put_rows(ids), engine.put_rows(mask), keys)
            self._dispatch()

    def _dispatch(self) -> None:
        """The next chunk of decode steps (at most ``chunk_steps``, up to T)."""
        assert self.carry is not None
        self.chunk_end = min(self.chunk_end + self.engine.params.chunk_steps, self.engine.params.max_new_tokens)
        self.carry, self.in_flight = self.engine.decode(
            self.state, self.carry, np.int32(self.version), np.int32(self.chunk_end)
        )
