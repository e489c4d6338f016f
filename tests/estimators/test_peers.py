"""Parity with the peers' own code (verl, AReaL, Tunix) on identical inputs: the largest
absolute differences are printed (``-s``) and quoted in docs/estimators.md.

verl and AReaL are PyTorch (tests/estimators/peers.py holds their functions verbatim);
these tests are skipped where PyTorch is not installed (the oldest-JAX run of CI)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax import estimators as est

# The peers' losses are PyTorch code: the test extra installs torch (CI's main run); only the
# base-install run on the oldest JAX (tools/oldest_jax.sh: JAX and NumPy alone) skips this file.
torch = pytest.importorskip("torch", reason="the peers' losses run on PyTorch (the test extra has it)")
from tests.estimators import peers  # noqa: E402  (needs torch)


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
    """verl's current agg_loss, on one rank and over 2 data-parallel ranks (each given the
    global token / sequence counts, its loss × dp_size then averaged as DDP averages)."""
    values, mask = _ragged(0)
    want = peers.agg_loss(torch.tensor(values), torch.tensor(mask), mode).item()
    assert _report(f"agg_loss {mode}", est.aggregate(values, mask, mode), want) < 1e-6
    halves = [slice(0, 4), slice(4, 8)]
    ranks = [
        peers.agg_loss(
            torch.tensor(values[h]),
            torch.tensor(mask[h]),
            mode,
            dp_size=2,
            batch_num_tokens=mask.sum(),
            global_batch_size=(mask.sum(-1) > 0).sum(),
        ).item()
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
    want, _ = peers.compute_grpo_outcome_advantage(
        torch.tensor(token_rewards), torch.ones(len(rewards), t), index, norm_adv_by_std_in_grpo=normalize_std
    )
    got = est.group_advantages(rewards, group_size, normalize_std=normalize_std)
    assert _report(f"GRPO advantages G={group_size} std={normalize_std}", got, want[:, 0].numpy()) < 1e-5


def test_gspo_reproduces_verl_in_value_and_gradient():
    rng = np.random.default_rng(1)
    _, mask = _ragged(1)
    behavior = np.log(rng.uniform(0.05, 0.9, size=mask.shape)).astype(np.float32)
    logp = (behavior + rng.normal(scale=0.02, size=mask.shape)).astype(np.float32)
    adv = np.repeat(rng.normal(size=(mask.shape[0], 1)), mask.shape[1], 1).astype(np.float32)
    config = peers.actor_config(0.01, 0.02)
    lp = torch.tensor(logp, requires_grad=True)
    loss, _ = peers.compute_policy_loss_gspo(
        torch.tensor(behavior), lp, torch.tensor(adv), torch.tensor(mask), config=config
    )
    loss.backward()
    for level in ("token", "sequence"):

        def ours(x):
            values = est.gspo_loss(x, behavior, adv, mask, clip_eps=(0.01, 0.02), level=level)
            return est.aggregate(values, mask, "seq-mean-token-mean")

        value, grad = jax.value_and_grad(ours)(logp)
        assert _report(f"GSPO ({level}) value", value, loss.item()) < 1e-6
        assert _report(f"GSPO ({level}) gradient", grad, lp.grad.numpy()) < 1e-6


def test_m2po_masks_the_tokens_areal_masks():
    """AReaL's _apply_m2po_masking (δ against the proximal policy: π_θ at a batch's first
    step) on continuous random log-ratios, where its strict '<' and its keep-at-least-one
    rule cannot differ from the paper's '≤' (no tie with the budget, not every token over it)."""
    rng = np.random.default_rng(2)
    masked_some = 0
    for seed in range(20):
        _, mask = _ragged(10 + seed)
        behavior = np.log(rng.uniform(0.05, 0.9, size=mask.shape)).astype(np.float32)
        logp = (behavior + rng.normal(scale=rng.uniform(0.2, 0.6), size=mask.shape)).astype(np.float32)
        want = peers._apply_m2po_masking(torch.tensor(behavior), torch.tensor(logp), torch.tensor(mask).bool(), 0.04)
        got = est.m2po_mask(logp, behavior, mask, second_moment_budget=0.04)
        np.testing.assert_array_equal(np.asarray(got), want.numpy(), err_msg=str(seed))
        masked_some += 0 < int(want.sum()) < mask.sum()
    assert masked_some >= 10


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_reference_kl_reproduces_verl_kl_penalty(kind):
    rng = np.random.default_rng(3)
    ref = np.log(rng.uniform(0.01, 0.9, size=(4, 9))).astype(np.float32)
    logp = (ref + rng.normal(scale=2.0, size=ref.shape)).astype(np.float32)
    want = peers.kl_penalty_forward(torch.tensor(logp), torch.tensor(ref), kind).numpy()
    assert _report(f"reference_kl {kind}", est.reference_kl(logp, ref, kind), want) < 1e-5


def test_entropy_from_the_fused_pass_reproduces_verl_entropy_from_logits():
    rng = np.random.default_rng(4)
    hidden = rng.normal(size=(2, 6, 16)).astype(np.float32)
    head = (rng.normal(size=(16, 50)) * 0.5).astype(np.float32)
    _, entropy = est.gather_logprobs_and_entropy_from_hidden(hidden, head, np.zeros((2, 6), np.int32), chunk_size=5)
    want = peers.entropy_from_logits(torch.tensor(hidden @ head)).numpy()
    assert _report("entropy", entropy, want) < 1e-5


def _tunix_top_k_distillation(student_logits, teacher_logits, top_k, temperature):
    """The distillation term of Tunix's LogitStrategy.compute_loss with distill_top_k
    (tunix/distillation/strategies/logit.py, alpha = 1), transcribed line by line: optax's
    kl_divergence(log_predictions, targets) = Σ targets · (log targets − log_predictions)."""
    s_logits = student_logits.astype(jnp.float32)
    t_logits = teacher_logits.astype(jnp.float32)
    t_logits_k, top_k_indices = jax.lax.top_k(t_logits, top_k)
    s_logits_k = jnp.take_along_axis(s_logits, top_k_indices, axis=-1)
    log_student_probs_temp = jax.nn.log_softmax(s_logits_k / temperature, axis=-1)
    teacher_probs_temp = jax.nn.softmax(t_logits_k / temperature, axis=-1)
    kl_loss = jnp.sum(teacher_probs_temp * (jnp.log(teacher_probs_temp) - log_student_probs_temp), axis=-1)
    return jnp.mean(kl_loss * temperature**2)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_renormalised_top_k_reproduces_tunix_distill_top_k(temperature):
    rng = np.random.default_rng(5)
    student, teacher = (rng.normal(scale=2.0, size=(3, 7, 40)).astype(np.float32) for _ in range(2))
    want = _tunix_top_k_distillation(student, teacher, 8, temperature)
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
