"""The sampler on a (data, fsdp, tensor) mesh, in bf16, and its in-place KV-cache recompute.

The sharded sampler must sample exactly what one device samples (same key, same weights,
same weight swaps); the recompute after a swap must give what a one-shot prefill of the
written prefix into a new cache gave (the implementation it replaced, kept here as the
oracle) while holding one cache, not two.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from asyncopd_jax.cache import RolloutBatch
from asyncopd_jax.config import MeshConfig
from asyncopd_jax.learner.sharding import make_mesh
from asyncopd_jax.models.config import DecoderConfig
from asyncopd_jax.models.decoder import KVCache, abstract_decoder
from asyncopd_jax.models.partitioning import parameter_shardings
from asyncopd_jax.sampling import DecodeState, Sampler, SamplingParams, prompt_keys, run_stream
from tests.tiny_models import tiny_config, tiny_decoder

# 8 rows divide every mesh's data × fsdp below; P = 5 prompt slots, T = 10: C = 15 cache slots
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12], [13, 14, 15], [16], [17, 18], [19, 20, 21, 22], [23]]
PROMPT_SLOTS = 5
# Swaps after steps 3, 6 and 9 rewrite P + step = 8, 11 and 14 slots in chunks of 4: the
# last of those chunks reaches past C = 15 and is moved back to slots 11..14.
PARAMS = SamplingParams(
    temperature=1.0, max_new_tokens=10, num_candidates=3, student_topk=4, chunk_steps=3, recompute_chunk=4
)
RECORDS = ["behavior_logp", "candidate_behavior_logp", "student_topk_behavior_logp"]
IDS = ["response_tokens", "response_mask", "token_version", "candidate_ids", "student_topk_ids"]


def _states() -> list[nnx.State]:
    """Two policies (vocabulary 64: it divides a 4-way tensor axis), swapped in turn."""
    return [nnx.split(tiny_decoder(seed, vocab=64))[1] for seed in (0, 1)]


def _swapping(states: list[nnx.State]):
    """A weight source that swaps in the other policy at every check, up to version 3."""
    return lambda version: (version + 1, states[(version + 1) % 2]) if version < 3 else None


def _run(sampler: Sampler, states: list[nnx.State], swapping: bool = True) -> tuple[DecodeState, RolloutBatch]:
    """The prompts through a stream of ``sampler`` (swapping weights at every check): its
    last carry (the cache included) and the batch."""
    stream = sampler.open_stream(states[0], version=0, prompt_slots=PROMPT_SLOTS)
    stream.submit(None, PROMPTS, prompt_keys(jax.random.key(3), len(PROMPTS)))
    ((_, batch),) = run_stream(stream, _swapping(states) if swapping else None)
    assert stream.carry is not None
    return stream.carry, batch


def _batch(sampler: Sampler, states: list[nnx.State]) -> RolloutBatch:
    return _run(sampler, states)[1]


def assert_same_samples(got, want) -> None:
    """Same ids exactly, same log-probs to 1e-5."""
    for field in IDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), err_msg=field)
    for field in RECORDS:
        np.testing.assert_allclose(
            np.asarray(getattr(got, field)), np.asarray(getattr(want, field)), rtol=1e-5, atol=1e-5, err_msg=field
        )


@functools.cache
def _single_device():
    graphdef = nnx.split(tiny_decoder(0, vocab=64))[0]
    return jax.device_get(_batch(Sampler(graphdef, PARAMS), _states()))


# (mesh, rows' split, KV heads' split, weights replicated): the tiny decoder has 2 KV heads,
# which a 4-way tensor axis does not divide (the cache's heads stay whole there), a 2-way
# one does; weights that arrive whole on every device still give a cache laid out by the rules
MESHES = {
    "data2-tensor4": (MeshConfig(data=2, fsdp=1, tensor=4), 2, 1, False),
    "data4-fsdp2": (MeshConfig(data=4, fsdp=2, tensor=1), 8, 1, False),
    "data2-fsdp2-tensor2": (MeshConfig(data=2, fsdp=2, tensor=2), 4, 2, False),
    "data2-fsdp2-tensor2-replicated-weights": (MeshConfig(data=2, fsdp=2, tensor=2), 4, 2, True),
}


# data4-fsdp2 in CI's extended step: the fsdp split is checked in the fast suite by data2-fsdp2-tensor2
@pytest.mark.parametrize(
    "mesh_cfg,rows_split,heads_split,replicated",
    [pytest.param(*v, id=k, marks=[pytest.mark.extended] * (k == "data4-fsdp2")) for k, v in MESHES.items()],
)
def test_a_sampler_on_a_mesh_samples_what_one_device_samples(mesh_cfg, rows_split, heads_split, replicated):
    mesh = make_mesh(mesh_cfg)
    graphdef = nnx.split(tiny_decoder(0, vocab=64))[0]
    states = [
        jax.device_put(s, NamedSharding(mesh, PartitionSpec()) if replicated else parameter_shardings(s, mesh))
        for s in _states()
    ]
    if mesh_cfg.tensor > 1 and not replicated:  # the weights arrive split as a rollout stage receives them
        assert any("tensor" in str(x.sharding.spec) for x in jax.tree_util.tree_leaves(states[0]))
    sampler = Sampler(graphdef, PARAMS, mesh=mesh)
    carry, batch = _run(sampler, states)
    assert int(carry.step) == PARAMS.max_new_tokens
    np.testing.assert_array_equal(carry.records.versions[0], [0] * 3 + [1] * 3 + [2] * 3 + [3])

    # the cache lies over the mesh: rows over (data, fsdp), KV heads over tensor
    b, n_kv, c, d = carry.cache.keys[0].shape
    for x in carry.cache.keys + carry.cache.values:
        assert x.sharding.shard_shape(x.shape) == (b // rows_split, n_kv // heads_split, c, d), x.sharding
    assert carry.cache.valid.sharding.shard_shape((b, c)) == (b // rows_split, c)
    tokens = carry.records.tokens
    assert tokens.sharding.shard_shape(tokens.shape) == (b // rows_split, PARAMS.max_new_tokens)

    assert_same_samples(batch, _single_device())


def test_bfloat16_sampling_of_an_fp32_student():
    """compute_dtype=bfloat16: a bf16 forward and KV cache over fp32 weights (which the
    caller keeps), fp32 behaviour log-probs close to the fp32 sampler's."""
    graphdef, state = nnx.split(tiny_decoder(0, vocab=64))
    params = dataclasses.replace(PARAMS, compute_dtype="bfloat16")
    carry, _ = _run(Sampler(graphdef, params), [state, state])  # swaps included: the recompute in bf16 too
    records = carry.records
    assert {x.dtype for x in carry.cache.keys + carry.cache.values} == {jnp.dtype(jnp.bfloat16)}
    assert records.logp.dtype == records.candidate_logp.dtype == carry.next_logits.dtype == jnp.float32
    assert {x.dtype for x in jax.tree_util.tree_leaves(state)} == {jnp.dtype(jnp.float32)}
    assert np.asarray(records.response_mask()).all()

    fp32 = _run(Sampler(graphdef, PARAMS), [state, state])[0].records
    # where every token so far agrees, both record the same model's distribution
    agree = np.cumprod(np.asarray(records.tokens) == np.asarray(fp32.tokens), axis=1).astype(bool)
    assert agree.sum() >= 20, agree.sum()
    bf16_logp, fp32_logp = np.asarray(records.logp)[agree], np.asarray(fp32.logp)[agree]
    np.testing.assert_allclose(bf16_logp, fp32_logp, atol=0.05)
    assert np.abs(bf16_logp - fp32_logp).max() > 1e-4  # sampled in bf16 indeed


