"""What one stage process computes: a rollout group from a ticket, or teacher scores.

Built from the run's config and the exchange layout (see
:mod:`asyncopd_jax.pipeline.processes`) with the same pieces the threads placement uses:
:class:`~asyncopd_jax.pipeline.rollout.GroupProducer` samples from the newest
snapshot, :func:`~asyncopd_jax.pipeline.rollout.score_group` fills in the teacher's cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from flax import nnx

from asyncopd_jax.config import RunConfig
from asyncopd_jax.models import from_pretrained, load_tokenizer
from asyncopd_jax.pipeline.reward_stage import RewardStage
from asyncopd_jax.pipeline.rollout import GroupProducer, make_scorers, score_group
from asyncopd_jax.pipeline.snapshots import DiskSnapshotStore
from asyncopd_jax.pipeline.spool import group_from_record, group_to_record
from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.sampling import Sampler
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.tasks.prompt_task import PromptTask, make_task


def stop_token_ids(cfg: RunConfig, data: PromptTask, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The sampler stops at the tokenizer's EOS and at every EOS id of the model's config."""
    return tuple(dict.fromkeys((*cfg.sampling.stop_token_ids, data.eos_id, *eos_token_ids)))


class StageWorker:
    """``process(record) → record`` for the ``rollout`` or ``scoring`` role."""

    def __init__(self, cfg: RunConfig, layout: dict[str, Any], role: str, tracer: Tracer):
        self.role, self.seed, self.tracer = role, int(layout["seed"]), tracer
        scores_here = role == "scoring" or not layout["scoring_processes"]
        self.scorer = None
        if scores_here:
            teacher = None
            if cfg.needs_teacher_scores:
                teacher = from_pretrained(resolve_model_path(cfg.teacher.path), dtype=cfg.teacher.dtype)
                teacher.vocab_limit = layout["vocab_limit"]  # the learner's (Trainer: shared_vocab_size)
            self.scorer = make_scorers(cfg, teacher, layout["vocab_limit"])
        self.producer = None
        if role == "rollout":
            directory = resolve_model_path(cfg.student.path)
            student = from_pretrained(directory, dtype=cfg.student.dtype)
            student.vocab_limit = layout["vocab_limit"]
            data = make_task(cfg.task, load_tokenizer(directory), max_new_tokens=cfg.sampling.max_new_tokens,
                             max_positions=student.config.max_position_embeddings)
            graphdef, params = nnx.split(student)
            sampling = dataclasses.replace(cfg.sampling,
                                           stop_token_ids=stop_token_ids(cfg, data, student.config.eos_token_ids))
            snapshots = DiskSnapshotStore(layout["snapshots"], params, read_only=True,
                                          format=layout["snapshot_format"])
            snapshots.wait_for(0, timeout=cfg.stages.startup_timeout)
            self.producer = GroupProducer(
                sampler=Sampler(graphdef, sampling, pad_id=data.pad_id), snapshots=snapshots,
                prompts=data.train_prompts, reward=RewardStage.from_config(cfg, data.rewards), group_size=int(layout["group_size"]),
                seed=self.seed, prompt_slots=data.prompt_slots, tracer=tracer,
            )

    def process(self, record: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.role == "rollout":
            index = int(record["index"])
            group = self.producer.sample(index)
        else:
            group, index = group_from_record(record)
        if self.scorer is not None:
            group = score_group(self.scorer, group, self.seed, index, self.tracer)
        return group_to_record(group, index)
