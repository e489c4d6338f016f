"""Parity with the peers (verl, AReaL, Tunix) on identical inputs: our functions against the
peers' definitions as written down in tests/estimators/peer_facts.py (NumPy float64 oracles,
each citing the peer's file and commit). The largest absolute differences are printed
(``-s``) and quoted in docs/estimators.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax import estimators as est
from tests.estimators import peer_facts


def _report(name: str, got, want) -> float:
    diff = float(np.max(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))))
    print(f"\n[parity] {name}: max abs difference {diff:.2e}")
    return diff


def _ragged(seed, rows=8, t=12):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=rows)
    lengths[3] = 0  # an empty row (a dropped sample)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    return rng.normal(size=(rows, t)).astype(np.float32), mask


@pytest.mark.parametrize("mode", est.AGGREGATIONS)
def test_aggregation_modes_reproduce_verl_agg_loss(mode):
    """verl's agg_loss, on one rank and over 2 data-parallel ranks (each given the global
    token / sequence counts, its loss × dp_size then averaged as DDP averages)."""
    values, mask = _ragged(0)
    want = peer_facts.verl_agg_loss(values, mask, mode)
    assert _report(f"agg_loss {mode}", est.aggregate(values, mask, mode), want) < 1e-6
    halves = [slice(0, 4), slice(4, 8)]
    ranks = [
        peer_facts.verl_agg_loss(
            values[h],
            mask[h],
            mode,
            dp_size=2,
            global_tokens=mask.sum(),
            global_sequences=np.count_nonzero(mask.sum(-1) > 0),
        )
        for h in halves
    ]
    assert _report(f"agg_loss {mode}, 2 ranks", est.aggregate(values, mask, mode), np.mean(ranks)) < 1e-6


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("group_size", [1, 4, 8])
def test_group_advantages_reproduce_verl_grpo(group_size, normalize_std):
    rng = np.random.default_rng(group_size)
    rewards = rng.integers(0, 2, size=6 * group_size).astype(np.float32) + rng.normal(scale=0.1, size=6 * group_size)
    rewards = rewards.astype(np.float32)
    t = 5
    token_rewards = np.zeros((len(rewards), t), np.float32)
    token_rewards[:, -1] = rewards  # an outcome reward on the last token
    index = np.repeat(np.arange(len(rewards) // group_size), group_size)
    want = peer_facts.verl_grpo_advantages(
        token_rewards, np.ones((len(rewards), t)), index, normalize_std=normalize_std
    )
    got = est.group_advantages(rewards, group_size, normalize_std=normalize_std)
    assert _report(f"GRPO advantages G={group_size} std={normalize_std}", got, want[:, 0]) < 1e-5


def test_grpo_adds_epsilon_to_the_std_as_verl_does():
    """A group whose rewards spread over about ε = 1e-6, where the place of ε (verl: after the
    square root, σ + ε) moves the advantages by tens of percent; a group of 0/1 rewards beside it."""
    rewards = np.array([0.0, 1e-6, 2e-6, 4e-6, 1.0, 0.0, 1.0, 1.0], np.float32)
    index = np.repeat([0, 1], 4)
    want = peer_facts.verl_grpo_advantages(rewards[:, None], np.ones((8, 1)), index)
    got = est.group_advantages(rewards, 4)
    assert _report("GRPO advantages, a spread of about eps", got, want[:, 0]) < 1e-5


def test_gspo_reproduces_verl_in_value_and_gradient():
    rng = np.random.default_rng(1)
    _, mask = _ragged(1)
    behavior = np.log(rng.uniform(0.05, 0.9, size=mask.shape)).astype(np.float32)
    logp = (behavior + rng.normal(scale=0.02, size=mask.shape)).astype(np.float32)
    adv = np.repeat(rng.normal(size=(mask.shape[0], 1)), mask.shape[1], 1).astype(np.float32)
    want_value, want_grad = peer_facts.verl_gspo(logp, behavior, adv, mask, 0.01, 0.02)
    for level in ("token", "sequence"):

        def ours(x):
            values = est.gspo_loss(x, behavior, adv, mask, clip_eps=(0.01, 0.02), level=level)
            return est.aggregate(values, mask, "seq-mean-token-mean")

        value, grad = jax.value_and_grad(ours)(logp)
        assert _report(f"GSPO ({level}) value", value, want_value) < 1e-6
        assert _report(f"GSPO ({level}) gradient", grad, want_grad) < 1e-6


def test_m2po_masks_the_tokens_areal_masks():
    """AReaL's M2PO mask (δ against the proximal policy: π_θ at a batch's first step) on
    continuous random log-ratios, where its strict '<' and its keep-at-least-one rule cannot
    differ from the paper's '≤' (no tie with the budget, not every token over it)."""
    rng = np.random.default_rng(2)
    masked_some = 0
    for seed in range(20):
        _, mask = _ragged(10 + seed)
        behavior = np.log(rng.uniform(0.05, 0.9, size=mask.shape)).astype(np.float32)
        logp = (behavior + rng.normal(scale=rng.uniform(0.2, 0.6), size=mask.shape)).astype(np.float32)
        want = peer_facts.areal_m2po_mask(behavior, logp, mask, 0.04)
        got = est.m2po_mask(logp, behavior, mask, second_moment_budget=0.04)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(seed))
        masked_some += 0 < int(want.sum()) < mask.sum()
    assert masked_some >= 10


