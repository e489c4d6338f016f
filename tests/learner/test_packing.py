"""Token-budget micro-batch plans: every row once, within the budget, shapes bucketed."""

from __future__ import annotations

import numpy as np
import pytest

from asyncopd_jax.learner.packing import plan_micro_batches


@pytest.mark.parametrize("seed,budget,bucket,row_multiple", [(0, 256, 8, 1), (1, 300, 4, 2), (2, 1000, 16, 4)])
def test_every_row_once_within_the_budget(seed, budget, bucket, row_multiple):
    rng = np.random.default_rng(seed)
    B, P, T = 64, 12, 96
    prompts = rng.integers(1, P + 1, B)
    responses = np.minimum(T, rng.lognormal(2.5, 0.8, B).astype(int) + 1)  # long-tailed
    plans = plan_micro_batches(
        prompts,
        responses,
        prompt_slots=P,
        response_slots=T,
        token_budget=budget,
        bucket=bucket,
        row_multiple=row_multiple,
    )
    real = np.concatenate([p.rows[: p.real] for p in plans])
    assert sorted(real.tolist()) == list(range(B))  # every row exactly once as a real row
    for p in plans:
        assert len(p.rows) % row_multiple == 0 and p.padded_tokens <= budget
        assert set(p.rows[p.real :].tolist()) <= {int(p.rows[0])}  # filler: copies of the first row
        assert (prompts[p.rows] <= p.prompt_slots).all() and (responses[p.rows] <= p.response_slots).all()
        assert p.prompt_slots <= P and p.response_slots <= T
        assert p.response_slots % bucket == 0 or p.response_slots == T
    packed = sum(p.padded_tokens for p in plans)
    assert packed < B * (P + T)  # long tails: less padding than one [B, P + T] block


def test_a_budget_too_small_for_the_longest_row_is_a_clear_error():
    with pytest.raises(
        ValueError,
        match=r"learner.token_budget = 10 cannot hold 2 row\(s\) of 8 \+ 8 slots; "
        r"allowed: >= 32",
    ):
        plan_micro_batches(
            np.array([3, 5]),
            np.array([7, 2]),
            prompt_slots=8,
            response_slots=8,
            token_budget=10,
            bucket=8,
            row_multiple=2,
        )
