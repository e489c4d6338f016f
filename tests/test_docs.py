"""The examples of docs/estimators.md run as written and compute what the page says."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from asyncopd_jax import estimators as est

PAGE = Path(__file__).resolve().parents[1] / "docs" / "estimators.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def test_the_train_step_example_trains_on_the_aggregated_top_k_kl():
    B, T, V, K = 3, 5, 17, 4
    rng = np.random.default_rng(0)
    teacher = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(B, T, V)), jnp.float32))
    topk_logp, topk_ids = jax.lax.top_k(teacher, K)
    batch = {"tokens": jnp.asarray(rng.integers(0, V, size=(B, T))), "topk_ids": topk_ids, "topk_logp": topk_logp,
             "mask": jnp.asarray(np.arange(T)[None] < np.array([5, 2, 4])[:, None])}
    namespace = {"my_model": lambda params, tokens: params["w"][tokens], "optimizer": optax.sgd(0.5)}
    exec(EXAMPLES[0], namespace)
    params = {"w": jnp.zeros((V, V))}
    opt_state = namespace["optimizer"].init(params)
    losses = []
    for _ in range(5):
        params, opt_state, loss = namespace["train_step"](params, opt_state, batch)
        losses.append(float(loss))
    want = est.aggregate(est.forward_kl_topk(est.gather_logprobs(jnp.zeros((B, T, V)), topk_ids), topk_logp),
                         batch["mask"], "seq-mean-token-mean")
    assert losses[0] == pytest.approx(float(want), rel=1e-6)
    assert losses[-1] < losses[0]


def test_the_shard_map_example_gives_every_device_the_whole_batch_loss():
    namespace: dict = {}
    exec(EXAMPLES[1], namespace)
    devices = jax.device_count()
    rows, T = 2 * devices, 6
    rng = np.random.default_rng(1)
    behavior = jnp.asarray(np.log(rng.uniform(0.05, 0.9, size=(rows, T))), jnp.float32)
    student = behavior + jnp.asarray(rng.normal(scale=0.3, size=(rows, T)), jnp.float32)
    advantages = jnp.asarray(rng.normal(size=(rows, T)), jnp.float32)
    mask = jnp.asarray(np.arange(T)[None] < rng.integers(1, T + 1, size=rows)[:, None])
    reference = behavior - 0.1
    got = namespace["loss"](student, behavior, advantages, mask, reference)
    whole = est.m2po_loss(student, behavior, advantages, mask) + 0.01 * est.reference_kl(student, reference, "k3")
    np.testing.assert_allclose(got, est.aggregate(whole, mask), rtol=1e-5)
    kept = est.m2po_mask(student, behavior, mask)
    assert 0 < int(kept.sum()) < int(mask.sum())  # the budget bites: a per-device budget would differ
