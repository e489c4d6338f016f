"""A jitted prefill + decode sampler over a KV cache, interruptible between chunks.

Layout of one generation (B prompts, P prompt slots, T = max_new_tokens):

    cache slot:  0 ........ P−1 | P ........ P+T−1
    content:     left-padded      response token t sits in slot P + t
                 prompts

Row b's prompt has ``len_b`` real tokens at RoPE positions ``0..len_b−1``; its response
token t has position ``len_b + t``. Decoding runs in a ``lax.while_loop`` that stops at
the end of a chunk of ``chunk_steps`` steps or as soon as every row has finished; between
chunks the host may swap in newer weights, after which the whole cache is recomputed
under them (one prefill over the P + t slots written so far) and decoding resumes, so a
response can span several policy versions, recorded per token.

Per response token the sampler records: the token; its behaviour log-prob under the
distribution actually sampled from; the policy version that sampled it; N Monte-Carlo
candidates drawn from the same distribution in the same step, with their log-probs; and
optionally the sampling student's top-K ids with their behaviour log-probs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.estimators import sample_candidates
from asyncopd_jax.models.decoder import Decoder, KVCache
from asyncopd_jax.sampling.distribution import SamplingParams, sampling_logprobs

Array = jax.Array

# Called between decode chunks with the version in use; returns (version, state) of
# newer weights to swap in, or None to keep going.
WeightSource = Callable[[int], "tuple[int, nnx.State] | None"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything the decode loop carries (donated between chunks)."""

    cache: KVCache
    next_logits: Array  # [B, V] distribution of the token to sample at `step`
    step: Array  # scalar int32: response tokens written so far
    done: Array  # [B] bool
    tokens: Array  # [B, T] int32
    logp: Array  # [B, T] fp32 behaviour log-probs
    versions: Array  # [B, T] int32
    mask: Array  # [B, T] bool
    candidate_ids: Array  # [B, T, N] int32
    candidate_logp: Array  # [B, T, N] fp32
    topk_ids: Array  # [B, T, K] int32
    topk_logp: Array  # [B, T, K] fp32 behaviour log-probs of topk_ids
    prompt_lengths: Array  # [B] int32


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


