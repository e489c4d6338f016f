"""What the peers (verl, AReaL, Tunix) compute, stated as formulas and written here as NumPy
(float64) oracles for the parity tests in ``tests/estimators/test_peers.py``.

No peer code is reproduced: each function is our own statement of one peer function's
documented behaviour, the formula in its docstring, with the file, commit and function name
it was read from. The peers (all Apache-2.0):

* verl, github.com/verl-project/verl: ``verl/trainer/ppo/core_algos.py`` @
  018f23b5f83a13340421349e40ec42530739b23a and ``verl/utils/torch_functional.py`` @
  0db13434d04637f539356a9c43209387ed3894a4 (the same definition is at 018f23b5…).
* AReaL, github.com/inclusionAI/AReaL: ``areal/engine/ppo/actor.py`` @
  00d07c047ebfbb3fc2a3581d656f6cca07eeef1a (the same rule is in ``areal/trainer/ppo/actor.py``
  @ 4aef98d8d818af55b43621aaadba047ae10f4e77, after the module moved).
* Tunix, github.com/google/tunix: ``tunix/distillation/strategies/logit.py`` @
  3e29dc2adcb3b3a75db508f06642817d4b452415 (the commit that added ``distill_top_k``; the
  file is unchanged at c7d8950f12a9c55a976bf2e1a0d8b447d71c20b3).
"""

from __future__ import annotations

import numpy as np

from tests.estimators.oracle import log_softmax


def verl_agg_loss(
    values,
    mask,
    mode: str,
    *,
    dp_size: int = 1,
    global_tokens: float | None = None,
    global_sequences: float | None = None,
    horizon: float | None = None,
) -> float:
    """One data-parallel rank's loss under verl's ``loss_agg_mode`` (``agg_loss`` in
    ``verl/trainer/ppo/core_algos.py`` @ 018f23b5f83a13340421349e40ec42530739b23a).

    With x the rank's per-token losses, m its mask, n_i = Σ_t m_it the tokens of row i,
    D = ``dp_size``, N_tok the number of tokens and N_seq the number of rows with n_i > 0
    (the global batch's counts when passed, else the rank's own):

        token-mean                D · Σ_it m·x / N_tok
        seq-mean-token-sum        D · Σ_{i: n_i > 0} Σ_t m·x / N_seq
        seq-mean-token-sum-norm   the line above / H   (H = ``loss_scale_factor``, default T)
        seq-mean-token-mean       D · Σ_{i: n_i > 0} [Σ_t m·x / (n_i + 1e-8)] / N_seq

    (T is the width of the rank's mask.) DDP / FSDP average the ranks' gradients: the factor D
    and the global counts make that average the gradient of the global batch's loss, so the
    global loss is the mean over ranks of these values. verl's fifth mode, ``token-sum``, is
    not one of ours and is left out.
    """
    x = np.asarray(values, np.float64)
    m = np.asarray(mask, np.float64)
    row_totals = np.einsum("bt,bt->b", m, x)
    row_tokens = m.sum(axis=-1)
    if mode == "token-mean":
        n_tok = row_tokens.sum() if global_tokens is None else global_tokens
        return float(dp_size * row_totals.sum() / n_tok)
    live = row_tokens > 0
    n_seq = np.count_nonzero(live) if global_sequences is None else global_sequences
    if mode == "seq-mean-token-mean":
        per_row = row_totals / (row_tokens + 1e-8)
    elif mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        per_row = row_totals
    else:
        raise ValueError(f"not a mode stated here: {mode}")
    loss = dp_size * per_row[live].sum() / n_seq
    if mode == "seq-mean-token-sum-norm":
        loss /= m.shape[-1] if horizon is None else horizon
    return float(loss)


