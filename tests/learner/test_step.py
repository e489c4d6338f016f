"""The train step: exact under micro-batching, identical sharded and unsharded, losses fall."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from asyncopd_jax.config import ConfigError, EstimatorConfig, MeshConfig, OptimConfig, RunConfig, load_config
from asyncopd_jax.estimator_eval import evaluate_estimator
from asyncopd_jax.estimator_registry import PPOConfig
from asyncopd_jax.learner import (
    LearnerBatch,
    PolicyLoss,
    SFTLoss,
    create_train_state,
    make_mesh,
    make_optimizer,
    make_packed_train_step,
    make_proximal_fn,
    make_train_step,
)
from tests.estimators import oracle
from tests.learner.batches import make_learner_batch
from tests.tiny_models import tiny_decoder


@pytest.fixture(scope="module")
def learner_batch() -> LearnerBatch:
    return make_learner_batch()


def _run(loss, batch, micro_batches=1, mesh=None, steps=1, optimizer=None, token_budget=0, bucket=8):
    # Adam's first step is ≈ lr · sign(g): it magnifies rounding in tiny gradients, so the
    # exactness tests compare plain SGD steps (parameter change = gradient).
    optimizer = optimizer or make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=0, schedule="constant"), 10)
    graphdef, state = create_train_state(tiny_decoder(0, scale=0.7), optimizer, mesh)
    if token_budget:
        step = make_packed_train_step(
            graphdef, optimizer, loss, token_budget=token_budget, bucket=bucket, mesh=mesh, state_example=state
        )
    else:
        step = make_train_step(graphdef, optimizer, loss, micro_batches=micro_batches, mesh=mesh, state_example=state)
    history = []
    for _ in range(steps):
        if getattr(loss, "needs_proximal", False):  # the estimator's spec says
            batch = LearnerBatch(batch.rollout, batch.cache, make_proximal_fn(graphdef, loss)(state.params, batch))
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    return jax.device_get(state), history


def _assert_params_close(a, b, **tol):
    for x, y in zip(jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)):
        np.testing.assert_allclose(x, y, **tol)


# CI time: forward_kl_topk at 4 micro-batches runs in CI's second step (-m extended); the
# aggregation test below splits it into 4 too.
@pytest.mark.parametrize("estimator", ["reverse_kl_mc", pytest.param("forward_kl_topk", marks=pytest.mark.extended)])
def test_micro_batch_split_does_not_change_the_step(learner_batch, estimator):
    loss = PolicyLoss(EstimatorConfig(estimator))
    one, m1 = _run(loss, learner_batch, micro_batches=1, optimizer=optax.sgd(1.0))
    four, m4 = _run(loss, learner_batch, micro_batches=4, optimizer=optax.sgd(1.0))
    _assert_params_close(one, four, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m1[0]["loss"], m4[0]["loss"], rtol=1e-5)
    np.testing.assert_allclose(m1[0]["reverse_kl_signal"], m4[0]["reverse_kl_signal"], rtol=1e-5)
    assert int(one.step) == 1  # the policy version counts optimizer steps


@pytest.mark.parametrize("micro_batches, token_budget", [(4, 0), (1, 40)])
def test_each_metric_combines_over_micro_batches_by_its_reduction(learner_batch, micro_batches, token_budget):
    """Over 4 micro-batches, and over token-budget micro-batches, the step reports the
    whole mini-batch's largest importance ratio (a max: not a sum of the parts' maxima, nor
    their token-weighted mean) and its token-mean ratio (a mean: not the largest part's
    share). The behaviour log-probs are moved off the student's by a per-token amount, so
    that the ratios differ and so do the parts' maxima."""
    import dataclasses

    rollout = learner_batch.rollout
    mask = np.asarray(rollout.response_mask)
    shift = np.random.default_rng(0).normal(scale=0.5, size=mask.shape).astype(np.float32)
    batch = LearnerBatch(dataclasses.replace(rollout, behavior_logp=rollout.behavior_logp + shift), learner_batch.cache)
    loss = PolicyLoss(EstimatorConfig("reverse_kl_mc"))
    token = np.asarray(loss.student(tiny_decoder(0, scale=0.7), batch).token, np.float64)  # _run's start
    ratio = np.exp(token - np.asarray(batch.rollout.behavior_logp, np.float64))
    part_maxima = [ratio[rows][mask[rows]].max() for rows in np.split(np.arange(mask.shape[0]), 4)]
    assert max(part_maxima) > 1.05 * min(part_maxima)  # a mean of the maxima would not be the max
    _, metrics = _run(
        loss, batch, micro_batches=micro_batches, token_budget=token_budget, bucket=8, optimizer=optax.sgd(1.0)
    )
    assert metrics[0].get("micro_batches", micro_batches) > 1
    np.testing.assert_allclose(metrics[0]["importance_ratio_max"], ratio[mask].max(), rtol=1e-5)
    np.testing.assert_allclose(metrics[0]["importance_ratio_mean"], ratio[mask].mean(), rtol=1e-5)


