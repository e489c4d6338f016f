"""The scoring stage: the teachers (and the reference policy) on the stage's own mesh.

:func:`build_scoring_stage` loads what the run scores onto the stage's devices: each
in-process teacher, a client of each served one, each wrapped to be aligned by spans when
its tokenizer differs from the student's (the kind of each teacher was resolved once, in
:class:`~asyncopd_jax.pipeline.run_models.RunTeacher`); :meth:`ScoringStage.score` moves a
rollout there and fills in its score cache, each row by the teacher its route names.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh

from asyncopd_jax.config import ConfigError, RunConfig, TeacherSource
from asyncopd_jax.config.rules import unserved_need
from asyncopd_jax.models import Decoder
from asyncopd_jax.models.partitioning import mesh_context
from asyncopd_jax.pipeline.devices import on_mesh, stage_devices, stage_mesh
from asyncopd_jax.pipeline.layout import Layout, StagePlan
from asyncopd_jax.pipeline.model_loading import load_model
from asyncopd_jax.pipeline.producer import group_key
from asyncopd_jax.pipeline.run_models import RunModels
from asyncopd_jax.pipeline.staleness import RolloutGroup
from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.teacher import ReferenceScorer, Scorers, TeacherScorer
from asyncopd_jax.teacher.byte_prefix_teacher import BytePrefixTeacher
from asyncopd_jax.teacher.client import ServedTeacher
from asyncopd_jax.teacher.cross_tokenizer import CrossTokenizerTeacher
from asyncopd_jax.teacher.prefix_trees import PrefixTrees
from asyncopd_jax.teacher.prefix_wire import ServedPrefixTrees
from asyncopd_jax.teacher.scorer import Teacher
from asyncopd_jax.teacher.wire import ServerError


@dataclasses.dataclass
class ScoringStage:
    """The teacher's score cache (and the reference's log-probs) on the stage's own mesh."""

    plan: StagePlan
    mesh: Mesh
    scorers: Scorers
    models: dict[str, Decoder]  # the in-process teachers' models, by name (for the probes and accuracy)

    @property
    def teacher(self) -> Decoder | None:
        """The run's only teacher when it runs in-process (what a probe reads), else None."""
        return next(iter(self.models.values())) if len(self.scorers.teachers) == 1 and self.models else None

    def score(self, group: RolloutGroup, seed: int, index: int, tracer: Tracer) -> RolloutGroup:
        """``group`` with its score cache (and reference log-probs) filled in, each row by
        the teacher its route names."""
        with tracer.span("score", group=index), mesh_context(self.mesh):
            batch = on_mesh(group.batch, self.mesh)
            scored = self.scorers.score(batch, jax.random.fold_in(group_key(seed, index), 1), group.route)
            jax.block_until_ready((scored.batch, scored.cache))
        return dataclasses.replace(group, batch=scored.batch, cache=scored.cache, teacher_uses=scored.uses)


def build_scoring_stage(cfg: RunConfig, layout: Layout, plan: StagePlan, models: RunModels) -> ScoringStage:
    """Load what ``cfg`` scores onto ``plan``'s devices: the teacher where the run needs its
    scores, the reference policy (``reference.path``, else the student's starting weights)
    where the loss has a KL-to-reference term."""
    mesh = stage_mesh(stage_devices(layout, plan), cfg.stages.scoring_mesh)
    teachers: dict[str, Teacher] = {}
    loaded: dict[str, Decoder] = {}  # the in-process teachers' models
    run_teachers = models.teachers if cfg.needs_teacher_scores else ()
    for run_teacher in run_teachers:
        source, pair = run_teacher.source, run_teacher.retokenizer  # pair: a teacher of another tokenizer
        params = dataclasses.replace(source.scoring(cfg.scoring), hidden_width=models.hidden_width(cfg))
        teacher: Teacher
        if source.served:
            # a teacher of another tokenizer: any id its server answers is mapped (one past its tokenizer,
            # an embedding row of padding, to no student token)
            vocab = np.iinfo(np.int32).max if pair else models.vocab_limit or models.student_config.vocab_size
            teacher = ServedTeacher(source.server, params, vocab)
            probe_ids(cfg, source, teacher)
        else:
            loaded[source.name] = load_model(source, None if pair else models.vocab_limit, mesh)
            teacher = TeacherScorer(loaded[source.name], params, pad_rows=len(run_teachers) > 1 or pair is not None)
        if pair is not None and source.mapping == "byte_prefix":
            trees: PrefixTrees | ServedPrefixTrees = (
                ServedPrefixTrees(teacher, params.temperature)
                if isinstance(teacher, ServedTeacher)
                else PrefixTrees(loaded[source.name], pair.teacher_bytes, params.temperature)
            )
            teacher = BytePrefixTeacher(trees, pair, params, source.name, source.from_teacher)
        elif pair is not None:
            teacher = CrossTokenizerTeacher(teacher, pair, run_teacher.context, source.name)
        teachers[source.name] = teacher
    reference = None
    if cfg.estimator.needs_reference_logp:
        policy = cfg.reference if cfg.reference.path else dataclasses.replace(cfg.reference, path=cfg.student.path)
        reference = ReferenceScorer(
            load_model(policy, models.vocab_limit, mesh), cfg.sampling.temperature, cfg.learner.logprob_chunk
        )
    return ScoringStage(plan, mesh, Scorers(teachers, reference), loaded)


def probe_ids(cfg: RunConfig, source: TeacherSource, teacher: ServedTeacher) -> None:
    """Where the estimator needs ids only a probe finds the server scores (vLLM's
    per-position ids: :data:`~asyncopd_jax.teacher.client.PROBED`), the probe at the run's
    widths (the token, the student's candidates and top-K), else the config's refusal
    (:func:`~asyncopd_jax.config.rules.unserved_need`) with what the server answered."""
    if set(cfg.estimator.spec.needs) <= source.server.serves:
        return
    where = f"teachers[{cfg.teachers.index(source)}]" if cfg.teachers else "teacher"
    width = 1 + cfg.sampling.num_candidates + cfg.sampling.student_topk
    try:
        teacher.probe_ids(width)
    except ServerError as err:
        raise ConfigError(
            f"{unserved_need(cfg, source, where, source.server.serves)}; its start-up probe: {err}"
        ) from None
