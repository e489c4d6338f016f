"""The train step on a LoRA student: only the adapters move, the optimizer keeps moments
for them alone, their gradients are those of the merged weight ``W + s·A B``, and the step
is the same micro-batched, packed and sharded; dropout masks differ by step, repeat on a rerun."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from asyncopd_jax.config import ConfigError, EstimatorConfig, MeshConfig, OptimConfig, load_config
from asyncopd_jax.estimators.reductions import loss_denominator
from asyncopd_jax.learner import (
    PolicyLoss,
    create_train_state,
    make_mesh,
    make_optimizer,
    make_packed_train_step,
    make_train_step,
    run_optimizer,
)
from asyncopd_jax.learner.step import loss_model
from asyncopd_jax.models.lora import LoRAParams, join, merge_adapters, split_adapters
from tests.learner.batches import make_learner_batch
from tests.tiny_models import tiny_lora_decoder

PARAMS = LoRAParams(rank=3, alpha=5.0)
LOSS = PolicyLoss(EstimatorConfig("reverse_kl_mc"))


@pytest.fixture(scope="module")
def learner_batch():
    return make_learner_batch()


def _run(
    batch, *, steps=1, optimizer=None, mesh=None, micro_batches=1, token_budget=0, dropout_seed=None, params=PARAMS
):
    optimizer = optimizer or optax.sgd(1.0)
    graphdef, state = create_train_state(tiny_lora_decoder(params), optimizer, mesh)
    if token_budget:
        step = make_packed_train_step(
            graphdef,
            optimizer,
            LOSS,
            token_budget=token_budget,
            mesh=mesh,
            state_example=state,
            dropout_seed=dropout_seed,
        )
    else:
        step = make_train_step(
            graphdef,
            optimizer,
            LOSS,
            micro_batches=micro_batches,
            mesh=mesh,
            state_example=state,
            dropout_seed=dropout_seed,
        )
    for _ in range(steps):
        state, _ = step(state, batch)
    return graphdef, jax.device_get(state)


def _leaves(state: nnx.State) -> dict[str, np.ndarray]:
    return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(state)}


def test_a_lora_step_moves_the_adapters_alone_with_moments_for_them_alone(learner_batch):
    optimizer = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=0, schedule="constant"), 10)
    _, start = nnx.split(tiny_lora_decoder(PARAMS))
    _, state = _run(learner_batch, steps=3, optimizer=optimizer)
    before, after = _leaves(start), _leaves(state.params)
    assert before.keys() == after.keys()
    adapter = {k for k in before if k.endswith(("lora_a", "lora_b"))}
    assert len(adapter) == 28
    for name in before:
        if name in adapter:
            assert np.abs(after[name] - before[name]).max() > 1e-4, name
        else:
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)  # frozen, bit for bit
    moments = sum(x.size for x in jax.tree_util.tree_leaves(state.opt_state) if np.ndim(x))
    assert moments == 2 * sum(before[k].size for k in adapter)  # Adam's μ and ν of the adapters, nothing else


def test_modules_to_save_move_with_the_adapters_and_have_moments_of_their_own(learner_batch):
    """``modules_to_save`` (the embedding, every norm): those weights move with the adapters
    and Adam keeps their moments; every other base weight stays bit for bit."""
    params = LoRAParams(rank=3, alpha=5.0, modules_to_save=("embed_tokens", ".*norm"))
    optimizer = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=0, schedule="constant"), 10)
    _, start = nnx.split(tiny_lora_decoder(params))
    _, state = _run(learner_batch, steps=3, optimizer=optimizer, params=params)
    before, after = _leaves(start), _leaves(state.params)
    trained = {k for k in before if k.endswith(("lora_a", "lora_b", "norm.weight", "embedding"))}
    assert len(trained) == 28 + 1 + 2 * 4 + 1  # adapters, embedding, each layer's four norms, the final norm
    for name in before:
        if name in trained:
            assert np.abs(after[name] - before[name]).max() > 1e-4, name
        else:
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    moments = sum(x.size for x in jax.tree_util.tree_leaves(state.opt_state) if np.ndim(x))
    assert moments == 2 * sum(before[k].size for k in trained)


def first_updates(optimizer: optax.GradientTransformation, params: LoRAParams) -> dict[str, np.ndarray]:
    """``optimizer``'s first update of a LoRA student's trained weights under gradients of
    ones: AdamW's first step is about ``-lr`` everywhere (plus the decay's ``-lr·wd·w``)."""
    trained, _ = split_adapters(nnx.state(tiny_lora_decoder(params)))
    grads = jax.tree_util.tree_map(jnp.ones_like, trained)
    updates, _ = optimizer.update(grads, optimizer.init(trained), trained)
    return _leaves(updates)


def test_loraplus_moves_b_at_its_ratio_and_a_and_the_whole_weights_at_the_rate():
    """``student.lora.loraplus_lr_ratio`` λ, through the run's optimizer: each ``B``'s update
    is λ times plain LoRA's, decay included; ``A``'s and the whole weights' are plain LoRA's."""
    sets = [
        "student.lora.rank=3",
        "student.lora.modules_to_save=[embed_tokens, '.*norm']",
        "optim.learning_rate=0.01",
        "optim.weight_decay=0.1",
        "optim.warmup_steps=0",
    ]
    params = load_config("demo", sets).student.lora
    plain = first_updates(run_optimizer(load_config("demo", sets)), params)
    plus = first_updates(run_optimizer(load_config("demo", [*sets, "student.lora.loraplus_lr_ratio=4"])), params)
    assert {k for k in plain if k.endswith("lora_b")} and {k for k in plain if k.endswith("embedding")}
    for name, update in plain.items():
        ratio = 4 if name.endswith("lora_b") else 1
        assert np.abs(update).min() > 1e-3, name  # every weight moves: the comparison is not of zeros
        np.testing.assert_allclose(plus[name], ratio * update, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("sets", [["student.lora.loraplus_lr_ratio=0"], ["student.lora.loraplus_lr_ratio=2"]])
def test_a_bad_loraplus_ratio_is_one_line_naming_its_field(sets):
    with pytest.raises(ConfigError, match=r"student\.lora\.loraplus_lr_ratio") as err:
        load_config("demo", sets)  # 0, and a ratio for a student without adapters (rank 0)
    assert "\n" not in str(err.value)


def test_lora_gradients_are_those_of_the_merged_weight(learner_batch):
    """The oracle differentiates the loss of the merged model (each ``W' = W + s·A B``
    computed, then a plain projection): by the chain rule ``∂L/∂A = s·X^T (∂L/∂Y) B^T``
    equals ``s·(∂L/∂W') B^T``, a different computation of the same numbers. One SGD step
    of rate 1 moves each adapter by minus its gradient."""
    graphdef, start = nnx.split(tiny_lora_decoder(PARAMS))
    _, state = _run(learner_batch)
    trained, frozen = split_adapters(start)
    denominator = loss_denominator(learner_batch.rollout.response_mask, LOSS.aggregation)

    def merged_loss(t):
        model = merge_adapters(loss_model(graphdef, join(t, frozen), None))
        return LOSS(model, learner_batch, denominator)[0]

    grads = _leaves(jax.grad(merged_loss)(trained))
    moved = _leaves(split_adapters(state.params)[0])
    initial = _leaves(trained)
    assert min(np.abs(g).max() for g in grads.values()) > 1e-5  # A and B both get gradients
    for name, gradient in grads.items():
        np.testing.assert_allclose(initial[name] - moved[name], gradient, rtol=2e-4, atol=2e-7, err_msg=name)


@pytest.mark.parametrize(
    "how",
    [
        {"micro_batches": 4},
        pytest.param({"token_budget": 40}, marks=pytest.mark.extended),  # CI time: the second step
        {"mesh": (4, 2, 1)},
        pytest.param({"mesh": (2, 1, 4)}, marks=pytest.mark.extended),  # tensor parallel: CI's second step
    ],
    ids=["micro_batches", "packed", "fsdp", "tensor"],
)
def test_a_lora_step_is_the_same_micro_batched_packed_and_sharded(learner_batch, how):
    _, want = _run(learner_batch, steps=2)
    kwargs = dict(how)
    if "mesh" in kwargs:
        data, fsdp, tensor = kwargs["mesh"]
        kwargs["mesh"] = make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
    _, got = _run(learner_batch, steps=2, **kwargs)
    for (name, x), y in zip(_leaves(want.params).items(), _leaves(got.params).values()):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.extended  # CI time (~10 s: five steps compiled): the second step
def test_dropout_masks_repeat_on_a_rerun_and_change_with_the_step(learner_batch):
    params = dataclasses.replace(PARAMS, dropout=0.3)
    _, plain = _run(learner_batch, params=params)  # no seed: no dropout
    _, one = _run(learner_batch, params=params, dropout_seed=5)
    _, again = _run(learner_batch, params=params, dropout_seed=5)
    _, other = _run(learner_batch, params=params, dropout_seed=6)
    a, b, c, d = (_leaves(s.params) for s in (plain, one, again, other))
    name = next(k for k in a if k.endswith("lora_b"))
    assert all(np.array_equal(b[k], c[k]) for k in b)  # a rerun draws the same masks
    assert np.abs(b[name] - a[name]).max() > 1e-4 and np.abs(b[name] - d[name]).max() > 1e-4
    # the key folds in the step: the same weights at step 1 draw another mask than at step 0
    optimizer = optax.sgd(1.0)
    graphdef, state = create_train_state(tiny_lora_decoder(params), optimizer)
    step = make_train_step(graphdef, optimizer, LOSS, dropout_seed=5)
    later = dataclasses.replace(state, step=jnp.ones((), jnp.int32))
    first, _ = step(jax.tree_util.tree_map(jnp.copy, state), learner_batch)
    second, _ = step(later, learner_batch)
    assert not np.array_equal(_leaves(first.params)[name], _leaves(second.params)[name])


@pytest.mark.extended  # CI time (~6 s: three steps compiled): the second step
def test_rematerialised_layers_give_a_lora_step_with_dropout_its_plain_update(learner_batch):
    """``learner.remat`` re-runs each layer in the backward pass from its split state: the
    adapters' dropout keys must reach the recomputation, or its masks (and gradients) differ."""
    params = dataclasses.replace(PARAMS, dropout=0.3)
    updates = {}
    for remat in ("none", "layer", "dots"):
        loss = dataclasses.replace(LOSS, remat=remat)
        graphdef, state = create_train_state(tiny_lora_decoder(params), optax.sgd(1.0))
        state, _ = make_train_step(graphdef, optax.sgd(1.0), loss, dropout_seed=5)(state, learner_batch)
        updates[remat] = _leaves(jax.device_get(state.params))
    for remat in ("layer", "dots"):
        for name, value in updates["none"].items():
            np.testing.assert_allclose(updates[remat][name], value, rtol=1e-5, atol=1e-6, err_msg=f"{remat} {name}")
