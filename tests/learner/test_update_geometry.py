"""The update-geometry diagnostic against hand-computed values."""

import math

import numpy as np
import pytest

from asyncopd_jax.learner.update_geometry import matrix_geometry, update_geometry


def test_norm_rank1_energy_and_alignment_of_known_updates():
    w0 = np.eye(3)
    # Δ = diag(2, 0, 0): one direction, ‖Δ‖ = 2, ‖W_0‖ = √3; the second half continues the first
    norm, rank1, align = matrix_geometry(w0, w0 + np.diag([1.0, 0, 0]), w0 + np.diag([2.0, 0, 0]))
    assert norm == pytest.approx(2 / math.sqrt(3))
    assert rank1 == pytest.approx(1.0)
    assert align == pytest.approx(1.0)
    # Δ = diag(1, 1, 0): two equal singular values → half the energy in the top one; the recent
    # update diag(0, 1, 0) is orthogonal to the one before it, diag(1, 0, 0)
    norm, rank1, align = matrix_geometry(w0, w0 + np.diag([1.0, 0, 0]), w0 + np.diag([1.0, 1.0, 0]))
    assert norm == pytest.approx(math.sqrt(2 / 3))
    assert rank1 == pytest.approx(0.5)
    assert align == pytest.approx(0.0, abs=1e-12)
    # going back the way it came: alignment −1; σ₁² / ‖Δ‖² of a random matrix against SVD
    rng = np.random.default_rng(0)
    delta = rng.normal(size=(5, 4))
    _, rank1, align = matrix_geometry(np.zeros((5, 4)), 3 * delta, 2 * delta)
    s = np.linalg.svd(delta, compute_uv=False)
    assert rank1 == pytest.approx(s[0] ** 2 / np.sum(s**2))
    assert align == pytest.approx(-1.0)


def test_undefined_quantities_are_none_before_any_update():
    w0 = np.ones((2, 2))
    assert matrix_geometry(w0, w0, w0) == (0.0, None, None)


def test_only_attention_and_mlp_matrices_are_reported_by_module_name():
    rng = np.random.default_rng(1)
    tree = {
        "embed_tokens": {"embedding": rng.normal(size=(8, 4))},
        "layers": {
            0: {
                "mlp": {"up_proj": {"kernel": rng.normal(size=(4, 6))}},
                "self_attn": {"q_proj": {"kernel": rng.normal(size=(4, 4)), "bias": np.zeros(4)}},
                "input_layernorm": {"weight": np.ones(4)},
            }
        },
    }
    moved = {**tree, "embed_tokens": {"embedding": tree["embed_tokens"]["embedding"] + 1}}
    out = update_geometry(tree, tree, moved)
    assert sorted(out) == ["layers.0.mlp.up_proj", "layers.0.self_attn.q_proj"]
    assert out["layers.0.mlp.up_proj"] == [0.0, None, None]  # the embedding moved, not this
