"""Log-probabilities of given token ids: dense, and chunked + fused from hidden states.

The learner needs the student's log-probs only on a few cached ids per position (the
sampled token, N Monte-Carlo candidates, a top-K support), never the ``[B, T, V]``
logits themselves. :func:`gather_logprobs_from_hidden` fuses the LM head, the
log-softmax and the gather over chunks of positions with a custom VJP that recomputes
each chunk's logits in the backward pass, so that neither pass holds more than
``[chunk_size, V]`` logits at a time. :func:`gather_logprobs_and_entropy_from_hidden`
also returns each position's entropy from the same pass (the exponentials of the
log-normaliser serve both), differentiable too, for an entropy metric or bonus.

The custom VJP gives reverse-mode derivatives (``jax.grad``, ``jax.vjp``) only:
forward mode (``jax.jvp``, ``jax.jacfwd``) raises, as for any ``jax.custom_vjp``.

Ids outside ``[0, V)``: the log-prob there is NaN, with no gradient, in every function here
(a negative id is not wrapped to ``V − 1`` as NumPy indexing would, nor is any id clamped:
either would hand the loss a finite, wrong log-prob that nothing downstream can detect,
while a NaN shows in the loss). The ids are traced values, so the range is checked on
request: ``check_inputs=True`` fails with one line naming ``ids`` and the vocabulary size
(:mod:`asyncopd_jax.estimators.checks`: eagerly, under ``jit`` and under ``checkify``).
``mask`` (``[B, T]``): the positions to gather; the others (padding, whose ids may be out of
range) give log-prob 0 with no gradient, are not checked, and their logits or hidden
states are kept out of the arithmetic, so that NaN there does not reach the gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from asyncopd_jax.estimators.checks import as_mask, check_ids, keep

Array = jax.Array


def _with_support_axis(ids: Array, batch_ndim: int) -> tuple[Array, bool]:
    """``[B, T]`` ids → ``[B, T, 1]`` (and remember to squeeze); ``[B, T, K]`` unchanged."""
    if ids.ndim == batch_ndim:
        return ids[..., None], True
    if ids.ndim == batch_ndim + 1:
        return ids, False
    raise ValueError(
        f"ids must have shape [B, T] or [B, T, K] matching the logits' leading axes; got "
        f"ids.ndim={ids.ndim} for {batch_ndim} leading axes"
    )


def _positions_mask(fn: str, mask: ArrayLike | None, name: str, positions: tuple[int, ...]) -> Array | None:
    """``mask`` as a bool array of the ``positions`` shape (``[B, T]``) of ``name``, or None."""
    mask = as_mask(mask)
    if mask is not None and mask.shape != tuple(positions):
        raise ValueError(f"{fn}: mask has shape {list(mask.shape)}; expected {list(positions)} like {name}'s positions")
    return mask


def _valid_ids(
    fn: str, ids: Array, vocab: int, source: str, mask: Array | None, check_inputs: bool
) -> tuple[Array, Array]:
    """``[B, T, K]`` ids → (ids safe to gather: 0 where out of range or masked, in-range
    flags), after the range check ``check_inputs`` asks for."""
    if check_inputs:
        check_ids(fn, "ids", ids, vocab, source, mask)
    ids = keep(ids, mask, 0)
    valid = (ids >= 0) & (ids < vocab)
    return jnp.where(valid, ids, 0), valid


def gather_logprobs(
    logits: Array,
    ids: Array,
    temperature: float = 1.0,
    *,
    mask: ArrayLike | None = None,
    check_inputs: bool = False,
) -> Array:
    """``log softmax(logits / τ)[ids]`` in fp32.

    ``log p(v) = z_v / τ − logsumexp_u(z_u / τ)``, computed without materialising the
    full log-softmax.

    Args:
      logits: ``[B, T, V]`` (any float dtype).
      ids: ``[B, T]`` or ``[B, T, K]`` integer ids in ``[0, V)`` (NaN outside it: see the module).
      temperature: ``τ > 0``; use the sampler's temperature for the student so that
        ratios against behaviour log-probs compare the same distribution.
      mask: ``[B, T]`` positions to gather, or None (see the module).
      check_inputs: check that ``ids`` lie in ``[0, V)``.

    Returns:
      ``[B, T]`` or ``[B, T, K]`` fp32, matching ``ids`` (0 where ``mask`` is 0).
    """
    mask = _positions_mask("gather_logprobs", mask, "logits", logits.shape[:-1])
    support, squeeze = _with_support_axis(ids, logits.ndim - 1)
    support, valid = _valid_ids(
        "gather_logprobs", support, logits.shape[-1], "the logits' last axis", mask, check_inputs
    )
    scaled = keep(logits, mask).astype(jnp.float32) / temperature
    picked = jnp.take_along_axis(scaled, support, axis=-1)
    logp = keep(jnp.where(valid, picked - jax.nn.logsumexp(scaled, axis=-1, keepdims=True), jnp.nan), mask)
    return logp[..., 0] if squeeze else logp


def _chunk_logits(hidden: Array, lm_head: Array, temperature: float) -> Array:
    """``[C, H] @ [H, V]`` with fp32 accumulation, divided by the temperature."""
    logits = jnp.dot(hidden, lm_head, preferred_element_type=jnp.float32)
    return logits / temperature


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused_gather(
    hidden: Array, lm_head: Array, ids: Array, chunk_size: int, temperature: float
) -> tuple[Array, Array]:
    """``[n, c, H], [H, V], [n, c, K] → ([n, c, K] log-probs, [n, c] entropies)``, chunk by chunk."""
    out, _ = _fused_gather_fwd(hidden, lm_head, ids, chunk_size, temperature)
    return out


def _normaliser_and_entropy(logits: Array) -> tuple[Array, Array]:
    """``[C, V]`` → the log-normaliser ``lse`` and the entropy ``lse − Σ_v p_v z_v``, both
    ``[C]``, from one pass of exponentials."""
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    weights = jnp.exp(logits - top)
    total = jnp.sum(weights, axis=-1)
    lse = top[:, 0] + jnp.log(total)
    return lse, lse - jnp.sum(weights * logits, axis=-1) / total


def _fused_gather_fwd(hidden, lm_head, ids, chunk_size, temperature):
    def one_chunk(_, xs):
        h, idx = xs
        logits = _chunk_logits(h, lm_head, temperature)
        lse, entropy = _normaliser_and_entropy(logits)
        return None, (jnp.take_along_axis(logits, idx, axis=-1) - lse[:, None], lse, entropy)

    _, (logp, lse, entropy) = jax.lax.scan(one_chunk, None, (hidden, ids))
    return (logp, entropy), (hidden, lm_head, ids, lse, entropy)


# Columns of the [H, V] weight gradient updated per step in the backward pass: each row
# chunk's contribution h^T · dz is added slice by slice into the accumulator, so that no
# second [H, V] temporary (a whole h^T · dz product) ever exists beside it.
_WEIGHT_GRAD_COLUMNS = 8192


def _add_weight_grad(d_head: Array, h: Array, d_logits: Array) -> Array:
    """``d_head += h^T · d_logits``, in column slices, in place in the loop carry."""
    vocab = d_head.shape[1]
    width = min(_WEIGHT_GRAD_COLUMNS, vocab)
    h_t = h.T.astype(jnp.float32)

    def add_slice(j, acc):
        # The last slice is clamped to end at V; columns a previous slice covered are masked.
        start = jnp.minimum(j * width, vocab - width)
        cols = start + jnp.arange(width)
        update = jnp.dot(h_t, jax.lax.dynamic_slice_in_dim(d_logits, start, width, axis=1))
        update = jnp.where(cols[None, :] >= j * width, update, 0.0)
        current = jax.lax.dynamic_slice_in_dim(acc, start, width, axis=1)
        return jax.lax.dynamic_update_slice_in_dim(acc, current + update, start, axis=1)

    return jax.lax.fori_loop(0, -(-vocab // width), add_slice, d_head)


def _fused_gather_bwd(chunk_size, temperature, residuals, cotangents):
    # With z the scaled logits and p = softmax(z):
    #   d logp[r, k] / d z[r, v] = 1[v = ids[r, k]] − p[r, v]
    #   d H[r] / d z[r, v]       = −p[r, v] (log p[r, v] + H[r])
    # so dz[r] = (scatter_add(g[r] at ids[r]) − p[r] Σ_k g[r, k] − g_H[r] p[r] (log p[r] + H[r])) / τ
    # (divided by τ once for z = logits / τ). Scatter-add (not set) so that duplicate ids accumulate.
    hidden, lm_head, ids, lse, entropy = residuals
    g, g_entropy = cotangents
    rows = jnp.arange(hidden.shape[1])[:, None]

    def one_chunk(d_head, xs):
        h, idx, chunk_lse, chunk_entropy, chunk_g, chunk_g_entropy = xs
        logits = _chunk_logits(h, lm_head, temperature)
        logp = logits - chunk_lse[:, None]
        probs = jnp.exp(logp)
        d_logits = -probs * (
            jnp.sum(chunk_g, axis=-1, keepdims=True) + chunk_g_entropy[:, None] * (logp + chunk_entropy[:, None])
        )
        d_logits = d_logits.at[rows, idx].add(chunk_g) / temperature
        d_hidden = jnp.dot(d_logits, lm_head.T.astype(jnp.float32)).astype(hidden.dtype)
        return _add_weight_grad(d_head, h, d_logits), d_hidden

    d_head0 = jnp.zeros(lm_head.shape, jnp.float32)
    d_head, d_hidden = jax.lax.scan(
        one_chunk, d_head0, (hidden, ids, lse, entropy, g.astype(jnp.float32), g_entropy.astype(jnp.float32))
    )
    return d_hidden, d_head.astype(lm_head.dtype), None


_fused_gather.defvjp(_fused_gather_fwd, _fused_gather_bwd)


def gather_logprobs_and_entropy_from_hidden(
    hidden: Array,
    lm_head: Array,
    ids: Array,
    chunk_size: int = 512,
    temperature: float = 1.0,
    *,
    mask: ArrayLike | None = None,
    check_inputs: bool = False,
) -> tuple[Array, Array]:
    """:func:`gather_logprobs_from_hidden` and each position's entropy, from one pass.

    ``H[b, t] = −Σ_v p_v log p_v`` of ``p = softmax(hidden[b, t] @ lm_head / τ)``,
    computed chunk by chunk as ``logsumexp(z) − Σ_v p_v z_v`` from the exponentials the
    log-normaliser already needs, so the ``[B, T, V]`` distribution never exists.
    Differentiable (``jax.grad``) in ``hidden`` and ``lm_head`` through both outputs:
    ``∂H/∂z_v = −p_v (log p_v + H) / τ``.

    Args:
      hidden: ``[B, T, H]`` final hidden states, target-aligned.
      lm_head: ``[H, V]`` output projection.
      ids: ``[B, T]`` or ``[B, T, K]`` integer ids in ``[0, V)`` (NaN outside it: see the module).
      chunk_size: rows per chunk (static).
      temperature: ``τ > 0`` (static).
      mask: ``[B, T]`` positions to gather, or None (see the module).
      check_inputs: check that ``ids`` lie in ``[0, V)``.

    Returns:
      ``(log-probs [B, T] or [B, T, K], entropy [B, T])``, fp32 (both 0 where ``mask`` is 0).
    """
    return _gather_from_hidden(
        "gather_logprobs_and_entropy_from_hidden", hidden, lm_head, ids, chunk_size, temperature, mask, check_inputs
    )


def _gather_from_hidden(
    fn: str,
    hidden: Array,
    lm_head: Array,
    ids: Array,
    chunk_size: int,
    temperature: float,
    mask: ArrayLike | None,
    check_inputs: bool,
) -> tuple[Array, Array]:
    """:func:`gather_logprobs_and_entropy_from_hidden`, as called by ``fn`` (for messages)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[-1] != lm_head.shape[0]:
        raise ValueError(
            f"hidden size mismatch: hidden has H={hidden.shape[-1]}, lm_head has shape "
            f"{lm_head.shape} (expected [H, V])"
        )
    batch_shape = hidden.shape[:-1]
    mask = _positions_mask(fn, mask, "hidden", batch_shape)
    support, squeeze = _with_support_axis(ids, len(batch_shape))
    support, valid = _valid_ids(
        fn, support.astype(jnp.int32), lm_head.shape[1], "lm_head's last axis", mask, check_inputs
    )
    hidden = keep(hidden, mask)
    rows = 1
    for d in batch_shape:
        rows *= d
    chunk = min(chunk_size, max(rows, 1))
    n_chunks = -(-rows // chunk)
    pad = n_chunks * chunk - rows
    flat_hidden = jnp.pad(hidden.reshape(rows, hidden.shape[-1]), ((0, pad), (0, 0)))
    flat_ids = jnp.pad(support.reshape(rows, support.shape[-1]).astype(jnp.int32), ((0, pad), (0, 0)))
    logp, entropy = _fused_gather(
        flat_hidden.reshape(n_chunks, chunk, -1),
        lm_head,
        flat_ids.reshape(n_chunks, chunk, -1),
        chunk,
        float(temperature),
    )
    logp = logp.reshape(n_chunks * chunk, -1)[:rows].reshape(*batch_shape, support.shape[-1])
    logp = keep(jnp.where(valid, logp, jnp.nan), mask)  # the where: no cotangent reaches an invalid id
    entropy = keep(entropy.reshape(n_chunks * chunk)[:rows].reshape(batch_shape), mask)
    return (logp[..., 0] if squeeze else logp), entropy


def gather_logprobs_from_hidden(
    hidden: Array,
    lm_head: Array,
    ids: Array,
    chunk_size: int = 512,
    temperature: float = 1.0,
    *,
    mask: ArrayLike | None = None,
    check_inputs: bool = False,
) -> Array:
    """``log softmax(hidden @ lm_head / τ)[ids]`` without ever holding ``[B, T, V]``.

    Same values and gradients (w.r.t. ``hidden`` and ``lm_head``) as
    ``gather_logprobs(hidden @ lm_head, ids, τ)``, but the ``B·T`` positions are
    processed in chunks of ``chunk_size`` rows under ``lax.scan``: the forward keeps only
    the per-row log-normaliser, and the backward recomputes each chunk's logits (one
    extra matmul) to form ``dz = (onehot(ids)·g − softmax(z)·Σg) / τ``. Peak memory is
    ``O(chunk_size · V)`` in both passes, plus the ``[H, V]`` weight gradient (fp32
    accumulator) that any path needs. Duplicate ids in a row are handled (their
    gradients add up). Reverse mode only (a custom VJP): ``jax.jvp`` raises.

    Args:
      hidden: ``[B, T, H]`` final hidden states, target-aligned (row t predicts token t).
      lm_head: ``[H, V]`` output projection (transpose of a tied embedding if tied).
      ids: ``[B, T]`` or ``[B, T, K]`` integer ids in ``[0, V)`` (NaN outside it: see the module).
      chunk_size: rows per chunk (static); positions are padded up to a multiple.
      temperature: ``τ > 0`` (static).
      mask: ``[B, T]`` positions to gather, or None (see the module).
      check_inputs: check that ``ids`` lie in ``[0, V)``.

    Returns:
      ``[B, T]`` or ``[B, T, K]`` fp32, matching ``ids`` (0 where ``mask`` is 0).
    """
    return _gather_from_hidden(
        "gather_logprobs_from_hidden", hidden, lm_head, ids, chunk_size, temperature, mask, check_inputs
    )[0]
