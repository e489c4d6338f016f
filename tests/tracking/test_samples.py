"""The table of sample answers: prompt and answer decoded, each answer token with its
teacher KL signal log μ − log q (a NumPy oracle on a hand-made group)."""

from __future__ import annotations

import types

import numpy as np

from asyncopd_jax.pipeline.staleness import RolloutGroup
from asyncopd_jax.tracking.samples import COLUMNS, sample_table
from tests.tiny_tokenizers import byte_level_bpe


def _group(tokenizer, prompts: list[str], answers: list[str], span_end=None) -> RolloutGroup:
    p = [tokenizer.encode(t) for t in prompts]
    a = [tokenizer.encode(t) for t in answers]
    width_p, width_a = max(map(len, p)), max(map(len, a))
    prompt_tokens = np.array([[0] * (width_p - len(r)) + r for r in p])  # left-padded
    prompt_mask = np.array([[False] * (width_p - len(r)) + [True] * len(r) for r in p])
    response_tokens = np.array([r + [0] * (width_a - len(r)) for r in a])  # right-padded
    response_mask = np.array([[True] * len(r) + [False] * (width_a - len(r)) for r in a])
    rng = np.random.default_rng(0)
    behavior, teacher = rng.normal(size=(2, len(a), width_a)).astype(np.float32)
    batch = types.SimpleNamespace(
        prompt_tokens=prompt_tokens,
        prompt_mask=prompt_mask,
        response_tokens=response_tokens,
        response_mask=response_mask,
        behavior_logp=behavior,
    )
    cache = types.SimpleNamespace(token_logp=teacher, span_end=span_end)
    return RolloutGroup(batch=batch, cache=cache, oldest_version=0, newest_version=0)


def test_each_row_is_the_prompt_the_answer_and_the_kl_of_each_answer_token():
    tokenizer = byte_level_bpe()
    groups = [
        _group(tokenizer, ["1+2=", "30+4="], ["3", "34 ok"]),
        _group(tokenizer, ["5+5="], ["10"]),
    ]
    table = sample_table(groups, tokenizer, rows=3)
    assert [row[:2] for row in table] == [["1+2=", "3"], ["30+4=", "34 ok"], ["5+5=", "10"]]
    assert COLUMNS == ("prompt", "answer", "kl_mean", "kl_per_token")
    for row, (g, r) in zip(table, [(0, 0), (0, 1), (1, 0)]):
        batch, cache = groups[g].batch, groups[g].cache
        mask = batch.response_mask[r]
        kl = batch.behavior_logp[r][mask] - cache.token_logp[r][mask]  # the oracle
        tokens = [tokenizer.decode([int(t)]) for t in batch.response_tokens[r][mask]]
        assert row[3] == " ".join(f"{t}({k:.3f})" for t, k in zip(tokens, kl))
        np.testing.assert_allclose(row[2], kl.mean(), rtol=1e-6)
    assert len(sample_table(groups, tokenizer, rows=2)) == 2


def test_a_teacher_of_another_tokenizer_leaves_the_per_token_column_empty():
    tokenizer = byte_level_bpe()
    group = _group(tokenizer, ["1+2="], ["3"], span_end=np.ones((1, 1), bool))
    [row] = sample_table([group], tokenizer, rows=4)
    assert row[3] == "" and np.isnan(row[2])
