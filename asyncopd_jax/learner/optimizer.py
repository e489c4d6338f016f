"""AdamW with global-norm clipping and a warm-up / decay schedule counted in optimizer steps;
for a LoRA student, LoRA+'s faster rate on the adapters' ``B``."""

from __future__ import annotations

import jax
import optax

from asyncopd_jax.config import OptimConfig, RunConfig


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


def scale_adapter_b(ratio: float) -> optax.GradientTransformation:
    """Multiply the updates of every adapter's ``B`` (a leaf under a ``lora_b`` key) by
    ``ratio``, the rest unchanged: placed after AdamW, ``B`` learns at ``ratio`` × its
    learning rate, decoupled weight decay included (LoRA+, Hayou et al., 2024: with ``B``
    starting at zero, equal rates leave ``B`` learning too slowly as the width grows)."""

    def is_b(path: tuple) -> bool:
        return any(getattr(key, "key", None) == "lora_b" for key in path)

    def scale(updates: optax.Updates, params: optax.Params | None = None) -> optax.Updates:
        del params
        return jax.tree_util.tree_map_with_path(lambda path, u: u * ratio if is_b(path) else u, updates)

    return optax.stateless(scale)


def make_optimizer(cfg: OptimConfig, total_steps: int, loraplus_lr_ratio: float = 1.0) -> optax.GradientTransformation:
    """``clip_by_global_norm(grad_clip) → adamw(schedule)``, then (``loraplus_lr_ratio`` ≠ 1)
    :func:`scale_adapter_b`."""
    adamw = optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay)
    chain = [optax.clip_by_global_norm(cfg.grad_clip), adamw]
    if loraplus_lr_ratio != 1:
        chain.append(scale_adapter_b(loraplus_lr_ratio))
    return optax.chain(*chain)


def run_optimizer(cfg: RunConfig) -> optax.GradientTransformation:
    """The optimizer of a run's learner (and of its plan): ``optim`` over ``train.steps``,
    with the student's ``lora.loraplus_lr_ratio``."""
    return make_optimizer(cfg.optim, cfg.train.steps, cfg.student.lora.loraplus_lr_ratio)
