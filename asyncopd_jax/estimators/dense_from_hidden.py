"""Exact full-vocabulary KL between student and teacher from their final hidden states.

The teacher ships its final hidden states ``h_q [B, T, H_q]`` (what its LM head reads,
after the final norm) instead of a finite score cache; the learner holds the teacher's LM
head ``W_q [H_q, V]`` beside the student's ``W_π [H_π, V]`` and computes, per position,

    z = h_π W_π / τ_π,   u = h_q W_q / τ_q,   π = softmax(z),   q = softmax(u)
    KL(q ‖ π) = E_q[u − z] − lse(u) + lse(z)      (forward)
    KL(π ‖ q) = E_π[z − u] − lse(z) + lse(u)      (reverse)

without ever holding the ``[B, T, V]`` logits: positions go in chunks of ``chunk_size``
rows (``lax.scan``) and, within a chunk, the vocabulary in blocks of ``vocab_chunk``
columns (``lax.fori_loop``) with a running maximum, so the log-normalisers and the two
expectations are accumulated block by block (each block's sums rescaled by
``exp(m_old − m_new)`` when the running maximum grows). Peak memory: ``[chunk_size,
vocab_chunk]`` logits of each model, plus the fp32 ``[H_π, V]`` weight gradient.

Both KLs come from the one pass (:func:`dense_kls_from_hidden`); the gradient reaches the
student's hidden states and head only (the teacher's are constants), through a custom VJP
that recomputes each block's logits:

    ∂KL(q ‖ π)/∂z_v = π_v − q_v
    ∂KL(π ‖ q)/∂z_v = π_v (log π_v − log q_v − KL(π ‖ q))

each divided by ``τ_π``. Reverse mode only (``jax.grad``, ``jax.vjp``).

A model pair padded to different vocabulary sizes compares the ids both have: pass both
heads sliced to the shared ``V`` (``W[:, :V]``). ``mask`` (``[B, T]``): positions left out
give 0 and no gradient, and their hidden states are kept out of the arithmetic (NaN there
reaches nothing), as in :mod:`asyncopd_jax.estimators.forward_kl`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from asyncopd_jax.estimators.checks import as_mask, keep

Array = jax.Array


def _blocks(vocab: int, width: int) -> int:
    """Blocks of ``width`` columns that cover ``vocab``."""
    return -(-vocab // width)


def _block(hidden: Array, head: Array, j: Array, width: int, temperature: float) -> tuple[Array, Array]:
    """Block ``j``'s logits ``[C, width]`` (fp32, / τ) and its first column.

    Block j holds columns ``j · width …``; the last is moved back to end at V (no padded
    copy of the head), and the columns an earlier block covered are −inf in it."""
    start = jnp.minimum(j * width, head.shape[1] - width)
    logits = jnp.dot(
        hidden, jax.lax.dynamic_slice_in_dim(head, start, width, axis=1), preferred_element_type=jnp.float32
    )
    fresh = start + jnp.arange(width) >= j * width
    return jnp.where(fresh[None, :], logits / temperature, -jnp.inf), start


def _chunk_stats(hs, ws, ht, wt, width, temperatures):
    """One position chunk ``[C, H]`` → ``(lse_z, lse_u, forward KL, reverse KL)``, each ``[C]``."""
    tau_s, tau_t = temperatures
    rows = hs.shape[0]

    def add_block(j, carry):
        m_z, s_z, m_u, s_u, a_fwd, a_rev = carry
        z, _ = _block(hs, ws, j, width, tau_s)
        u, _ = _block(ht, wt, j, width, tau_t)
        valid = jnp.isfinite(z)  # not the columns an earlier block covered
        diff = jnp.where(valid, u - z, 0.0)
        new_z, new_u = jnp.maximum(m_z, z.max(axis=1)), jnp.maximum(m_u, u.max(axis=1))
        e_z, e_u = jnp.exp(z - new_z[:, None]), jnp.exp(u - new_u[:, None])  # 0 where covered before
        scale_z, scale_u = jnp.exp(m_z - new_z), jnp.exp(m_u - new_u)  # rescale what came before
        return (
            new_z,
            s_z * scale_z + e_z.sum(axis=1),
            new_u,
            s_u * scale_u + e_u.sum(axis=1),
            a_fwd * scale_u + (e_u * diff).sum(axis=1),  # Σ e^(u − m_u) (u − z)
            a_rev * scale_z - (e_z * diff).sum(axis=1),  # Σ e^(z − m_z) (z − u)
        )

    # Running maxima start at −inf: the first block holds real columns (V ≥ 1), so they are
    # finite after it and exp(−inf − m) = 0 drops the empty start.
    start = (jnp.full((rows,), -jnp.inf), jnp.zeros((rows,)), jnp.full((rows,), -jnp.inf), *[jnp.zeros((rows,))] * 3)
    m_z, s_z, m_u, s_u, a_fwd, a_rev = jax.lax.fori_loop(0, _blocks(ws.shape[1], width), add_block, start)
    lse_z, lse_u = m_z + jnp.log(s_z), m_u + jnp.log(s_u)
    return lse_z, lse_u, a_fwd / s_u - lse_u + lse_z, a_rev / s_z - lse_z + lse_u


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused_kls(hs, ws, ht, wt, width, temperatures):
    """``[n, c, H_π], [H_π, V], [n, c, H_q], [H_q, V]`` → (forward, reverse) KLs ``[n, c]``."""
    out, _ = _fused_kls_fwd(hs, ws, ht, wt, width, temperatures)
    return out


def _fused_kls_fwd(hs, ws, ht, wt, width, temperatures):
    def one_chunk(_, xs):
        student, teacher = xs
        return None, _chunk_stats(student, ws, teacher, wt, width, temperatures)

    _, (lse_z, lse_u, forward, reverse) = jax.lax.scan(one_chunk, None, (hs, ht))
    return (forward, reverse), (hs, ws, ht, wt, lse_z, lse_u, reverse)


def _fused_kls_bwd(width, temperatures, residuals, cotangents):
    hs, ws, ht, wt, lse_z, lse_u, reverse = residuals
    g_fwd, g_rev = cotangents
    tau_s, tau_t = temperatures

    def one_chunk(d_head, xs):
        h, t_hidden, c_lse_z, c_lse_u, c_rev, c_gf, c_gr = xs

        def one_block(j, carry):
            d_hidden, d_head = carry
            z, start = _block(h, ws, j, width, tau_s)
            u, _ = _block(t_hidden, wt, j, width, tau_t)
            log_p, log_q = z - c_lse_z[:, None], u - c_lse_u[:, None]
            p, q = jnp.exp(log_p), jnp.exp(log_q)  # 0 where an earlier block covered the column: d_z 0 there
            log_ratio = jnp.where(jnp.isfinite(log_p), log_p - log_q, 0.0)
            d_z = (c_gf[:, None] * (p - q) + c_gr[:, None] * p * (log_ratio - c_rev[:, None])) / tau_s
            block = jax.lax.dynamic_slice_in_dim(ws, start, width, axis=1)
            d_hidden = d_hidden + jnp.dot(d_z, block.T.astype(jnp.float32))
            current = jax.lax.dynamic_slice_in_dim(d_head, start, width, axis=1)
            update = jnp.dot(h.T.astype(jnp.float32), d_z)
            return d_hidden, jax.lax.dynamic_update_slice_in_dim(d_head, current + update, start, axis=1)

        d_hidden0 = jnp.zeros(h.shape, jnp.float32)
        d_hidden, d_head = jax.lax.fori_loop(0, _blocks(ws.shape[1], width), one_block, (d_hidden0, d_head))
        return d_head, d_hidden.astype(h.dtype)

    d_head0 = jnp.zeros(ws.shape, jnp.float32)
    xs = (hs, ht, lse_z, lse_u, reverse, g_fwd.astype(jnp.float32), g_rev.astype(jnp.float32))
    d_head, d_hidden = jax.lax.scan(one_chunk, d_head0, xs)
    # the teacher's hidden states and head are constants: no gradient
    return d_hidden, d_head.astype(ws.dtype), jnp.zeros_like(ht), jnp.zeros_like(wt)


_fused_kls.defvjp(_fused_kls_fwd, _fused_kls_bwd)


def dense_kls_from_hidden(
    student_hidden: Array,
    student_head: Array,
    teacher_hidden: Array,
    teacher_head: Array,
    *,
    student_temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    chunk_size: int = 512,
    vocab_chunk: int = 8192,
    mask: ArrayLike | None = None,
) -> tuple[Array, Array]:
    """Per-token ``(KL(q ‖ π), KL(π ‖ q))`` over the whole vocabulary, from hidden states.

    Same values and gradients (w.r.t. ``student_hidden`` and ``student_head``) as
    :func:`~asyncopd_jax.estimators.forward_kl_dense` and
    :func:`~asyncopd_jax.estimators.reverse_kl_dense` on the logits
    ``student_hidden @ student_head / τ_π`` and ``teacher_hidden @ teacher_head / τ_q``,
    without the ``[B, T, V]`` arrays (see the module).

    Args:
      student_hidden: ``[B, T, H_π]`` the student's final hidden states, target-aligned.
      student_head: ``[H_π, V]``.
      teacher_hidden: ``[B, T, H_q]`` the teacher's, at the same positions (constant).
      teacher_head: ``[H_q, V]`` (constant), the same ``V`` as the student's.
      student_temperature: ``τ_π > 0`` (static): the sampler's, as for the student's
        other log-probs.
      teacher_temperature: ``τ_q > 0`` (static): the scorer's.
      chunk_size: positions per chunk (static).
      vocab_chunk: vocabulary columns per block (static).
      mask: ``[B, T]`` positions to compute, or None.

    Returns:
      ``(forward, reverse)``, each ``[B, T]`` fp32 ≥ 0 up to rounding (0 where ``mask`` is 0).
    """
    fn = "dense_kls_from_hidden"
    if chunk_size < 1 or vocab_chunk < 1:
        raise ValueError(f"{fn}: chunk_size and vocab_chunk must be >= 1, got {chunk_size}, {vocab_chunk}")
    if student_hidden.shape[:-1] != teacher_hidden.shape[:-1]:
        raise ValueError(
            f"{fn}: student_hidden {list(student_hidden.shape)} and teacher_hidden {list(teacher_hidden.shape)} "
            "must share their positions [B, T]"
        )
    for name, hidden, head in (
        ("student", student_hidden, student_head),
        ("teacher", teacher_hidden, teacher_head),
    ):
        if head.ndim != 2 or hidden.shape[-1] != head.shape[0]:
            raise ValueError(
                f"{fn}: {name}_hidden has H={hidden.shape[-1]}; {name}_head has shape {list(head.shape)} "
                "(expected [H, V])"
            )
    vocab = student_head.shape[1]
    if teacher_head.shape[1] != vocab:
        raise ValueError(
            f"{fn}: the heads' vocabularies differ (student {vocab}, teacher {teacher_head.shape[1]}); "
            "slice both to the ids they share"
        )
    positions = student_hidden.shape[:-1]
    mask = as_mask(mask)
    if mask is not None and mask.shape != tuple(positions):
        raise ValueError(f"{fn}: mask has shape {list(mask.shape)}; expected {list(positions)}")
    rows = 1
    for d in positions:
        rows *= d
    chunk = min(chunk_size, max(rows, 1))
    n_chunks = -(-rows // chunk)
    width = min(vocab_chunk, vocab)

    def chunks(hidden: Array) -> Array:
        flat = keep(hidden, mask).reshape(rows, hidden.shape[-1])
        return jnp.pad(flat, ((0, n_chunks * chunk - rows), (0, 0))).reshape(n_chunks, chunk, -1)

    forward, reverse = _fused_kls(
        chunks(student_hidden),
        student_head,
        chunks(jax.lax.stop_gradient(teacher_hidden)),
        jax.lax.stop_gradient(teacher_head),
        width,
        (float(student_temperature), float(teacher_temperature)),
    )

    def unchunk(x: Array) -> Array:
        return keep(x.reshape(n_chunks * chunk)[:rows].reshape(positions), mask)

    return unchunk(forward), unchunk(reverse)


def forward_kl_dense_from_hidden(
    student_hidden: Array, student_head: Array, teacher_hidden: Array, teacher_head: Array, **kwargs
) -> Array:
    """``KL(q ‖ π)`` per token ``[B, T]`` of :func:`dense_kls_from_hidden` (its keyword
    arguments too)."""
    return dense_kls_from_hidden(student_hidden, student_head, teacher_hidden, teacher_head, **kwargs)[0]


def reverse_kl_dense_from_hidden(
    student_hidden: Array, student_head: Array, teacher_hidden: Array, teacher_head: Array, **kwargs
) -> Array:
    """``KL(π ‖ q)`` per token ``[B, T]`` of :func:`dense_kls_from_hidden` (its keyword
    arguments too)."""
    return dense_kls_from_hidden(student_hidden, student_head, teacher_hidden, teacher_head, **kwargs)[1]