class Sampler:
    """Samples responses from a :class:`Decoder` given as ``(graphdef, state)``.

    Args:
      graphdef: ``nnx.split(model)[0]``; the state comes with each call, so a new
        snapshot of the same architecture needs no recompilation.
      params: sampling parameters (static).
      pad_id: id written into padding positions.
      mesh: the devices to sample on (a rollout stage's): the prompts' rows are split over
        its first axis when they divide (the weights come placed by the caller); None: the
        default device.
    """

    def __init__(
        self, graphdef: nnx.GraphDef, params: SamplingParams, pad_id: int = 0, mesh: jax.sharding.Mesh | None = None
    ):
        self.graphdef = graphdef
        self.mesh = mesh
        self.params = params
        self.pad_id = pad_id
        self._prefill = jax.jit(self._prefill_fn, static_argnames=("slots",))
        self._decode = jax.jit(self._decode_fn, donate_argnums=(1,))
        self.last_steps = 0  # decode steps the last generate() ran (early exit included)

    def _put(self, x: np.ndarray) -> Array:
        """A host array of prompts' rows onto the mesh, split by rows where they divide (the
        batch-parallel decode then follows from the inputs' shardings)."""
        if self.mesh is None:
            return jnp.asarray(x)
        axis = self.mesh.axis_names[0]
        rows_split = x.shape[0] % self.mesh.shape[axis] == 0
        return jax.device_put(x, NamedSharding(self.mesh, PartitionSpec(axis) if rows_split else PartitionSpec()))

    # --- jitted pieces ----------------------------------------------------------------

    def _prefill_fn(self, state, tokens, valid, positions, last_slot, *, slots: int):
        """Write ``tokens [B, S]`` into an empty cache of ``slots``; logits ``[B, V]`` at ``last_slot``."""
        model: Decoder = nnx.merge(self.graphdef, state)
        cache = KVCache.empty(model.config, tokens.shape[0], slots, model.dtype)
        hidden, cache = model.forward(tokens, positions, valid, cache, 0)
        last = jax.lax.dynamic_index_in_dim(hidden, last_slot, axis=1, keepdims=False)
        return cache, model.logits(last)

    def _decode_fn(self, state, carry: DecodeState, key, version, chunk_end):
        """Decode until ``chunk_end`` steps are written or every row is done."""
        model: Decoder = nnx.merge(self.graphdef, state)
        p = self.params
        prompt_slots = carry.cache.slots - carry.tokens.shape[1]
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
            if p.num_candidates:
                cand = draws[:, 1:]
                fields["candidate_ids"] = upd(c.candidate_ids, cand)
                fields["candidate_logp"] = upd(c.candidate_logp, jnp.take_along_axis(logp_all, cand, axis=-1))
            if p.student_topk:
                topk = jax.lax.top_k(c.next_logits, p.student_topk)[1].astype(jnp.int32)
                fields["topk_ids"] = upd(c.topk_ids, topk)
                fields["topk_logp"] = upd(c.topk_logp, jnp.take_along_axis(logp_all, topk, axis=-1))
            finished = active & (jnp.isin(token, stop_ids) | (t + 1 >= p.max_new_tokens))
            hidden, cache = model.forward(
                token[:, None], (c.prompt_lengths + t)[:, None], active[:, None], c.cache, prompt_slots + t
            )
            return dataclasses.replace(
                c, cache=cache, next_logits=model.logits(hidden[:, 0]), step=t + 1, done=c.done | finished, **fields
            )

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
          state: model parameters (``nnx.split(model)[1]``) of policy ``version``.
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
        p = self.params
        ids, mask = left_pad(prompts, self.pad_id, prompt_slots)
        b, slots_p = ids.shape
        t_max = p.max_new_tokens
        prompt_lengths = mask.sum(axis=1).astype(np.int32)
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
        cache, next_logits = self._prefill(
            state,
            self._put(ids),
            self._put(mask),
            self._put(positions),
            jnp.int32(slots_p - 1),
            slots=slots_p + t_max,
        )
        n, k = max(p.num_candidates, 1), max(p.student_topk, 1)
        carry = DecodeState(
            cache=cache,
            next_logits=next_logits,
            step=jnp.int32(0),
            done=jnp.zeros((b,), bool),
            tokens=jnp.full((b, t_max), self.pad_id, jnp.int32),
            logp=jnp.zeros((b, t_max), jnp.float32),
            versions=jnp.zeros((b, t_max), jnp.int32),
            mask=jnp.zeros((b, t_max), bool),
            candidate_ids=jnp.zeros((b, t_max, n), jnp.int32),
            candidate_logp=jnp.zeros((b, t_max, n), jnp.float32),
            topk_ids=jnp.zeros((b, t_max, k), jnp.int32),
            topk_logp=jnp.zeros((b, t_max, k), jnp.float32),
            prompt_lengths=self._put(prompt_lengths),
        )
        step = 0
        while True:
            chunk_end = min(step + p.chunk_steps, t_max)
            carry = self._decode(state, carry, key, jnp.int32(version), jnp.int32(chunk_end))
            step = int(carry.step)
            self.last_steps = step
            if step >= t_max or bool(jnp.all(carry.done)):
                break
            update = weight_source(version) if weight_source is not None else None
            if update is not None and update[0] != version:
                version, state = update
                carry = self._recompute_cache(state, carry, ids, mask, positions, step)
        return RolloutBatch(
            prompt_tokens=self._put(ids),
            prompt_mask=self._put(mask),
            response_tokens=carry.tokens,
            response_mask=carry.mask,
            behavior_logp=carry.logp,
            token_version=carry.versions,
            candidate_ids=carry.candidate_ids if p.num_candidates else None,
            candidate_behavior_logp=carry.candidate_logp if p.num_candidates else None,
            student_topk_ids=carry.topk_ids if p.student_topk else None,
            student_topk_behavior_logp=carry.topk_logp if p.student_topk else None,
        )

    def _recompute_cache(self, state, carry: DecodeState, ids, mask, positions, step: int) -> DecodeState:
        """Rebuild the KV cache (and next logits) under new weights from the tokens so far.

        Only the written prefix is recomputed, rounded up to a power of two of response
        slots (≤ log₂T + 1 compiled shapes): a swap at step s costs a forward pass over
        P + ~s tokens, not P + T. The cache keeps all P + T slots; those from ``step`` on
        are invalid until the decode loop writes them.
        """
        t_max = carry.tokens.shape[1]
        width = min(t_max, 1 << max(step - 1, 0).bit_length())  # smallest power of two >= step
        tokens = jnp.concatenate([self._put(ids), carry.tokens[:, :width]], axis=1)
        # carry.mask is True only on tokens already sampled: slots from ``step`` on are invalid
        valid = jnp.concatenate([self._put(mask), carry.mask[:, :width]], axis=1)
        resp_pos = carry.prompt_lengths[:, None] + jnp.arange(width)[None]
        all_pos = jnp.concatenate([self._put(positions), resp_pos], axis=1)
        # The last written slot, P + step − 1, predicts the next token.
        cache, next_logits = self._prefill(
            state, tokens, valid, all_pos, jnp.int32(ids.shape[1] + step - 1), slots=ids.shape[1] + t_max
        )
        return dataclasses.replace(carry, cache=cache, next_logits=next_logits)
