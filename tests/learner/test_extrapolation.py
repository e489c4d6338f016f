"""EffOPD extrapolation: accepted where it must help, rolled back exactly where it must hurt,
only attention and MLP weights moved, anchors and schedule as specified."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asyncopd_jax.learner.extrapolation import (
    Extrapolator,
    extrapolate,
    is_checkpoint_step,
    is_movable,
    search,
)
from asyncopd_jax.tasks.builtin import new_model


def _params(seed: int = 0):
    return nnx.split(new_model("student", seed), nnx.Param)[1]


def _toward(target, params):
    """A probe that rewards closeness of the movable weights to ``target``."""

    def score(p):
        leaves = jax.tree_util.tree_leaves_with_path(p)
        goal = dict((jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_leaves_with_path(target))
        return -sum(float(jnp.sum((v - goal[jax.tree_util.keystr(k)]) ** 2)) for k, v in leaves if is_movable(k))

    return score


def test_extrapolation_is_accepted_where_the_direction_keeps_improving():
    anchor = _params(0)
    target = extrapolate(anchor, _params(1), 6.5)  # the optimum lies 6.5 D from the anchor
    current = extrapolate(anchor, _params(1), 1.0)
    best, jump = search(anchor, current, _toward(target, anchor), step=4)
    # 3, 5 and 7 D come closer (distances 3.5, 1.5, 0.5), 9 D overshoots (2.5): keep 7 D
    assert jump.accepted and jump.accepted_factor == 7
    assert [f for f, _ in jump.tried] == [3, 5, 7, 9]
    scores = [jump.base_score, *(s for _, s in jump.tried)]
    assert scores[0] < scores[1] < scores[2] < scores[3] > scores[4]
    np.testing.assert_allclose(jax.tree.leaves(best)[2], jax.tree.leaves(extrapolate(anchor, current, 7))[2])


def test_extrapolation_that_hurts_is_rolled_back_to_the_exact_weights():
    anchor, current = _params(0), _params(1)
    # the optimum is the current point itself: every candidate is worse
    best, jump = search(anchor, current, _toward(current, anchor), step=2)
    assert not jump.accepted and jump.accepted_factor == 1 and len(jump.tried) == 1
    for got, want in zip(jax.tree.leaves(best), jax.tree.leaves(current)):
        assert got is want  # the very arrays of θ_t, bit for bit
    # a tie is not an improvement (accuracy probes tie often): the first candidate ends the search
    best, tie = search(anchor, current, lambda p: 0.5)
    assert not tie.accepted and len(tie.tried) == 1 and best is current
    # a probe that returns NaN never counts as an improvement
    _, nan_jump = search(anchor, current, lambda p: float("nan") if p is not current else 0.0)
    assert not nan_jump.accepted


def test_only_attention_and_mlp_weights_move():
    anchor, current = _params(0), _params(1)
    moved = extrapolate(anchor, current, 3.0)
    names_moved, names_kept = set(), set()
    for (path, a), c, m in zip(
        jax.tree_util.tree_leaves_with_path(anchor), jax.tree.leaves(current), jax.tree.leaves(moved)
    ):
        name = jax.tree_util.keystr(path)
        if np.array_equal(np.asarray(m), np.asarray(c)):
            names_kept.add(name)
        else:
            np.testing.assert_allclose(m, a + 3 * (c - a), rtol=1e-5, atol=1e-6)
            names_moved.add(name)
    assert all(("self_attn" in n and "_proj" in n) or "mlp" in n for n in names_moved) and len(names_moved) == 14
    assert {
        n for n in names_kept if "embed" in n or n.startswith("['norm']") or "layernorm" in n or "_norm" in n
    } == names_kept


def test_bf16_weights_are_extrapolated_in_fp32():
    anchor = {"mlp": {"up_proj": jnp.full((4,), 1.0, jnp.bfloat16)}}
    current = {"mlp": {"up_proj": jnp.full((4,), 1.8515625, jnp.bfloat16)}}
    out = extrapolate(anchor, current, 9.0)["mlp"]["up_proj"]
    # 1 + 9 · 0.8515625 = 8.6640625 → 8.6875 in bf16; rounding 9 · D to bf16 first would give 8.625
    assert out.dtype == jnp.bfloat16 and float(out[0]) == 8.6875


def _equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def test_the_schedule_and_the_anchor():
    assert [s for s in range(1, 40) if is_checkpoint_step(s)] == [1, 2, 4, 8, 16, 32]
    assert not is_checkpoint_step(0)
    anchor, current = _params(0), _params(1)
    ex = Extrapolator(anchor)
    same, none = ex.after_update(3, current, lambda p: 0.0)
    assert same is current and none is None and _equal(ex.anchor, anchor)  # not a checkpoint step: nothing happens
    target = extrapolate(anchor, current, 6.5)
    best, jump = ex.after_update(4, current, _toward(target, anchor))
    assert jump.accepted and _equal(ex.anchor, best)  # re-anchored at the point kept
    # the anchor owns its buffers: the learner donates (deletes) the parameters it was given
    assert all(a is not b for a, b in zip(jax.tree_util.tree_leaves(ex.anchor), jax.tree_util.tree_leaves(best)))
    assert jump.metrics()["extrapolation_factor"] == 7.0
    with pytest.raises(ValueError, match="factors must be > 1"):
        Extrapolator(anchor, factors=(1, 3))
