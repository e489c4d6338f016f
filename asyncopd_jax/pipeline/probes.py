"""What the learner measures besides its loss: the study diagnostics (exact KLs on a
fixed probe set), the update geometry, and EffOPD's extrapolation with its probe.

Each is off unless its config field turns it on; the trainer calls :meth:`Probes.after_step`.
The teacher a probe needs is the scoring stage's when it shares the learner's process;
otherwise it is loaded onto the learner's devices for the probe alone.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from asyncopd_jax.config import RunConfig
from asyncopd_jax.learner import distributed, state_shardings
from asyncopd_jax.learner.extrapolation import Extrapolator
from asyncopd_jax.learner.update_geometry import update_geometry
from asyncopd_jax.models.lora import join, split_adapters
from asyncopd_jax.models.partitioning import parameter_shardings
from asyncopd_jax.pipeline.diagnostics import ProbeDiagnostics
from asyncopd_jax.pipeline.learner_stage import LearnerStage
from asyncopd_jax.pipeline.model_loading import load_model
from asyncopd_jax.pipeline.run_models import RunModels
from asyncopd_jax.pipeline.scoring_stage import ScoringStage
from asyncopd_jax.pipeline.snapshots import SnapshotStore
from asyncopd_jax.pipeline.trace import Tracer


class Probes:
    """Diagnostics, update geometry and EffOPD extrapolation of one run."""

    def __init__(
        self,
        cfg: RunConfig,
        models: RunModels,
        learner: LearnerStage,
        teacher: Callable[[], Any],
        leader: bool,
        tracer: Tracer,
    ):
        self.cfg, self.models, self.learner, self.leader, self.tracer = cfg, models, learner, leader, tracer
        self.diagnostics: ProbeDiagnostics | None = None
        if cfg.train.diagnostics_every:  # with a teacher, one learner process (checked by RunConfig)
            prompts, _ = models.task.train_prompts(
                np.random.default_rng([cfg.seed, 2**31 - 1]), cfg.train.diagnostic_prompts
            )
            self.diagnostics = self._probe(teacher(), prompts, cfg.seed)
        self.extrapolation_probe: Callable[[nnx.State], float] | None = None
        if cfg.learner.extrapolation.enabled:  # EffOPD (after a resume, anchored at the restored weights)
            self.extrapolation_probe = self._extrapolation_probe(teacher)
        self.extrapolator: Extrapolator | None = None
        self.geometry_params: list[Any] = []

    @property
    def teacher_temperature(self) -> float:
        """The probed teacher's scoring temperature (its own, else ``scoring.temperature``)."""
        source = self.cfg.in_process_teacher
        return (source.scoring(self.cfg.scoring) if source is not None else self.cfg.scoring).temperature

    def _probe(self, teacher: Any, prompts: list[list[int]], seed: int) -> ProbeDiagnostics:
        return ProbeDiagnostics(
            graphdef=self.learner.graphdef,
            teacher=teacher,
            prompts=prompts,
            sampling=self.models.sampling,
            teacher_temperature=self.teacher_temperature,
            pad_id=self.models.task.pad_id,
            prompt_slots=self.models.task.prompt_slots,
            seed=seed,
        )

    def _extrapolation_probe(self, teacher: Callable[[], Any]) -> Callable[[nnx.State], float]:
        """EffOPD's probe: a score of the full parameters, higher is better (see
        :class:`asyncopd_jax.config.ExtrapolationConfig`)."""
        ext, seed, data = self.cfg.learner.extrapolation, self.cfg.seed, self.models.task
        prompts, items = data.train_prompts(np.random.default_rng([seed, 2**31 - 2]), ext.probe_prompts)
        if ext.probe_metric == "accuracy":
            return lambda params: data.accuracy(
                self.learner.graphdef, params, items=items, temperature=ext.probe_temperature, seed=seed
            )
        probe = self._probe(teacher(), prompts, seed + 1)
        return lambda params: -probe.measure(params, params)["probe_reverse_kl"]

    def start(self) -> None:
        """At the start of the loop (after a resume: from the restored weights)."""
        params = self.learner.state.params
        if self.extrapolation_probe is not None:
            # anchored on what is trained: a LoRA student's adapters (its base never moves)
            self.extrapolator = Extrapolator(split_adapters(params)[0], self.cfg.learner.extrapolation.factors)
        if self.cfg.train.update_geometry_every:  # θ_0 and θ_s of the update-geometry diagnostic, on the host
            self.geometry_params = [distributed.gather(params)] * 2

    def diagnose(self, step: int, steps: int, snapshots: SnapshotStore, behaviour: int) -> dict:
        """The diagnostics of a batch whose steps ``step + 1 .. step + steps`` include a
        multiple of ``train.diagnostics_every`` ({} otherwise), against the policy of
        version ``behaviour`` (from ``snapshots``, copied onto the learner's devices)."""
        every = self.cfg.train.diagnostics_every
        if self.diagnostics is None or not any(s % every == 0 for s in range(step, step + steps)):
            return {}
        params = self.learner.state.params
        with self.tracer.span("diagnostics"):
            behaviour_params = jax.device_put(snapshots.load(behaviour)[1], state_shardings(params, self.learner.mesh))
            probe = self.diagnostics.measure(params, behaviour_params)
        return {**probe, "probe_behaviour_version": behaviour}

    def extrapolate(self, step: int) -> dict[str, Any]:
        """EffOPD after optimizer step ``step``: at steps 1, 2, 4, … search the extrapolation
        candidates on the probe and continue from the one kept (parameters only: the
        optimizer state is untouched). Returns the jump's metrics ({} at other steps)."""
        probe = self.extrapolation_probe
        if self.extrapolator is None or probe is None:  # (the extrapolator exists only with a probe)
            return {}

        def score(params: nnx.State) -> float:  # computed by the leader, shared with every process
            full = distributed.gather(params)
            return distributed.from_leader(probe(full) if self.leader else 0.0)

        start = time.perf_counter()
        trained, frozen = split_adapters(self.learner.state.params)
        with self.tracer.span("extrapolate", step=step):
            trained, jump = self.extrapolator.after_update(step, trained, lambda t: score(join(t, frozen)))
        if jump is None:
            return {}
        self.learner.state = dataclasses.replace(self.learner.state, params=join(trained, frozen))
        return {
            **jump.metrics(),
            "extrapolation_tried": [list(t) for t in jump.tried],
            "extrapolation_seconds": time.perf_counter() - start,
        }

    def update_geometry(self, step: int) -> dict[str, Any]:
        """The update-geometry diagnostic of θ_t against θ_0 and the previous measurement θ_s."""
        every = self.cfg.train.update_geometry_every
        if not every or step % every:
            return {}
        current = distributed.gather(self.learner.state.params)  # every process: a collective over several
        initial, previous = self.geometry_params
        self.geometry_params = [initial, current]
        return {"update_geometry": update_geometry(initial, previous, current)}


def teacher_accuracies(cfg: RunConfig, models: RunModels, scoring: ScoringStage) -> dict[str, float]:
    """Each in-process teacher's held-out accuracy, by name, each through its own tokenizer."""
    return {name: models.teacher_task(cfg, name).accuracy(*nnx.split(m)) for name, m in scoring.models.items()}


def teacher_on(mesh: Mesh, cfg: RunConfig, models: RunModels, scoring: ScoringStage | None) -> nnx.Module:
    """The teacher on ``mesh`` (a probe's, beside the learner): the scoring stage's, copied
    device to device when it shares this process, else read from disk."""
    if scoring is not None and scoring.teacher is not None:
        graphdef, weights = nnx.split(scoring.teacher)
        return nnx.merge(graphdef, jax.device_put(weights, parameter_shardings(weights, mesh)))
    source = cfg.in_process_teacher
    assert source is not None, "a probe's teacher runs in-process (checked with the config)"
    return load_model(source, models.vocab_limit, mesh)
