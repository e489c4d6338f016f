"""AdamW with global-norm clipping and a warm-up / decay schedule counted in optimizer steps."""

from __future__ import annotations

import optax

from asyncopd_jax.config import OptimConfig


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up to ``learning_rate`` over ``warmup_steps``, then constant, cosine or
    linear decay to ``final_lr_fraction · learning_rate`` at ``total_steps``."""
    peak, warmup = cfg.learning_rate, min(cfg.warmup_steps, max(total_steps - 1, 0))
    final = peak * cfg.final_lr_fraction
    decay_steps = max(total_steps - warmup, 1)
    if cfg.schedule == "constant":
        after = optax.constant_schedule(peak)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.final_lr_fraction)
    else:
        after = optax.linear_schedule(peak, final, decay_steps)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(peak / warmup, peak, warmup), after], [warmup])


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """``clip_by_global_norm(grad_clip) → adamw(schedule)``."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )
