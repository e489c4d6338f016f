"""One decode step's sampling, the same in both engines: the draw, the records, the stop test.

Randomness is per prompt: prompt ``i`` of a call with key ``k`` samples with
``key_i = fold_in(k, i)`` (:func:`prompt_keys`), and its answer token ``t`` (with its
Monte-Carlo candidates) is drawn with ``fold_in(key_i, t)``. A draw therefore depends on
the prompt's key and the token's index only: not on the row or slot the prompt decodes
in, its neighbours, the batch's size, the chunking, or the engine. Same prompt, same key,
same weights → the same answer from the static and the continuous engine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from asyncopd_jax.estimators import sample_candidates
from asyncopd_jax.sampling.distribution import SamplingParams, sampling_logprobs
from asyncopd_jax.sampling.records import Records

Array = jax.Array


@functools.partial(jax.jit, static_argnums=1)  # one dispatch per group, not a vmap traced each call
def prompt_keys(key: Array, count: int) -> Array:
    """The sampling keys ``[count]`` of prompts ``0 .. count − 1`` of a call: ``fold_in(key, i)``."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(count))


def sample_token(
    params: SamplingParams,
    pad_id: int,
    logits: Array,
    keys: Array,
    active: Array,
    records: Records,
    version: Array,
) -> tuple[Records, Array, Array]:
    """Sample each active row's next answer token and record it.

    Row ``b`` draws its token and ``N`` candidates, ``1 + N`` i.i.d. draws from one inverse
    CDF (``B · (1 + N)`` uniforms per step instead of ``B · V`` Gumbel noises), from the
    distribution actually sampled from (:func:`sampling_logprobs` of ``logits``), with
    ``fold_in(keys[b], records.length[b])``; it writes at column ``records.length[b]`` the
    token, its behaviour log-prob, ``version``, the candidates and the student's top-K ids
    with theirs, and advances ``length``. An inactive row writes nothing (its writes go to
    column T, which a ``mode="drop"`` scatter drops) and samples ``pad_id``.

    Args:
      logits: ``[B, V]`` fp32 the model's logits for each row's next token (the top-K is of
        these, not of the sampling distribution).
      keys: ``[B]`` the rows' prompts' keys (:func:`prompt_keys`).
      active: ``[B]`` bool rows still answering.
      records: what the rows sampled so far.
      version: scalar int32, the policy version of the weights that made ``logits``.

    Returns:
      ``(records, token [B] int32, finished [B] bool)``: ``finished`` marks the active rows
      whose answer this token ends (a stop token, or the T-th token).
    """
    p = params
    t_max = records.tokens.shape[1]
    logp_all = sampling_logprobs(logits, p)  # [B, V]
    step_keys = jax.vmap(jax.random.fold_in)(keys, records.length)
    draws = jax.vmap(lambda key, lp: sample_candidates(key, lp[None], 1 + p.num_candidates)[0][0])(step_keys, logp_all)
    token = jnp.where(active, draws[:, 0], pad_id)  # [B]
    column = jnp.where(active, records.length, t_max)
    row = jnp.arange(token.shape[0])

    def put(field: Array, value: Array) -> Array:
        return field.at[row, column].set(value, mode="drop")

    def logp_of(ids: Array) -> Array:
        return jnp.take_along_axis(logp_all, ids, axis=-1)

    written = dict(
        tokens=put(records.tokens, token),
        logp=put(records.logp, logp_of(token[:, None])[:, 0]),
        versions=put(records.versions, jnp.full_like(token, version)),
    )
    if p.num_candidates:
        candidates = draws[:, 1:]
        written.update(candidate_ids=put(records.candidate_ids, candidates))
        written.update(candidate_logp=put(records.candidate_logp, logp_of(candidates)))
    if p.student_topk:
        topk = jax.lax.top_k(logits, p.student_topk)[1].astype(jnp.int32)
        written.update(topk_ids=put(records.topk_ids, topk), topk_logp=put(records.topk_logp, logp_of(topk)))
    stop_ids = jnp.asarray(p.stop_token_ids or (-1,), jnp.int32)
    finished = active & (jnp.isin(token, stop_ids) | (records.length + 1 >= t_max))
    advanced = Records(length=records.length + active, **{**records.columns, **written})
    return advanced, token, finished