def verl_grpo_advantages(token_rewards, response_mask, group_ids, *, normalize_std: bool = True, eps: float = 1e-6):
    """verl's GRPO outcome advantage (``compute_grpo_outcome_advantage`` in
    ``verl/trainer/ppo/core_algos.py`` @ 018f23b5f83a13340421349e40ec42530739b23a).

    A response's score is the sum of its token rewards, s_i = Σ_t r_it. Rows are grouped by
    their id (any labels, in any order). A group of one has mean 0 and std 1; a larger group
    of n has the mean s̄ and the *unbiased* std σ = √(Σ (s − s̄)² / (n − 1)) (``torch.std``'s
    default). Then

        A_i = (s_i − s̄) / (σ + ε)    (ε = 1e-6, added to σ outside the square root)
        A_i = s_i − s̄                (``norm_adv_by_std_in_grpo=False``: Dr. GRPO)

    and every token of row i gets A_i times its response mask. Returns ``[B, T]``.
    """
    scores = np.asarray(token_rewards, np.float64).sum(axis=-1)
    _, group, sizes = np.unique(np.asarray(group_ids), return_inverse=True, return_counts=True)
    group = group.ravel()
    alone = sizes == 1
    means = np.where(alone, 0.0, np.bincount(group, weights=scores) / sizes)
    centred = scores - means[group]
    spread = np.sqrt(np.bincount(group, weights=centred**2) / np.maximum(sizes - 1, 1))
    stds = np.where(alone, 1.0, spread)
    advantage = centred / (stds[group] + eps) if normalize_std else centred
    return advantage[:, None] * np.asarray(response_mask, np.float64)


def verl_gspo(logp, old_logp, advantages, mask, clip_low: float, clip_high: float) -> tuple[float, np.ndarray]:
    """verl's GSPO loss and its gradient in log π_θ (``compute_policy_loss_gspo`` in
    ``verl/trainer/ppo/core_algos.py`` @ 018f23b5f83a13340421349e40ec42530739b23a).

    Row i's mean log-ratio ℓ_i = Σ_t m_it (log π_θ − log π_old)_it / max(n_i, 1) gives the
    sequence ratio, carried by every token as GSPO-token's
    log s_it = sg[ℓ_i] + log π_θ,t − sg[log π_θ,t], clamped to at most 10 (no lower clamp):
    value s_i = exp(min(ℓ_i, 10)). The per-token loss is

        L_it = max(−A_it s_i, −A_it clip(s_i, 1 − ε_low, 1 + ε_high))

    aggregated by ``seq-mean-token-mean`` (:func:`verl_agg_loss`, one rank) whatever
    ``loss_agg_mode`` is passed. Gradient: L_it depends on log π_θ,t alone (the sequence
    ratio is stop-gradient), ∂L_it/∂log π_θ,t = −A_it s_i when the unclipped term is the
    max (torch splits a tie between the two terms and the clamp passes its share inside the
    range, so a ratio inside the range gets the whole) and ℓ_i ≤ 10, else 0; the aggregation
    weighs it by m_it / (n_i + 1e-8) / N_seq.
    """
    lp, old, adv, m = (np.asarray(a, np.float64) for a in (logp, old_logp, advantages, mask))
    n = m.sum(axis=-1, keepdims=True)
    ell = np.sum(m * (lp - old), axis=-1, keepdims=True) / np.maximum(n, 1.0)
    ratio = np.exp(np.minimum(ell, 10.0))
    unclipped = -adv * ratio
    clipped = -adv * np.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    value = verl_agg_loss(np.maximum(unclipped, clipped), m, "seq-mean-token-mean")
    slope = np.where((unclipped >= clipped) & (ell <= 10.0), unclipped, 0.0)
    grad = slope * m / (n + 1e-8) / np.count_nonzero(n > 0)
    return value, grad


def verl_kl_penalty(logp, ref_logp, kind: str) -> np.ndarray:
    """verl's KL-to-reference estimators (``kl_penalty_forward`` in
    ``verl/trainer/ppo/core_algos.py`` @ 018f23b5f83a13340421349e40ec42530739b23a),
    Schulman's k1 / k2 / k3 of KL(π_θ ‖ π_ref) with d = log π_θ − log π_ref:

        "kl" / "k1"           d
        "mse" / "k2"          d² / 2
        "low_var_kl" / "k3"   clamp(e^u − u − 1, −10, 10),  u = clamp(−d, −20, 20)

    (e^u − u − 1 ≥ 0, so only the upper clamp at 10 can act.)
    """
    d = np.asarray(logp, np.float64) - np.asarray(ref_logp, np.float64)
    if kind in ("kl", "k1"):
        return d
    if kind in ("mse", "k2"):
        return 0.5 * d**2
    if kind in ("low_var_kl", "k3"):
        u = np.clip(-d, -20.0, 20.0)
        return np.clip(np.expm1(u) - u, -10.0, 10.0)
    raise ValueError(f"not an estimator stated here: {kind}")


