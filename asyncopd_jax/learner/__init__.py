"""The learner: train state, sharded micro-batched (or token-budget packed) train step, losses, optimizer."""

from asyncopd_jax.learner import distributed
from asyncopd_jax.learner.faults import NonFiniteLoss, drop_nonfinite_rows, nonfinite_rows
from asyncopd_jax.learner.optimizer import learning_rate_schedule, make_optimizer, run_optimizer
from asyncopd_jax.learner.sharding import batch_shardings, make_mesh, state_shardings
from asyncopd_jax.learner.step import (
    LearnerBatch,
    PolicyLoss,
    SFTLoss,
    TrainState,
    create_train_state,
    make_packed_train_step,
    make_proximal_fn,
    make_train_step,
)

__all__ = [
    "LearnerBatch",
    "NonFiniteLoss",
    "PolicyLoss",
    "SFTLoss",
    "TrainState",
    "batch_shardings",
    "create_train_state",
    "distributed",
    "drop_nonfinite_rows",
    "learning_rate_schedule",
    "make_mesh",
    "make_optimizer",
    "run_optimizer",
    "make_packed_train_step",
    "make_proximal_fn",
    "make_train_step",
    "nonfinite_rows",
    "state_shardings",
]