def test_m2po_differs_from_areal_where_the_rules_differ():
    """The two cases the test above avoids: a second moment exactly at the budget (the
    paper's '≤' keeps every token, AReaL's strict '<' keeps one) and every token over the
    budget (we keep none, AReaL keeps the smallest)."""
    mask = np.ones((2, 3), np.float32)
    behavior = np.full(mask.shape, -1.0, np.float32)
    at_budget = behavior + 0.5  # δ² = 0.25 exactly
    assert np.asarray(est.m2po_mask(at_budget, behavior, mask, second_moment_budget=0.25)).all()
    assert peer_facts.areal_m2po_mask(behavior, at_budget, mask, 0.25).sum() == 1
    over = behavior + np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32)
    assert not np.asarray(est.m2po_mask(over, behavior, mask, second_moment_budget=0.04)).any()
    np.testing.assert_array_equal(peer_facts.areal_m2po_mask(behavior, over, mask, 0.04), [[1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_reference_kl_reproduces_verl_kl_penalty(kind):
    rng = np.random.default_rng(3)
    ref = np.log(rng.uniform(0.01, 0.9, size=(4, 9))).astype(np.float32)
    logp = (ref + rng.normal(scale=2.0, size=ref.shape)).astype(np.float32)
    verl_name = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}[kind]
    want = peer_facts.verl_kl_penalty(logp, ref, verl_name)
    assert _report(f"reference_kl {kind}", est.reference_kl(logp, ref, kind), want) < 1e-5


def test_entropy_from_the_fused_pass_reproduces_verl_entropy_from_logits():
    rng = np.random.default_rng(4)
    hidden = rng.normal(size=(2, 6, 16)).astype(np.float32)
    head = (rng.normal(size=(16, 50)) * 0.5).astype(np.float32)
    _, entropy = est.gather_logprobs_and_entropy_from_hidden(hidden, head, np.zeros((2, 6), np.int32), chunk_size=5)
    want = peer_facts.verl_entropy(hidden.astype(np.float64) @ head.astype(np.float64))
    assert _report("entropy", entropy, want) < 1e-5


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_renormalised_top_k_reproduces_tunix_distill_top_k(temperature):
    rng = np.random.default_rng(5)
    student, teacher = (rng.normal(scale=2.0, size=(3, 7, 40)).astype(np.float32) for _ in range(2))
    want = peer_facts.tunix_top_k_distillation(student, teacher, 8, temperature)
    ids = jax.lax.top_k(teacher, 8)[1]  # the teacher's top-K: temperature does not change the order
    per_token = est.forward_kl_topk_renormalized(
        est.gather_logprobs(student, ids, temperature), est.gather_logprobs(teacher, ids, temperature)
    )
    assert _report(f"Tunix distill_top_k T={temperature}", jnp.mean(per_token) * temperature**2, want) < 1e-5
    for tail in (True, False):  # neither tail form is Tunix's
        other = est.forward_kl_topk(
            est.gather_logprobs(student, ids, temperature), est.gather_logprobs(teacher, ids, temperature), tail=tail
        )
        assert abs(float(jnp.mean(other) * temperature**2 - want)) > 1e-3