@pytest.mark.parametrize(
    "estimator,budget,bucket,data",
    [
        # CI time: two of the four run with -m slow (each compiles its own steps, ~20 s)
        pytest.param("reverse_kl_hybrid", 24, 2, 1, marks=pytest.mark.slow),
        ("forward_kl_topk", 40, 8, 1),
        pytest.param("decoupled_ppo", 24, 2, 1, marks=pytest.mark.slow),
        # on a data 4 × fsdp 2 mesh: micro-batches of a multiple of 8 rows (CI's second step)
        pytest.param("reverse_kl_hybrid", 120, 4, 4, marks=pytest.mark.extended),
    ],
)
def test_token_budget_micro_batches_do_not_change_the_step(learner_batch, estimator, budget, bucket, data):
    """Dynamic batching (rows sorted by length, trimmed to their own slots, filler rows
    masked out) gives the plain step's parameters and metrics: the token mean stays exact."""
    loss = PolicyLoss(EstimatorConfig(estimator))
    mesh = make_mesh(MeshConfig(data=data, fsdp=2)) if data > 1 else None
    kw = dict(optimizer=optax.sgd(1.0))
    plain, m_plain = _run(loss, learner_batch, **kw)
    packed, m_packed = _run(loss, learner_batch, mesh=mesh, token_budget=budget, bucket=bucket, **kw)
    # atol 1e-6: micro-batches sum the gradient in another order (float32 rounding); a token
    # mean taken per micro-batch instead of over the mini-batch errs by 0.05-0.6 here.
    _assert_params_close(plain, packed, rtol=1e-5, atol=1e-6)
    for key in (
        "loss",
        "reverse_kl_signal",
        "importance_ratio_mean",
        "importance_ratio_max",
        "zero_grad_fraction",
        "grad_norm",
        "tokens",
    ):
        np.testing.assert_allclose(m_plain[0][key], m_packed[0][key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert m_packed[0]["micro_batches"] > (1 if data == 1 else 0) and 0 <= m_packed[0]["padding_fraction"] < 1


@pytest.mark.parametrize(
    "data, fsdp, tensor",
    [(4, 2, 1), pytest.param(2, 1, 4, marks=pytest.mark.extended)],  # tensor: CI's second step
)
def test_sharded_step_equals_single_device(learner_batch, data, fsdp, tensor):
    """FSDP; and tensor parallelism: heads and MLP over 4 devices (the 61-id vocabulary
    does not divide and stays whole), the 8 rows over only 2."""
    assert jax.device_count() == 8, "tests run with 8 virtual CPU devices (see tests/conftest.py)"
    loss = PolicyLoss(EstimatorConfig("reverse_kl_mc"))
    single, ms = _run(loss, learner_batch, steps=2, optimizer=optax.sgd(1.0))
    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
    sharded, mm = _run(loss, learner_batch, mesh=mesh, steps=2, optimizer=optax.sgd(1.0))
    _assert_params_close(single, sharded, rtol=1e-5, atol=1e-7)
    # And with the real optimizer (AdamW + clipping), loosely: its first steps are ≈ sign(g).
    adam_single, _ = _run(loss, learner_batch, steps=2)
    adam_sharded, _ = _run(loss, learner_batch, mesh=mesh, steps=2)
    _assert_params_close(adam_single, adam_sharded, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ms[-1]["loss"], mm[-1]["loss"], rtol=1e-5)


def test_losses_fall(learner_batch):
    for loss, steps in [
        (SFTLoss(), 15),
        (PolicyLoss(EstimatorConfig("reverse_kl_mc")), 15),
        (PolicyLoss(EstimatorConfig("forward_kl_topk")), 15),
    ]:
        _, history = _run(loss, learner_batch, steps=steps)
        first, last = history[0]["loss"], history[-1]["loss"]
        assert last < first - 0.05 * abs(first), (loss, first, last)


def test_decoupled_ppo_step_matches_the_numpy_oracle(learner_batch):
    """Behaviour μ (the rollout's), proximal π_prox and current π_θ all differ: the train
    step's loss is the token mean of the NumPy decoupled-PPO oracle, every branch exercised
    (behaviour weight above and below its cap, ratio clipped and not, dual clip)."""
    rollout, cache = learner_batch.rollout, learner_batch.cache
    loss = PolicyLoss(
        EstimatorConfig("decoupled_ppo", ppo=PPOConfig(clip_eps=0.1, dual_clip=1.5, behavior_weight_cap=1.1))
    )
    graphdef, state = create_train_state(tiny_decoder(0, scale=0.7), optax.sgd(1.0))
    # Move away from the behaviour policy (π_prox), then once more (π_θ).
    drift = make_train_step(graphdef, optax.sgd(3.0), PolicyLoss(EstimatorConfig("forward_kl_topk")))
    state, _ = drift(state, learner_batch)
    proximal = make_proximal_fn(graphdef, loss)(state.params, learner_batch)
    state, _ = drift(state, learner_batch)
    current = loss.student(nnx.merge(graphdef, state.params), learner_batch)
    step = make_train_step(graphdef, optax.sgd(1.0), loss, micro_batches=2)
    _, metrics = step(state, LearnerBatch(rollout, cache, proximal))

    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    mask = np.asarray(rollout.response_mask)
    behavior, prox, logp = f64(rollout.behavior_logp), f64(proximal.token), f64(current.token)
    advantage = f64(cache.token_logp) - behavior  # the stale signal log q − log μ (the default)
    weight = np.exp(prox - behavior)
    per_token = np.where(weight <= 1.1, weight * oracle.ppo_clip(logp, prox, advantage, 0.9, 1.1, 1.5), 0.0)
    np.testing.assert_allclose(float(metrics["loss"]), per_token[mask].mean(), rtol=1e-5)
    ratio = np.exp(logp - prox)[mask]
    capped = (weight > 1.1)[mask]
    assert capped.any() and (~capped).any()
    assert ((ratio < 0.9) | (ratio > 1.1))[~capped].any() and ((ratio >= 0.9) & (ratio <= 1.1))[~capped].any()
    dual = (advantage < 0)[mask] & (-advantage[mask] * ratio > -1.5 * advantage[mask]) & ~capped
    assert dual.any()


def test_mesh_errors():
    with pytest.raises(ValueError, match="does not fit the 8 devices"):
        make_mesh(MeshConfig(data=3, fsdp=3))
    with pytest.raises(ValueError, match="tensor=3 does not fit the 8 devices"):
        make_mesh(MeshConfig(data=-1, fsdp=1, tensor=3))
    assert make_mesh(MeshConfig(data=1, fsdp=1)).devices.size == 1
    assert dict(make_mesh(MeshConfig(data=-1, fsdp=1, tensor=4)).shape) == {"data": 2, "fsdp": 1, "tensor": 4}
    with pytest.raises(ConfigError, match="tensor = 0 is invalid"):
        MeshConfig(tensor=0)


def test_parameters_and_moments_are_fsdp_sharded():
    mesh = make_mesh(MeshConfig(data=4, fsdp=2))
    optimizer = make_optimizer(OptimConfig(), 10)
    _, state = create_train_state(tiny_decoder(0), optimizer, mesh)
    specs = [leaf.sharding.spec for leaf in jax.tree_util.tree_leaves(state) if leaf.ndim == 2]
    assert specs and all("fsdp" in tuple(spec) for spec in specs)  # the embed dimension (32)
    assert all(len(leaf.sharding.device_set) == 8 for leaf in jax.tree_util.tree_leaves(state))


@pytest.mark.parametrize(
    "aggregation", ["seq-mean-token-mean", pytest.param("seq-mean-token-sum-norm", marks=pytest.mark.extended)]
)
def test_aggregation_modes_are_exact_over_micro_batches_and_packing(learner_batch, aggregation):
    """A sequence-level aggregation gives the same step whole, in 4 micro-batches and packed
    into token-budget micro-batches trimmed to their own length; its loss is the oracle's
    aggregate of the per-token values; and it is a different step from the token mean."""
    loss = PolicyLoss(EstimatorConfig("forward_kl_topk", aggregation=aggregation))
    sgd = dict(optimizer=optax.sgd(1.0))
    one, m1 = _run(loss, learner_batch, **sgd)
    four, m4 = _run(loss, learner_batch, micro_batches=4, **sgd)
    packed, mp = _run(loss, learner_batch, token_budget=40, bucket=8, **sgd)
    for other, metrics in ((four, m4), (packed, mp)):
        _assert_params_close(one, other, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(metrics[0]["loss"], m1[0]["loss"], rtol=1e-5)
    assert mp[0]["micro_batches"] > 1
    model = tiny_decoder(0, scale=0.7)
    values, _ = evaluate_estimator(
        EstimatorConfig("forward_kl_topk"),
        learner_batch.rollout,
        learner_batch.cache,
        loss.student(model, learner_batch),
    )
    mask = np.asarray(learner_batch.rollout.response_mask)
    assert len(set(mask.sum(-1).tolist())) > 1  # rows of different lengths: the modes differ
    np.testing.assert_allclose(m1[0]["loss"], oracle.aggregate(np.asarray(values), mask, aggregation), rtol=1e-5)
    token_mean_step, _ = _run(PolicyLoss(EstimatorConfig("forward_kl_topk")), learner_batch, **sgd)
    assert not np.allclose(
        jax.tree_util.tree_leaves(one.params)[0], jax.tree_util.tree_leaves(token_mean_step.params)[0]
    )


@pytest.mark.parametrize("token_budget", [0, pytest.param(40, marks=pytest.mark.extended)])
def test_check_inputs_stops_a_step_fed_raw_logits(learner_batch, token_budget):
    """estimator.check_inputs: the step (plain, and packed into token-budget micro-batches)
    runs the estimator's checkify checks and raises on the host, naming the field; a clean
    batch trains as without the checks."""
    import dataclasses

    loss = PolicyLoss(EstimatorConfig("forward_kl_topk", check_inputs=True))
    kw = dict(optimizer=optax.sgd(1.0), token_budget=token_budget)
    checked, m_checked = _run(loss, learner_batch, **kw)
    plain, m_plain = _run(PolicyLoss(EstimatorConfig("forward_kl_topk")), learner_batch, **kw)
    _assert_params_close(checked, plain, rtol=1e-6, atol=1e-8)
    cache = dataclasses.replace(learner_batch.cache, topk_logp=learner_batch.cache.topk_logp + 3.0)  # logits, say
    with pytest.raises(
        Exception,
        match=r"forward_kl_topk: cache.topk_logp holds values up to .*; expected "
        r"log-probabilities",
    ):
        _run(loss, LearnerBatch(learner_batch.rollout, cache, learner_batch.proximal), **kw)
    assert PolicyLoss.from_config(RunConfig(estimator=EstimatorConfig(check_inputs=True))).check_inputs


def test_the_loss_is_built_from_the_run_config():
    """PolicyLoss.from_config: the estimator section as it is, β from rl.distill_coef, π_θ
    scored at the sampler's temperature, the learner's gather chunk; each a non-default
    value that arrives."""
    from asyncopd_jax.cli import DEMO_CONFIG

    cfg = load_config(
        DEMO_CONFIG,
        [
            "algorithm=rl",
            "estimator.name=decoupled_ppo",
            "rl.samples_per_prompt=8",
            "rl.distill_coef=0.3",
            "sampling.temperature=0.7",
            "learner.logprob_chunk=64",
            "estimator.aggregation=seq-mean-token-mean",
            "estimator.check_inputs=true",
            "learner.remat=layer",
            "learner.compute_dtype=bfloat16",
        ],
    )
    loss = PolicyLoss.from_config(cfg)
    assert (loss.remat, loss.compute_dtype) == ("layer", "bfloat16")
    assert loss.estimator is cfg.estimator
    assert (loss.distill_coef, loss.temperature, loss.chunk_size) == (0.3, 0.7, 64)
    assert loss.aggregation == "seq-mean-token-mean" and loss.check_inputs and loss.needs_proximal
    assert not PolicyLoss(EstimatorConfig("ppo_clip")).needs_proximal