def verl_entropy(logits) -> np.ndarray:
    """verl's entropy of the softmax over the last axis (``entropy_from_logits`` in
    ``verl/utils/torch_functional.py`` @ 0db13434d04637f539356a9c43209387ed3894a4):
    logsumexp(z) − Σ_v softmax(z)_v z_v, which is H(p) = −Σ_v p_v log p_v, p = softmax(z)."""
    log_p = log_softmax(np.asarray(logits, np.float64))
    return -np.sum(np.exp(log_p) * log_p, axis=-1)


def areal_m2po_mask(old_logp, prox_logp, loss_mask, threshold: float) -> np.ndarray:
    """AReaL's M2PO token mask (``_apply_m2po_masking`` with ``_get_m2po_loss_mask`` in
    ``areal/engine/ppo/actor.py`` @ 00d07c047ebfbb3fc2a3581d656f6cca07eeef1a).

    Over the valid tokens of the arrays it is given (in AReaL's actor: one micro-batch on
    one rank), δ = log π_old − log π_prox. With the n values δ² in ascending order
    v_(1) ≤ … ≤ v_(n), the tokens kept are those of the k smallest, for the largest k with

        (1/k) Σ_{j ≤ k} v_(j) < τ        (strict)

    and k = 1 when no k qualifies (at least one token, the smallest δ², is always kept).
    Everything else is masked, invalid tokens included; with no valid token the mask is
    returned as it was. (AReaL orders equal δ² as ``torch.sort`` does; here the earlier
    position, row-major, ranks first: the tests use values without ties at the cut.)
    """
    sq = np.square(np.asarray(old_logp, np.float64) - np.asarray(prox_logp, np.float64)).ravel()
    valid = np.asarray(loss_mask).astype(bool)
    if not valid.any():
        return valid.copy()
    where = np.flatnonzero(valid.ravel())
    order = np.argsort(sq[where], kind="stable")
    prefix_means = np.cumsum(sq[where][order]) / np.arange(1, where.size + 1)
    qualifying = np.flatnonzero(prefix_means < threshold)
    kept = qualifying[-1] + 1 if qualifying.size else 1
    keep = np.zeros(sq.size, bool)
    keep[where[order[:kept]]] = True
    return keep.reshape(valid.shape)


def tunix_top_k_distillation(student_logits, teacher_logits, top_k: int, temperature: float) -> float:
    """Tunix's logit-distillation term with ``distill_top_k`` (``LogitStrategy.compute_loss``
    in ``tunix/distillation/strategies/logit.py`` @ 3e29dc2adcb3b3a75db508f06642817d4b452415,
    ``alpha = 1``, which leaves out the task cross-entropy).

    At each position, S = the ids of the teacher's K largest logits; both distributions are
    softened by T and renormalised over S,

        q = softmax(t_S / T),  p = softmax(s_S / T),  KL(q ‖ p) = Σ_{v∈S} q_v (log q_v − log p_v)

    (``optax.kl_divergence(log p, q)``), and the loss is the mean over every position of
    T² · KL(q ‖ p) (Hinton et al.'s T² scaling).
    """
    t = np.asarray(teacher_logits, np.float64)
    s = np.asarray(student_logits, np.float64)
    support = np.argsort(-t, axis=-1, kind="stable")[..., :top_k]
    log_q = log_softmax(np.take_along_axis(t, support, axis=-1) / temperature)
    log_p = log_softmax(np.take_along_axis(s, support, axis=-1) / temperature)
    per_position = np.sum(np.exp(log_q) * (log_q - log_p), axis=-1)
    return float(np.mean(temperature**2 * per_position))
