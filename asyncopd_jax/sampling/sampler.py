"""A jitted prefill + decode sampler over a KV cache on a device mesh, interruptible between chunks.

Layout of one generation (B prompts, P prompt slots, T = max_new_tokens, C = P + T):

    cache slot:  0 ........ P−1 | P ........ P+T−1
    content:     left-padded      response token t sits in slot P + t
                 prompts

Row b's prompt has ``len_b`` real tokens at RoPE positions ``0..len_b−1``; its response
token t has position ``len_b + t``. Decoding runs in a ``lax.while_loop`` that stops at
the end of a chunk of ``chunk_steps`` steps or as soon as every row has finished; between
chunks the host may swap in newer weights, after which the cache is rewritten in place
under them (a chunked prefill over the P + t slots written so far) and decoding resumes,
so a response can span several policy versions, recorded per token.

On a ``(data, fsdp, tensor)`` mesh (:mod:`asyncopd_jax.models.partitioning`) the rows lie
over ``data`` and ``fsdp`` (where they divide, else replicated), the weights as they come
(a rollout stage receives them laid out by ``parameter_shardings``: heads, MLP and
vocabulary over ``tensor``), and the KV cache's keys and values ``[B, N_kv, C, D]`` with
rows over ``data`` and ``fsdp`` and key/value heads over ``tensor``.

Per response token the sampler records: the token; its behaviour log-prob under the
distribution actually sampled from; the policy version that sampled it; N Monte-Carlo
candidates drawn from the same distribution in the same step, with their log-probs; and
optionally the sampling student's top-K ids with their behaviour log-probs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.estimators import sample_candidates
from asyncopd_jax.models.decoder import Decoder, KVCache, cast_floating
from asyncopd_jax.models.partitioning import Logical, constrain, logical_spec, mesh_context
from asyncopd_jax.sampling.distribution import SamplingParams, sampling_logprobs

Array = jax.Array

# Called between decode chunks with the version in use; returns (version, state) of
# newer weights to swap in, or None to keep going.
WeightSource = Callable[[int], "tuple[int, nnx.State] | None"]

#: The KV cache's keys and values ``[B, N_kv, C, D]``: rows over (data, fsdp), heads over tensor.
CACHE_AXES: Logical = ("batch", "act_heads", None, None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything the decode loop carries (donated between chunks and to the recompute)."""

    cache: KVCache
    next_logits: Array  # [B, V] distribution of the token to sample at `step`
    step: Array  # scalar int32: response tokens written so far
    done: Array  # [B] bool
    prompt_tokens: Array  # [B, P] int32, left-padded
    prompt_mask: Array  # [B, P] bool
    prompt_lengths: Array  # [B] int32
    tokens: Array  # [B, T] int32
    logp: Array  # [B, T] fp32 behaviour log-probs
    versions: Array  # [B, T] int32
    mask: Array  # [B, T] bool
    candidate_ids: Array  # [B, T, N] int32
    candidate_logp: Array  # [B, T, N] fp32
    topk_ids: Array  # [B, T, K] int32
    topk_logp: Array  # [B, T, K] fp32 behaviour log-probs of topk_ids

    @property
    def prompt_slots(self) -> int:
        return self.prompt_tokens.shape[1]


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token lists → left-padded ``[B, P]`` ids and mask (P = longest prompt or ``width``)."""
    longest = max(len(p) for p in prompts)
    width = longest if width is None else width
    if longest > width:
        raise ValueError(f"a prompt has {longest} tokens, more than the {width} prompt slots")
    if min(len(p) for p in prompts) == 0:
        raise ValueError("empty prompt: every prompt needs at least one token")
    ids = np.full((len(prompts), width), pad_id, np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = p
        mask[row, width - len(p) :] = True
    return ids, mask


# --- layout ---------------------------------------------------------------------------


def row_axes(ndim: int) -> Logical:
    """The layout of an array of rows: its leading dimension over the batch axes, the rest
    whole (a scalar: replicated)."""
    return ("batch",) + (None,) * (ndim - 1) if ndim else ()


def layout_axes(path: Sequence[Any], x: Any) -> Logical:
    """The logical axes of the leaf ``x`` at ``path`` in a :class:`DecodeState` or
    :class:`KVCache`: the cache's keys and values :data:`CACHE_AXES`, every other array by
    rows (``valid [B, C]``, the ``[B, T, …]`` records), the step replicated."""
    names = {getattr(key, "name", None) for key in path}
    return CACHE_AXES if names & {"keys", "values"} else row_axes(len(x.shape))


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
    tokens = jnp.concatenate([carry.prompt_tokens, carry.tokens], axis=1)
    # carry.mask is True only on tokens already sampled: slots from P + step on are invalid
    valid = jnp.concatenate([carry.prompt_mask, carry.mask], axis=1)
    prompt_positions = jnp.maximum(jnp.cumsum(carry.prompt_mask, axis=1) - 1, 0)
    response_positions = carry.prompt_lengths[:, None] + jnp.arange(carry.tokens.shape[1])[None]
    positions = jnp.concatenate([prompt_positions, response_positions], axis=1).astype(jnp.int32)
    return tokens, valid, positions


def side_records(params: SamplingParams, logits: Array, logp_all: Array, draws: Array) -> dict[str, Array]:
    """What a decode step records per row beside its token, by the fields' names (of
    :class:`DecodeState` and the continuous engine's slots): the N Monte-Carlo candidates
    (``draws[:, 1:]``, drawn with the token) and the student's top-K ids, each with its
    behaviour log-prob under ``logp_all [B, V]``, as configured.

    Args:
      logits: ``[B, V]`` the step's raw logits (the top-K is of the model, not the sampling
        distribution); logp_all: ``[B, V]`` the sampling distribution's log-probs;
      draws: ``[B, 1 + N]`` the token and its candidates.
    """
    records = {}
    if params.num_candidates:
        candidates = draws[:, 1:]
        records["candidate_ids"] = candidates
        records["candidate_logp"] = jnp.take_along_axis(logp_all, candidates, axis=-1)
    if params.student_topk:
        topk = jax.lax.top_k(logits, params.student_topk)[1].astype(jnp.int32)
        records["topk_ids"] = topk
        records["topk_logp"] = jnp.take_along_axis(logp_all, topk, axis=-1)
    return records


def chunked_prefill(
    model: Decoder, cache: KVCache, tokens: Array, valid: Array, positions: Array, end: Array, chunk: int
) -> tuple[KVCache, Array]:
    """Rewrite ``cache``'s slots ``[0, end)`` under ``model`` in place, ``chunk`` slots at a
    time; the logits ``[B, V]`` (fp32) at slot ``end − 1``.

    Each chunk is written into the same cache and attends, causally by slot, to the chunks
    before it, already rewritten; slots from ``end`` on that a chunk covers are written as
    ``valid`` says (invalid: nothing attends to them until the decode loop writes them).
    The trip count ``⌈end / chunk⌉`` is dynamic: one compiled loop for every ``end``, whose
    work follows ``end``. Each chunk's attention holds ``[B, N_q, chunk, C]`` fp32 scores.

    Args:
      tokens, valid, positions: ``[B, C]`` the whole cache's contents
        (:func:`written_sequence`).
      end: scalar int32 in ``[1, C]``: slots written so far.
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