class OneShotRecompute(Sampler):
    """The oracle: the recompute as it was before it became in place, a prefill of the
    written prefix (rounded up to a power of two of response slots) in one forward into a
    new cache, the carry's still alive."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._one_shot = jax.jit(self._one_shot_fn, static_argnames=("width",))
        self.recompute = self._one_shot_recompute

    def _one_shot_fn(self, state, carry: DecodeState, *, width: int) -> DecodeState:
        model = self._model(state)
        tokens = jnp.concatenate([carry.prompt_tokens, carry.records.tokens[:, :width]], axis=1)
        valid = jnp.concatenate([carry.prompt_mask, carry.records.response_mask()[:, :width]], axis=1)
        prompt_positions = jnp.maximum(jnp.cumsum(carry.prompt_mask, axis=1) - 1, 0)
        positions = jnp.concatenate([prompt_positions, carry.prompt_lengths[:, None] + jnp.arange(width)], axis=1)
        cache = KVCache.empty(model.config, tokens.shape[0], carry.cache.slots, model.compute_dtype)
        hidden, cache = model.forward(tokens, positions, valid, cache, 0)
        last = jax.lax.dynamic_index_in_dim(hidden, carry.prompt_slots + carry.step - 1, axis=1, keepdims=False)
        return dataclasses.replace(carry, cache=cache, next_logits=model.logits(last))

    def _one_shot_recompute(self, state, carry: DecodeState) -> DecodeState:
        step = int(carry.step)
        width = min(carry.records.tokens.shape[1], 1 << max(step - 1, 0).bit_length())
        return self._one_shot(state, carry, width=width)


def test_the_in_place_recompute_equals_the_one_shot_prefill():
    graphdef = nnx.split(tiny_decoder(0, vocab=64))[0]
    states = _states()
    assert_same_samples(_batch(Sampler(graphdef, PARAMS), states), _batch(OneShotRecompute(graphdef, PARAMS), states))

    # the carry handed to the recompute is donated: its cache's buffers are the new cache's
    sampler = Sampler(graphdef, PARAMS)
    carry, _ = _run(sampler, states, swapping=False)
    sampler.recompute(states[1], carry)
    assert all(x.is_deleted() for x in carry.cache.keys + carry.cache.values)


def cache_bytes(config: DecoderConfig, rows: int, slots: int, dtype) -> int:
    """Bytes of one KV cache's keys and values (all layers)."""
    cache = jax.eval_shape(lambda: KVCache.empty(config, rows, slots, jnp.dtype(dtype)))
    return sum(x.size * x.dtype.itemsize for x in cache.keys + cache.values)


