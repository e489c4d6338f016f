"""The learner stage: the student's train state on the learner's mesh and the steps that
train it on rollout batches.

Built from the config and the layout like every other stage (:mod:`asyncopd_jax.pipeline.stage`):
the student's weights are read from disk straight into their shardings on the learner's
devices (never whole on one device first), and the optimizer state is created there by a
jitted ``init`` whose outputs are sharded the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from asyncopd_jax.config import RunConfig
from asyncopd_jax.learner import (
    LearnerBatch,
    PolicyLoss,
    batch_shardings,
    create_train_state,
    distributed,
    make_mesh,
    make_optimizer,
    make_packed_train_step,
    make_proximal_fn,
    make_train_step,
)
from asyncopd_jax.learner.optimizer import learning_rate_schedule
from asyncopd_jax.learner.sharding import put
from asyncopd_jax.pipeline.placement import Layout
from asyncopd_jax.pipeline.stage import RunModels, load_model, stage_devices
from asyncopd_jax.pipeline.staleness import RolloutGroup


def _concat(items: list) -> Any:
    return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs, axis=0), *items)


def _rows(tree: Any, start: int, stop: int) -> Any:
    return jax.tree_util.tree_map(lambda x: x[start:stop], tree)


class LearnerStage:
    """The student's train state, its train step and the π_prox pass, on the learner's mesh."""

    def __init__(self, cfg: RunConfig, layout: Layout, models: RunModels, multi_process: bool):
        learner = cfg.learner
        self.cfg, self.multi_process = cfg, multi_process
        # A learner over several processes is one global mesh over every process's devices.
        devices = jax.devices() if multi_process else stage_devices(layout, layout.learner, jax.local_devices())
        self.mesh = make_mesh(learner.mesh, devices)
        self.optimizer = make_optimizer(cfg.optim, cfg.train.steps)
        self.lr = learning_rate_schedule(cfg.optim, cfg.train.steps)
        student = load_model(cfg.student, models.vocab_limit, self.mesh)
        self.graphdef, self.state = create_train_state(student, self.optimizer, self.mesh)
        self.loss = PolicyLoss.from_config(cfg)
        if learner.token_budget:  # dynamic batching (one learner process: RunConfig.check_learner_processes)
            self.train_step = make_packed_train_step(
                self.graphdef,
                self.optimizer,
                self.loss,
                token_budget=learner.token_budget,
                bucket=learner.token_bucket,
                mesh=self.mesh,
                state_example=self.state,
            )
        else:
            self.train_step = make_train_step(
                self.graphdef,
                self.optimizer,
                self.loss,
                micro_batches=learner.micro_batches,
                mesh=self.mesh,
                state_example=self.state,
            )
        self.proximal = make_proximal_fn(self.graphdef, self.loss, self.mesh) if self.loss.needs_proximal else None

    @property
    def version(self) -> int:
        """The policy version: optimizer steps taken."""
        return int(self.state.step)

    def mini_batches(self, groups: list[RolloutGroup]) -> list[LearnerBatch]:
        """A rollout batch's mini-batches, on the learner's devices (each process's own rows
        of them for a learner over several processes), with π_prox where the estimator
        needs it (the weights before the batch's first step)."""
        cfg = self.cfg
        batch = _concat([g.batch for g in groups])
        cache = _concat([g.cache for g in groups]) if groups[0].cache is not None else None  # None: RL, β = 0
        rows = cfg.learner.batch_size // cfg.learner.mini_batches
        minis = [
            LearnerBatch(_rows(batch, m * rows, (m + 1) * rows), _rows(cache, m * rows, (m + 1) * rows))
            for m in range(cfg.learner.mini_batches)
        ]
        if self.multi_process:  # this process feeds its own rows of each mini-batch
            share = distributed.process_rows(rows)
            minis = [distributed.global_batch(_rows(mini, share.start, share.stop), self.mesh) for mini in minis]
        else:  # from the devices that scored them (or the host) onto the learner's
            minis = [put(mini, batch_shardings(mini, self.mesh)) for mini in minis]
        if self.proximal is not None:
            minis = [dataclasses.replace(m, proximal=self.proximal(self.state.params, m)) for m in minis]
        return minis

    def step(self, mini: LearnerBatch) -> dict[str, float]:
        """One optimizer step; its metrics on the host."""
        self.state, metrics = self.train_step(self.state, mini)
        return {k: float(v) for k, v in jax.device_get(metrics).items()}

    def rows_per_step(self) -> int:
        return self.cfg.learner.batch_size // self.cfg.learner.mini_batches


def batch_stats(groups: list[RolloutGroup], version: int) -> dict[str, Any]:
    """A rollout batch's metrics at learner ``version``: the mean, max and histogram of its
    token staleness, and the mean reward of its rollouts (where the task can check them)."""
    ages = np.concatenate(
        [version - np.asarray(g.batch.token_version)[np.asarray(g.batch.response_mask)] for g in groups]
    )
    stats: dict[str, Any] = {
        "staleness_mean": float(ages.mean()) if ages.size else 0.0,
        "staleness_max": int(ages.max()) if ages.size else 0,
        "staleness_hist": np.bincount(np.maximum(ages, 0)).tolist() if ages.size else [],
    }
    rewards = np.concatenate(
        [np.zeros(0, np.float32)] + [np.asarray(g.rewards, np.float32) for g in groups if g.rewards is not None]
    )
    if np.isfinite(rewards).any():  # NaN: a response the task cannot check (no reference answers)
        stats["rollout_accuracy"] = float(np.nanmean(rewards))
    waits = [g.teacher_wait_s for g in groups if g.teacher_wait_s is not None]
    if waits:  # a served teacher: the seconds its scoring of this batch waited to retry the server
        stats["teacher_wait_s"] = float(sum(waits))
    return stats