class SamplerBase:
    """What both engines keep: the model's graph, the sampling parameters, the pad id and
    the mesh (:class:`Sampler`, :class:`~asyncopd_jax.sampling.ContinuousSampler`)."""

    def __init__(
        self, graphdef: nnx.GraphDef, params: SamplingParams, pad_id: int = 0, mesh: jax.sharding.Mesh | None = None
    ):
        self.graphdef = graphdef
        self.mesh = mesh
        self.params = params
        self.pad_id = pad_id

    def _sharding(self, axes: Logical, shape: Sequence[int]) -> NamedSharding | None:
        """Where an array of ``shape`` laid out as ``axes`` lies on the mesh (None: no mesh)."""
        return None if self.mesh is None else NamedSharding(self.mesh, logical_spec(axes, shape, self.mesh))

    def _put(self, x: np.ndarray) -> Array:
        """Host rows onto the mesh, split by rows where they divide."""
        return jax.device_put(x, self._sharding(row_axes(x.ndim), x.shape))

    def _model(self, state: nnx.State) -> Decoder:
        """The decoder of ``state``, in ``params.compute_dtype`` when set (cast inside the
        compiled functions: the caller's weights stay as they are)."""
        return nnx.merge(self.graphdef, cast_floating(state, self.params.compute_dtype))


