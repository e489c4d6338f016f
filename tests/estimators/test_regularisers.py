"""KL to a reference policy (k1 / k2 / k3) against a NumPy oracle, in value and gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncopd_jax.estimators import reference_kl


def _problem(seed=0, spread=0.8):
    rng = np.random.default_rng(seed)
    reference = np.log(rng.uniform(0.05, 0.9, size=(3, 6))).astype(np.float32)
    logp = (reference + rng.normal(scale=spread, size=reference.shape)).astype(np.float32)
    return logp, reference


@pytest.mark.parametrize(
    "kind,value,grad",
    [
        ("k1", lambda d: d, lambda d: np.ones_like(d)),
        ("k2", lambda d: 0.5 * d * d, lambda d: d),
        ("k3", lambda d: np.exp(-d) - 1 + d, lambda d: 1 - np.exp(-d)),
    ],
)
def test_reference_kl_estimators(kind, value, grad):
    logp, reference = _problem()
    d = logp.astype(np.float64) - reference
    np.testing.assert_allclose(reference_kl(logp, reference, kind), value(d), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        jax.grad(lambda lp: reference_kl(lp, reference, kind).sum())(logp), grad(d), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(jax.grad(lambda r: reference_kl(logp, r, kind).sum())(reference), 0.0)


def test_k3_is_the_default_and_is_clamped_as_verl_clamps_it():
    logp, reference = _problem(1)
    np.testing.assert_array_equal(reference_kl(logp, reference), reference_kl(logp, reference, "k3"))
    far = reference_kl(jnp.array([[-30.0, 30.0, 5.0]]), jnp.zeros((1, 3)))[0]
    np.testing.assert_allclose(far, [10.0, 10.0, np.exp(-5.0) + 4.0], rtol=1e-6)  # k3 clamped to at most 10
    with pytest.raises(ValueError, match="kind = 'k4' is invalid; allowed: k1, k2, k3"):
        reference_kl(logp, reference, "k4")


def test_the_unbiased_estimators_average_to_the_kl_on_tokens_from_the_policy():
    """E_{y∼π}[k1] = E_{y∼π}[k3] = KL(π ‖ π_ref); k2 is biased (second order)."""
    rng = np.random.default_rng(2)
    policy, ref = rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))
    exact = float(np.sum(policy * np.log(policy / ref)))
    lp, lr = np.log(policy).astype(np.float32), np.log(ref).astype(np.float32)
    for kind in ("k1", "k3"):
        expected = float(np.sum(policy * np.asarray(reference_kl(lp, lr, kind), np.float64)))
        assert expected == pytest.approx(exact, rel=1e-5)
    assert float(np.sum(policy * np.asarray(reference_kl(lp, lr, "k2")))) != pytest.approx(exact, rel=1e-2)
