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


def m2po_tau(logp, behavior_logp, adv, mask, budget):
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


def group_advantages(rewards, group_size, normalize_std=True, eps=1e-6):
    """Loop over groups: r − mean, divided by (population std + eps) when normalize_std."""
    rewards = np.asarray(rewards, np.float64)
    out = np.empty_like(rewards)
    for start in range(0, len(rewards), group_size):
        g = rewards[start:start + group_size]
        a = g - g.mean()
        out[start:start + group_size] = a / (g.std() + eps) if normalize_std else a
    return out
