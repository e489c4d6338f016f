"""NumPy (float64) reference implementations the estimator tests compare against."""

from __future__ import annotations

import numpy as np


def log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = np.max(x, axis=axis, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True))


def kl(p_logp: np.ndarray, q_logp: np.ndarray) -> np.ndarray:
    """KL(p ‖ q) over the last axis."""
    p = np.exp(p_logp)
    with np.errstate(invalid="ignore"):  # 0 · (−inf) is masked just below
        return np.sum(np.where(p > 0, p * (p_logp - q_logp), 0.0), axis=-1)


def coarse_grain(logp: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Full log-probs [..., V] → log-probs of (ids[0], …, ids[K−1], everything else)."""
    support = np.take_along_axis(logp, ids, -1)
    tail = np.log1p(-np.sum(np.exp(support), axis=-1, keepdims=True))
    return np.concatenate([support, tail], axis=-1)


def reverse_kl_grad_wrt_logits(student_logits: np.ndarray, teacher_logits: np.ndarray) -> np.ndarray:
    """∂ KL(softmax(z) ‖ q) / ∂z_j = p_j (log p_j − log q_j − KL)."""
    lp, lq = log_softmax(student_logits), log_softmax(teacher_logits)
    value = kl(lp, lq)[..., None]
    return np.exp(lp) * (lp - lq - value)


def forward_kl_grad_wrt_logits(student_logits: np.ndarray, teacher_logits: np.ndarray) -> np.ndarray:
    """∂ KL(q ‖ softmax(z)) / ∂z_j = p_j − q_j."""
    return np.exp(log_softmax(student_logits)) - np.exp(log_softmax(teacher_logits))


def ppo_clip(logp, behavior_logp, adv, low, high, dual_clip=None):
    r = np.exp(np.asarray(logp, np.float64) - behavior_logp)
    loss = np.maximum(-adv * r, -adv * np.clip(r, low, high))
    if dual_clip is not None:
        loss = np.where(adv < 0, np.minimum(loss, -dual_clip * adv), loss)
    return loss


def m2po_mask(logp, behavior_logp, mask, budget):
    """The paper's rule, literally: while the second moment of (log π − log μ)² over the kept
    valid tokens is over the budget, remove the kept token with the largest one (first in
    row-major order among equals is kept longest)."""
    delta = np.asarray(logp, np.float64) - np.asarray(behavior_logp, np.float64)
    sq = (delta * delta).ravel()
    keep = (np.asarray(mask) > 0).ravel().copy()
    while keep.any() and sq[keep].mean() > budget:
        candidates = np.flatnonzero(keep)
        largest = sq[candidates].max()
        keep[candidates[sq[candidates] == largest][-1]] = False  # the last of equals goes first
    return keep.reshape(np.shape(logp))


def second_moment_clip_tau(logp, behavior_logp, adv, mask, budget):
    """Largest τ with mean(min(δ², τ²)) ≤ budget over the selected tokens, by bisection."""
    delta = np.asarray(behavior_logp, np.float64) - logp
    sel = (np.asarray(mask) > 0) & (adv * delta > 0)
    sq = (delta * delta)[sel]
    if sq.size == 0 or sq.mean() <= budget:
        return np.inf
    lo, hi = 0.0, float(np.sqrt(sq.max()))
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if np.mean(np.minimum(sq, mid * mid)) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def reverse_kl_hybrid(student_logits, teacher_logits, support_ids, candidate_ids, behavior_logp):
    """Value and gradient w.r.t. the student logits of the hybrid estimator at one draw.

    ``Σ_{v∈S} π(v) d(v) + (1/N) Σ_n 1[v_n ∉ S] ρ_n d(v_n)`` with ``d = log π − log q``,
    differentiated with ``d`` held fixed: ``∂/∂z [π(v)] = π(v) (e_v − π)``.
    Shapes: logits ``[..., V]``, ``support_ids [..., K]``, ``candidate_ids`` and
    ``behavior_logp [..., N]``.
    """
    lp, lq = log_softmax(student_logits), log_softmax(teacher_logits)
    p, d = np.exp(lp), lp - lq
    V = lp.shape[-1]
    value = np.zeros(lp.shape[:-1])
    grad = np.zeros(lp.shape)
    for index in np.ndindex(*lp.shape[:-1]):
        support = set(np.asarray(support_ids[index]).tolist())
        for v in support:
            value[index] += p[index][v] * d[index][v]
            grad[index] += p[index][v] * d[index][v] * (np.eye(V)[v] - p[index])
        cands = np.asarray(candidate_ids[index])
        for v, mu in zip(cands.tolist(), np.asarray(behavior_logp[index], np.float64).tolist()):
            if v in support:
                continue
            rho = np.exp(lp[index][v] - mu)
            value[index] += rho * d[index][v] / len(cands)
            grad[index] += rho * d[index][v] * (np.eye(V)[v] - p[index]) / len(cands)
    return value, grad


def group_advantages(rewards, group_size, normalize_std=True, eps=1e-6, ddof=1):
    """Loop over groups: r − mean, divided by (std + eps) when normalize_std (std over G − ddof);
    a group of one keeps its raw reward (mean 0, std 1)."""
    rewards = np.asarray(rewards, np.float64)
    out = np.empty_like(rewards)
    for start in range(0, len(rewards), group_size):
        g = rewards[start : start + group_size]
        mean, std = (0.0, 1.0) if group_size == 1 else (g.mean(), g.std(ddof=ddof))
        out[start : start + group_size] = (g - mean) / (std + eps) if normalize_std else g - mean
    return out


def aggregate(values, mask, mode, horizon=None):
    """The aggregation modes, row by row (rows with no valid token are left out of the
    sequence counts)."""
    values, mask = np.asarray(values, np.float64), np.asarray(mask, np.float64)
    rows = [(v[m != 0] * m[m != 0]).sum() for v, m in zip(values, mask)]
    counts = mask.sum(-1)
    sequences = int((counts > 0).sum())
    if mode == "token-mean":
        return sum(rows) / max(counts.sum(), 1.0)
    if mode == "seq-mean-token-mean":
        return sum(r / c for r, c in zip(rows, counts) if c > 0) / max(sequences, 1)
    if mode == "seq-mean-token-sum":
        return sum(rows) / max(sequences, 1)
    if mode == "seq-mean-token-sum-norm":
        return sum(rows) / max(sequences * (mask.shape[-1] if horizon is None else horizon), 1)
    raise ValueError(mode)


def gspo(logp, behavior_logp, adv, mask, low, high, level):
    """Per-token GSPO loss and the gradient of its masked sum w.r.t. logp, row by row."""
    logp, behavior_logp, adv = (np.asarray(x, np.float64) for x in (logp, behavior_logp, adv))
    mask = np.asarray(mask, np.float64)
    loss, grad = np.zeros_like(logp), np.zeros_like(logp)
    for b in range(logp.shape[0]):
        m = mask[b]
        n = max(m.sum(), 1.0)
        s = np.exp(np.sum(m * (logp[b] - behavior_logp[b])) / n)
        unclipped, clipped = -adv[b] * s, -adv[b] * np.clip(s, low, high)
        loss[b] = np.where(m != 0, np.maximum(unclipped, clipped), 0.0)
        active = (m != 0) & (unclipped >= clipped) & ~((s < low) & (adv[b] < 0)) & ~((s > high) & (adv[b] > 0))
        if level == "sequence":  # every active token's loss moves with every token of the row
            grad[b] = m / n * np.sum(np.where(active, -adv[b] * s, 0.0))
        else:
            grad[b] = np.where(active, -adv[b] * s, 0.0)
    return loss, grad
