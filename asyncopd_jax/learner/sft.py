"""Supervised fine-tuning: the same train step with the negative log-likelihood loss."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from flax import nnx

from asyncopd_jax.config import OptimConfig
from asyncopd_jax.learner.optimizer import make_optimizer
from asyncopd_jax.learner.step import LearnerBatch, SFTLoss, create_train_state, make_train_step
from asyncopd_jax.models.decoder import Decoder


def train_sft(
    model: Decoder,
    batches: Iterator,
    steps: int,
    optim: OptimConfig,
    *,
    on_step: Callable[[int, dict, nnx.GraphDef, nnx.State], None] | None = None,
) -> Decoder:
    """Train ``model`` for ``steps`` optimizer steps on ``batches`` of RolloutBatch; return it.

    ``on_step(step, metrics, graphdef, params)`` is called after every step (logging, eval).
    """
    optimizer = make_optimizer(optim, steps)
    graphdef, state = create_train_state(model, optimizer)
    train_step = make_train_step(graphdef, optimizer, SFTLoss())
    start = time.perf_counter()
    for step in range(1, steps + 1):
        state, metrics = train_step(state, LearnerBatch(next(batches)))
        if on_step is not None:
            on_step(
                step,
                {**{k: float(v) for k, v in metrics.items()}, "seconds": time.perf_counter() - start},
                graphdef,
                state.params,
            )
    return nnx.merge(graphdef, state.params)