def test_the_recompute_holds_one_kv_cache():
    """XLA:CPU's buffers for the recompute of 8 rows × (64 + 960) slots, 4 layers: the
    donated cache is the output's, and the temporaries hold less than one cache (the
    one-shot prefill's hold a second cache, and [B, N_q, C, C] scores)."""
    config = dataclasses.replace(tiny_config(vocab=64), num_hidden_layers=4)
    graphdef, abstract = abstract_decoder(config, "float32")
    rows, prompt_slots, params = 8, 64, SamplingParams(max_new_tokens=960, recompute_chunk=2)
    cache = cache_bytes(config, rows, prompt_slots + params.max_new_tokens, "float32")
    memory = Sampler(graphdef, params).lower(abstract, rows, prompt_slots)["recompute"].compile().memory_analysis()
    assert memory.alias_size_in_bytes >= cache, (memory.alias_size_in_bytes, cache)
    assert memory.temp_size_in_bytes < cache, (memory.temp_size_in_bytes, cache)

    # the same checks fail on the oracle, at its worst case: they see a second cache
    oracle = OneShotRecompute(graphdef, params)
    carry = jax.eval_shape(
        oracle.prefill,
        abstract,
        jax.ShapeDtypeStruct((rows, prompt_slots), jnp.int32),
        jax.ShapeDtypeStruct((rows, prompt_slots), jnp.bool_),
        jax.eval_shape(lambda: jax.random.split(jax.random.key(0), rows)),
    )
    one_shot = oracle._one_shot.lower(abstract, carry, width=params.max_new_tokens).compile().memory_analysis()
    assert not (one_shot.alias_size_in_bytes >= cache and one_shot.temp_size_in_bytes < cache)
