"""Paged attention: the reference equals upstream's reference of the TPU kernel on the same
pages (the convention the kernel computes), and dense causal attention on the same tokens."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

from asyncopd_jax.models.paged_attention import PagedWrite, interleave, paged_attention, pool_shape

S, Q, N_Q, N_KV, D, PAGES, PAGE = 3, 4, 4, 2, 16, 20, 4


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    table = jnp.asarray([[3, 7, 1, 12, 19], [0, 2, 5, 8, 9], [11, 4, 6, 13, 14]], jnp.int32)
    # sequence 0 continues after 5 tokens, 1 starts empty and writes 2, 2 decodes 1 after 17
    where = PagedWrite(table, jnp.asarray([5, 0, 15], jnp.int32), jnp.asarray([4, 2, 1], jnp.int32))
    q = jnp.asarray(rng.normal(size=(S, Q, N_Q, D)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(S, Q, N_KV, D)), jnp.float32) for _ in range(2))
    pages = jnp.asarray(rng.normal(size=pool_shape("reference", PAGES, PAGE, N_KV, D)), jnp.float32)
    return q, k, v, pages, where


def _real(where: PagedWrite) -> np.ndarray:
    """``[S, Q]``: the query rows a call really has (the rest are padding)."""
    return np.arange(Q)[None] < np.asarray(where.count)[:, None]


def test_the_reference_equals_the_ragged_kernels_own_reference():
    q, k, v, pages, where = _inputs()
    out, written = paged_attention(q, k, v, pages, where, implementation="reference")
    # the same pool in the kernel's layout: [pages, page, 2·N_kv, D], keys at even heads
    combined = interleave(jnp.moveaxis(written[0], 2, 1), jnp.moveaxis(written[1], 2, 1))
    want = ref_ragged_paged_attention(
        q.reshape(S * Q, N_Q, D),
        combined,
        where.start + Q,
        where.page_table,
        jnp.arange(S + 1, dtype=jnp.int32) * Q,
        jnp.asarray([S], jnp.int32),
        sm_scale=D**-0.5,
    ).reshape(S, Q, N_Q, D)
    real = _real(where)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(want)[real], atol=1e-5)


def test_the_reference_is_causal_attention_over_each_sequences_tokens():
    """Written through the pages, each sequence's tokens give what plain softmax attention
    over its own tokens ``0 .. start + i`` gives (a NumPy oracle), and padding rows write
    nothing."""
    q, k, v, pages, where = _inputs(1)
    out, written = paged_attention(q, k, v, pages, where)
    table, start, count = (np.asarray(x) for x in (where.page_table, where.start, where.count))
    keys = np.asarray(written[0]).transpose(0, 2, 1, 3)  # [pages, page, N_kv, D]
    values = np.asarray(written[1]).transpose(0, 2, 1, 3)
    for s in range(S):
        seq_k = keys[table[s]].reshape(-1, N_KV, D)
        seq_v = values[table[s]].reshape(-1, N_KV, D)
        np.testing.assert_array_equal(seq_k[start[s] : start[s] + count[s]], np.asarray(k[s, : count[s]]))
        for i in range(count[s]):
            n = start[s] + i + 1
            for h in range(N_Q):
                g = h // (N_Q // N_KV)
                scores = seq_k[:n, g] @ np.asarray(q[s, i, h]) / np.sqrt(D)
                p = np.exp(scores - scores.max())
                np.testing.assert_allclose(out[s, i, h], (p / p.sum()) @ seq_v[:n, g], atol=1e-5)
    # pages no sequence writes are untouched (the padding rows' writes are dropped)
    touched = {int(table[s, (start[s] + i) // PAGE]) for s in range(S) for i in range(count[s])}
    for page in set(range(PAGES)) - touched:
        np.testing.assert_array_equal(np.asarray(written[:, page]), np.asarray(pages[:, page]))
