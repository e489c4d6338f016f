"""The learner stage: the student's train state on the learner's mesh and the steps that
train it on rollout batches.

Built from the config and the layout like every other stage (:mod:`asyncopd_jax.pipeline.compose`):
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
from jax.sharding import NamedSharding, PartitionSpec

from asyncopd_jax.config import RunConfig
from asyncopd_jax.estimators.spans import in_spans
from asyncopd_jax.learner import (
    LearnerBatch,
    PolicyLoss,
    batch_shardings,
    create_train_state,
    distributed,
    make_mesh,
    make_packed_train_step,
    make_proximal_fn,
    make_train_step,
    run_optimizer,
)
from asyncopd_jax.learner.optimizer import learning_rate_schedule
from asyncopd_jax.learner.sharding import put
from asyncopd_jax.pipeline.devices import stage_devices
from asyncopd_jax.pipeline.episode_stats import episode_stats
from asyncopd_jax.pipeline.layout import Layout
from asyncopd_jax.pipeline.model_loading import load_student
from asyncopd_jax.pipeline.run_models import RunModels
from asyncopd_jax.pipeline.run_teachers import teacher_head
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
        self.mesh = make_mesh(learner.mesh, stage_devices(layout, layout.learner, multi_process))
        self.optimizer = run_optimizer(cfg)
        self.lr = learning_rate_schedule(cfg.optim, cfg.train.steps)
        student = load_student(cfg, models.vocab_limit, self.mesh)
        self.graphdef, self.state = create_train_state(student, self.optimizer, self.mesh)
        self.loss = PolicyLoss.from_config(cfg, self._teacher_heads(cfg, models))
        if learner.token_budget:  # dynamic batching (one learner process: RunConfig.check_learner_processes)
            self.train_step = make_packed_train_step(
                self.graphdef,
                self.optimizer,
                self.loss,
                token_budget=learner.token_budget,
                bucket=learner.token_bucket,
                mesh=self.mesh,
                state_example=self.state,
                dropout_seed=cfg.dropout_seed,
            )
        else:
            self.train_step = make_train_step(
                self.graphdef,
                self.optimizer,
                self.loss,
                micro_batches=learner.micro_batches,
                mesh=self.mesh,
                state_example=self.state,
                dropout_seed=cfg.dropout_seed,
            )
        self.proximal = make_proximal_fn(self.graphdef, self.loss, self.mesh) if self.loss.needs_proximal else None

    def _teacher_heads(self, cfg: RunConfig, models: RunModels) -> tuple[jax.Array, ...]:
        """Each teacher's LM head, in the run's order, replicated on the learner's mesh, where
        the estimator reads the teachers' hidden states (:func:`teacher_head`: not the
        teachers), padded with zero rows to the cache's hidden width."""
        if not cfg.estimator.spec.needs_teacher_hidden:
            return ()
        width, heads = models.hidden_width(cfg), []
        for teacher in cfg.teacher_sources:
            head = teacher_head(teacher, models.vocab_limit)
            head = np.pad(head, ((0, width - head.shape[0]), (0, 0)))
            heads.append(jax.device_put(head, NamedSharding(self.mesh, PartitionSpec())))
        return tuple(heads)

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
    token staleness, the mean reward of its rollouts (where the task can check them), and
    the newest weights loaded for it with the seconds that load took (``snapshot_load_*``),
    and, from a spool, the indices of its groups (``groups``)."""
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
    learned = [int(g.record) for g in groups if g.record is not None]
    if learned:  # stage processes: the spool indices of the groups learned (each once in a run)
        stats["groups"] = learned
    loads = [g.last_load for g in groups if g.last_load is not None]
    if loads:  # the newest weights a stage loaded for this batch, and how long that load took
        stats["snapshot_load_version"], stats["snapshot_load_s"] = max(loads)
    stats.update(teacher_stats(groups))
    stats.update(episode_stats(groups))  # multi-turn: turns, tool calls, errors, observation tokens
    return stats


def teacher_stats(groups: list[RolloutGroup]) -> dict[str, float]:
    """Each teacher's share of a batch: ``teacher/NAME/rows``, ``…/score_s`` (its scoring's
    wall time), ``…/requests``, ``…/kl`` (E[log μ − log q] over its rows' sampled tokens: the
    behaviour policy's reverse KL to it, estimated, over the rows whose scores are finite; a
    teacher of another tokenizer: the sum over its spans, per student token, and
    ``…/unscored_tokens``, the answer tokens in no span it scored), and for a served teacher
    ``…/wait_s``
    (seconds waited to retry it), summed over all of them in ``teacher_wait_s``."""
    stats: dict[str, float] = {}
    names = list(dict.fromkeys(name for g in groups for name in g.teacher_uses))
    gap = {name: [0.0, 0] for name in names}  # Σ (log μ − log q) over the teacher's tokens, and their count
    unscored = dict.fromkeys(names, 0)  # a teacher of another tokenizer: answer tokens in no span it scored
    spans = False
    for g in groups:
        if g.cache is None:
            continue
        mask = np.asarray(g.batch.response_mask, bool)
        behavior, teacher_logp = np.asarray(g.batch.behavior_logp), np.asarray(g.cache.token_logp, np.float32)
        in_span = mask
        if g.cache.span_end is None:
            ratio = np.where(mask, behavior - teacher_logp, 0.0)
        else:  # a teacher of another tokenizer: log q of each span on its end, μ's over the tokens of scored spans
            spans = True
            ends = np.asarray(g.cache.span_end, bool) & mask
            in_span = mask & np.asarray(in_spans(ends))
            ratio = np.where(in_span, behavior, 0.0) - np.where(ends, teacher_logp, 0.0)
        finite = np.isfinite(ratio).all(axis=1)  # a row with a non-finite score is dropped by the learner: here too
        teacher = np.zeros(g.size, np.int32) if g.route is None else g.route.teacher
        for k, name in enumerate(g.teacher_uses):
            rows = (teacher == k) & finite
            gap[name][0] += float(ratio[rows].sum())
            gap[name][1] += int(mask[rows].sum())
            unscored[name] += int((mask & ~in_span)[teacher == k].sum())
    waits = []
    for name in names:
        uses = [g.teacher_uses[name] for g in groups if name in g.teacher_uses]
        stats[teacher_metric(name, "rows")] = float(sum(u.rows for u in uses))
        stats[teacher_metric(name, "score_s")] = float(sum(u.seconds for u in uses))
        stats[teacher_metric(name, "requests")] = float(sum(u.requests for u in uses))
        if gap[name][1]:
            stats[teacher_metric(name, "kl")] = gap[name][0] / gap[name][1]
        if spans:
            stats[teacher_metric(name, "unscored_tokens")] = float(unscored[name])
        served = [u.wait_s for u in uses if u.wait_s is not None]
        if served:
            stats[teacher_metric(name, "wait_s")] = float(sum(served))
            waits += served
    if waits:  # the seconds the batch's scoring waited to retry teacher servers
        stats["teacher_wait_s"] = float(sum(waits))
    return stats


def teacher_metric(name: str, what: str) -> str:
    """The metrics record's key of teacher ``name``'s ``what`` (rows, score_s, requests, kl, unscored_tokens,
    wait_s)."""
    return f"teacher/{name}/{what}"


def teacher_names(record_or_records: dict[str, Any] | list[dict[str, Any]]) -> list[str]:
    """The teachers a metrics record (or any of several) reports on, in the run's order."""
    records = record_or_records if isinstance(record_or_records, list) else [record_or_records]
    keys = dict.fromkeys(key for r in records for key in r)
    return [key.split("/")[1] for key in keys if key.startswith("teacher/") and key.endswith("/rows")]