class Sampler(SamplerBase):
    """Samples responses from a :class:`Decoder` given as ``(graphdef, state)``, a static
    batch decoded in lockstep until its longest answer ends.

    Args:
      graphdef: ``nnx.split(model)[0]``; the state comes with each call, so a new
        snapshot of the same architecture needs no recompilation.
      params: sampling parameters (static).
      pad_id: id written into padding positions.
      mesh: the ``(data, fsdp, tensor)`` mesh to sample on (a rollout stage's): the
        prompts' rows are split over ``data`` and ``fsdp`` where they divide, the KV cache
        too and its heads over ``tensor``; the weights come placed by the caller
        (``parameter_shardings``). None: the default device.
    """

    def __init__(
        self, graphdef: nnx.GraphDef, params: SamplingParams, pad_id: int = 0, mesh: jax.sharding.Mesh | None = None
    ):
        super().__init__(graphdef, params, pad_id, mesh)
        self._prefill = jax.jit(self._prefill_fn)
        self._decode = jax.jit(self._decode_fn, donate_argnums=(1,))
        # the carry is donated: its cache is rewritten in place, never two caches at once
        self._recompute = jax.jit(self._recompute_fn, donate_argnums=(1,))
        self.last_steps = 0  # decode steps the last generate() ran (early exit included)

    # --- jitted pieces ----------------------------------------------------------------

    def _prefill_fn(self, state, prompt_tokens: Array, prompt_mask: Array) -> DecodeState:
        """A fresh carry for ``prompt_tokens, prompt_mask [B, P]``: the prompts prefilled
        into a cache of P + T slots, nothing sampled yet."""
        model = self._model(state)
        p = self.params
        (b, slots_p), t = prompt_tokens.shape, p.max_new_tokens
        n, k = max(p.num_candidates, 1), max(p.student_topk, 1)
        empty = DecodeState(
            cache=KVCache.empty(model.config, b, slots_p + t, model.compute_dtype),
            next_logits=jnp.zeros((b, model.lm_head_weight().shape[1]), jnp.float32),
            step=jnp.int32(0),
            done=jnp.zeros((b,), bool),
            prompt_tokens=prompt_tokens,
            prompt_mask=prompt_mask,
            prompt_lengths=prompt_mask.sum(axis=1).astype(jnp.int32),
            tokens=jnp.full((b, t), self.pad_id, jnp.int32),
            logp=jnp.zeros((b, t), jnp.float32),
            versions=jnp.zeros((b, t), jnp.int32),
            mask=jnp.zeros((b, t), bool),
            candidate_ids=jnp.zeros((b, t, n), jnp.int32),
            candidate_logp=jnp.zeros((b, t, n), jnp.float32),
            topk_ids=jnp.zeros((b, t, k), jnp.int32),
            topk_logp=jnp.zeros((b, t, k), jnp.float32),
        )
        # chunks no longer than the prompt: a short prompt's prefill computes its P slots, not P + T
        return self._refill(model, constrain_layout(empty), min(p.recompute_chunk, slots_p))

    def _recompute_fn(self, state, carry: DecodeState) -> DecodeState:
        """``carry`` (donated) under new weights ``state``: its cache rewritten in place."""
        return self._refill(self._model(state), carry, self.params.recompute_chunk)

    def _refill(self, model: Decoder, carry: DecodeState, chunk: int) -> DecodeState:
        """``carry`` with its cache rewritten under ``model`` from the tokens written so far
        (slots ``[0, P + step)``, :func:`chunked_prefill`) and the next logits from slot
        ``P + step − 1``, which predicts response token ``step``, in chunks of ``chunk`` slots.
        Slots from ``P + step`` on stay invalid until the decode loop writes them.

        A swap at step s costs a forward over ~P + s slots (rounded up to whole chunks), not
        P + T, in one compiled function whatever s (the trip count is dynamic)."""
        tokens, valid, positions = written_sequence(carry)
        end = carry.prompt_slots + carry.step
        cache, next_logits = chunked_prefill(model, carry.cache, tokens, valid, positions, end, chunk)
        return constrain_layout(dataclasses.replace(carry, cache=cache, next_logits=next_logits))

    def _decode_fn(self, state, carry: DecodeState, key, version, chunk_end) -> DecodeState:
        """Decode until ``chunk_end`` steps are written or every row is done."""
        model = self._model(state)
        p = self.params
        prompt_slots = carry.prompt_slots
        stop_ids = jnp.asarray(p.stop_token_ids or (-1,), jnp.int32)

        def cond(c: DecodeState):
            return (c.step < chunk_end) & ~jnp.all(c.done)

        def body(c: DecodeState) -> DecodeState:
            # Randomness depends only on (key, step): chunking and weight swaps do not
            # change which draws a step gets.
            step_key = jax.random.fold_in(key, c.step)
            logp_all = sampling_logprobs(c.next_logits, p)  # [B, V]
            # The token and the N candidates are N + 1 i.i.d. draws from one inverse CDF:
            # B · (N + 1) uniforms per step instead of B · V Gumbel noises.
            draws, _ = sample_candidates(step_key, logp_all, 1 + p.num_candidates)
            token = draws[:, 0]
            active = ~c.done
            token = jnp.where(active, token, self.pad_id)
            token_logp = jnp.take_along_axis(logp_all, token[:, None], axis=-1)[:, 0]
            t = c.step
            upd = functools.partial(jax.lax.dynamic_update_index_in_dim, index=t, axis=1)
            fields = dict(
                tokens=upd(c.tokens, token),
                logp=upd(c.logp, jnp.where(active, token_logp, 0.0)),
                versions=upd(c.versions, jnp.full_like(token, version)),
                mask=upd(c.mask, active),
            )
            for name, value in side_records(p, c.next_logits, logp_all, draws).items():
                fields[name] = upd(getattr(c, name), value)
            finished = active & (jnp.isin(token, stop_ids) | (t + 1 >= p.max_new_tokens))
            hidden, cache = model.forward(
                token[:, None], (c.prompt_lengths + t)[:, None], active[:, None], c.cache, prompt_slots + t
            )
            new = dataclasses.replace(
                c, cache=cache, next_logits=model.logits(hidden[:, 0]), step=t + 1, done=c.done | finished, **fields
            )
            return constrain_layout(new)

        return jax.lax.while_loop(cond, body, carry)

    # --- host loop --------------------------------------------------------------------

    def generate(
        self,
        state: nnx.State,
        prompts: Sequence[Sequence[int]],
        key: Array,
        *,
        version: int = 0,
        weight_source: WeightSource | None = None,
        prompt_slots: int | None = None,
    ) -> RolloutBatch:
        """Sample one response per prompt.

        Args:
          state: model parameters (``nnx.split(model)[1]``) of policy ``version``, on
            :attr:`mesh` (laid out as the caller likes: ``parameter_shardings``).
          prompts: token id lists (any lengths).
          key: PRNG key; same key, weights and prompts → same responses.
          version: policy version of ``state``, recorded on every token it samples.
          weight_source: polled between chunks of ``params.chunk_steps`` decode steps;
            when it returns ``(new_version, new_state)`` the KV cache is recomputed under
            the new weights and decoding continues with them.
          prompt_slots: pad prompts to this many slots (fixed shapes → no recompiles).

        Returns:
          A :class:`RolloutBatch` (``[B, T]`` with T = ``max_new_tokens``; candidates and
          top-K ids when configured).
        """
        carry = self._run(state, prompts, key, version=version, weight_source=weight_source, prompt_slots=prompt_slots)
        return self._rollout_batch(carry)

    def _rollout_batch(self, carry: DecodeState) -> RolloutBatch:
        """What a finished carry sampled."""
        p = self.params
        return RolloutBatch(
            prompt_tokens=carry.prompt_tokens,
            prompt_mask=carry.prompt_mask,
            response_tokens=carry.tokens,
            response_mask=carry.mask,
            behavior_logp=carry.logp,
            token_version=carry.versions,
            candidate_ids=carry.candidate_ids if p.num_candidates else None,
            candidate_behavior_logp=carry.candidate_logp if p.num_candidates else None,
            student_topk_ids=carry.topk_ids if p.student_topk else None,
            student_topk_behavior_logp=carry.topk_logp if p.student_topk else None,
        )

    def _run(
        self,
        state: nnx.State,
        prompts: Sequence[Sequence[int]],
        key: Array,
        *,
        version: int = 0,
        weight_source: WeightSource | None = None,
        prompt_slots: int | None = None,
    ) -> DecodeState:
        """:meth:`generate`'s loop; returns the last carry (its cache included)."""
        t_max = self.params.max_new_tokens
        ids, mask = left_pad(prompts, self.pad_id, prompt_slots)
        # traced and run under the mesh, so that the layout constraints apply
        with mesh_context(self.mesh):
            carry = self._prefill(state, self._put(ids), self._put(mask))
            step = 0
            while True:
                chunk_end = min(step + self.params.chunk_steps, t_max)
                carry = self._decode(state, carry, key, jnp.int32(version), jnp.int32(chunk_end))
                step = int(carry.step)
                self.last_steps = step
                if step >= t_max or bool(jnp.all(carry.done)):
                    return carry
                update = weight_source(version) if weight_source is not None else None
                if update is not None and update[0] != version:
                    version, state = update
                    carry = self._recompute(state, carry)

    # --- ahead of time ------------------------------------------------------------------

    def lower(self, abstract_state: Any, rows: int, prompt_slots: int) -> dict[str, jax.stages.Lowered]:
        """The sampler's functions lowered (not compiled) for ``rows`` prompts of
        ``prompt_slots`` slots, at weights ``abstract_state`` (``ShapeDtypeStruct``s placed
        on :attr:`mesh` as a rollout stage receives them); nothing is allocated. For
        ``asyncopd plan``: compile them for a topology and read their memory.

        Returns:
          ``"prefill"``; ``"decode"`` (one chunk of decode steps); ``"recompute"`` (the
          cache's rewrite after a weight swap: one program for every step, whose buffers
          are those of its worst case, the whole response written).
        """
        shape = (rows, prompt_slots)
        ids = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self._sharding(row_axes(2), shape))
        mask = jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=self._sharding(row_axes(2), shape))
        scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=self._sharding((), ()))
        key = jax.ShapeDtypeStruct((), jax.eval_shape(jax.random.key, 0).dtype, sharding=self._sharding((), ()))
        with mesh_context(self.mesh):
            carry = jax.tree_util.tree_map_with_path(
                lambda path, x: jax.ShapeDtypeStruct(
                    x.shape, x.dtype, sharding=self._sharding(layout_axes(path, x), x.shape)
                ),
                jax.eval_shape(self._prefill, abstract_state, ids, mask),
            )
            return {
                "prefill": self._prefill.lower(abstract_state, ids, mask),
                "decode": self._decode.lower(abstract_state, carry, key, scalar, scalar),
                "recompute": self._recompute.lower(abstract_state, carry),
            }
