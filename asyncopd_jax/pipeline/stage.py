"""A stage of the run, built by the same code wherever it runs.

The :class:`~asyncopd_jax.pipeline.placement.Layout` says where a stage runs; the
functions here build it there, the same in a thread of the learner's process, a stage
process, or the ``fixed_lag`` schedule's learner thread:

* :func:`run_models`: what every stage of a run agrees on, read from the models' small
  files (tokenizers, ``config.json``; no weights): the task, the shared vocabulary, the
  stop tokens. The trainer and every stage process call it, so they cannot drift.
* :func:`build_scoring_stage`: the teacher (and reference) loaded onto the stage's own
  mesh; :meth:`ScoringStage.score` moves a rollout there and fills in its score cache.
* :func:`build_rollout_stage`: a sampler whose weights arrive on the stage's own mesh
  (from the snapshot channel), the task's prompts and reward, and the scoring stage that
  shares its process (if any).

A stage's mesh has the axes ``data × fsdp × tensor`` over its devices
(``stages.rollout_mesh``, ``stages.scoring_mesh``; default: all on ``data``, the models
replicated); its models lie there as :mod:`asyncopd_jax.models.partitioning` says.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from asyncopd_jax.config import MeshConfig, ModelSource, RunConfig, TeacherSource
from asyncopd_jax.estimator_registry import check_cross_tokenizer
from asyncopd_jax.learner.sharding import make_mesh, put
from asyncopd_jax.models import (
    Decoder,
    DecoderConfig,
    check_same_vocabulary,
    encode_prompts,
    from_pretrained,
    load_tokenizer,
    shared_vocab_size,
    vocabulary_differences,
)
from asyncopd_jax.models.attention import resolve_implementation
from asyncopd_jax.models.config import read_hf_config
from asyncopd_jax.models.decoder import abstract_decoder
from asyncopd_jax.models.partitioning import logical_spec, mesh_context, parameter_shardings
from asyncopd_jax.pipeline.placement import Layout, StagePlan
from asyncopd_jax.pipeline.producer import GroupProducer, group_key
from asyncopd_jax.pipeline.reward_stage import RewardStage
from asyncopd_jax.pipeline.snapshots import SnapshotStore
from asyncopd_jax.pipeline.staleness import RolloutGroup
from asyncopd_jax.pipeline.trace import Tracer
from asyncopd_jax.sampling import SamplingParams, make_sampler
from asyncopd_jax.tasks import PromptTask, make_task
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.teacher import ReferenceScorer, Scorers, TeacherScorer
from asyncopd_jax.teacher.cross_tokenizer import CrossTokenizerTeacher, Retokenizer
from asyncopd_jax.teacher.routing import RoutedTeacher, Router
from asyncopd_jax.teacher.scorer import Teacher
from asyncopd_jax.teacher.served import ServedTeacher
from asyncopd_jax.teacher.spans import unspellable


@dataclasses.dataclass(frozen=True)
class RunModels:
    """What every stage of a run agrees on (no weights are read to make it).

    ``vocab_limit``: the ids student and teacher share when their embeddings are padded to
    different sizes (None: all); ``sampling``: the config's, with the stop ids filled in;
    ``retokenizers``: the teachers of another tokenizer than the student's, by name, with
    the tokenizer pair their answers are re-tokenised by (:mod:`asyncopd_jax.teacher.cross_tokenizer`).
    """

    tokenizer: Any
    task: PromptTask
    sampling: SamplingParams
    vocab_limit: int | None
    student_config: DecoderConfig
    router: Router  # which teacher scores each prompt, under which prompt
    retokenizers: dict[str, Retokenizer] = dataclasses.field(default_factory=dict)

    def teacher_task(self, cfg: RunConfig, name: str) -> PromptTask:
        """The task as teacher ``name`` reads it: through its own tokenizer (a teacher of
        another tokenizer: the built-in task's prompts and answers in its tokens)."""
        if name not in self.retokenizers:
            return self.task
        return make_task(cfg.task, self.retokenizers[name].teacher, max_new_tokens=cfg.sampling.max_new_tokens)


def model_config(source: ModelSource) -> DecoderConfig:
    """A model's ``config.json``, read and checked as the loader does (no weights)."""
    directory = resolve_model_path(source.path)
    if not directory.is_dir():
        from_pretrained(directory)  # raises the loader's own error naming the directory
    return read_hf_config(directory)[0]


def run_models(cfg: RunConfig) -> RunModels:
    """The task, shared vocabulary, stop tokens and teacher routing of ``cfg``'s student and
    teachers."""
    student = model_config(cfg.student)  # first: a missing directory is named as a model's
    if student.num_experts:
        # its router's load-balancing loss is not in the learner's loss yet: without it a
        # distilled MoE student's routing may collapse onto a few experts, silently
        raise ValueError(
            f"student.path = {cfg.student.path!r} is a mixture-of-experts model ({student.model_type}), which the "
            "learner does not train yet (no router load-balancing loss); allowed: a dense student (a MoE teacher is)"
        )
    tokenizer = load_tokenizer(resolve_model_path(cfg.student.path))
    context, vocab_limit = student.max_position_embeddings, None
    contexts = {}  # in-process teacher → its context
    others = {}  # a teacher of another tokenizer → that tokenizer
    for source in cfg.teacher_sources:
        directory = teacher_tokenizer_path(source)
        own = load_tokenizer(resolve_model_path(directory)) if directory else None
        if own is not None and vocabulary_differences(tokenizer, own):
            check_cross_tokenizer_teacher(cfg, source)
            others[source.name] = own
        if not source.path:
            continue
        teacher = model_config(source)
        contexts[source.name] = teacher.max_position_embeddings
        if source.name not in others:  # embeddings padded to different sizes: all output the ids they share
            limit = shared_vocab_size(tokenizer, student.vocab_size, teacher.vocab_size)
            if limit is not None:
                vocab_limit = limit if vocab_limit is None else min(vocab_limit, limit)
    shared = [c for name, c in contexts.items() if name not in others]
    if shared:  # the student samples prompt + answer and each teacher of its tokens scores all of it
        context = min(context, *shared)
    task = make_task(cfg.task, tokenizer, max_new_tokens=cfg.sampling.max_new_tokens, max_positions=context)
    # the sampler stops at the tokenizer's EOS and at every EOS id of the student's config
    stop = tuple(dict.fromkeys((*cfg.sampling.stop_token_ids, task.eos_id, *student.eos_token_ids)))
    router = make_router(cfg, task, tokenizer, others)
    for source in cfg.teacher_sources:  # a teacher's own prompt + the answer must fit its context too
        if source.name not in contexts:
            continue
        longest = router.prompt_slots + cfg.sampling.max_new_tokens
        if source.name in others and router.prompt_slots >= contexts[source.name]:
            raise ValueError(
                f"teacher {source.name!r}: its prompt (up to {router.prompt_slots} tokens) fills its context "
                f"({contexts[source.name]} positions); shorten prompt.template"
            )
        if source.name not in others and source.prompt.own and longest > contexts[source.name]:
            raise ValueError(
                f"teacher {source.name!r}: its prompt (prompt.template: up to {router.prompt_slots} tokens) + "
                f"sampling.max_new_tokens ({cfg.sampling.max_new_tokens}) is longer than its context "
                f"({contexts[source.name]} positions); shorten the template or lower sampling.max_new_tokens"
            )
    sampling = dataclasses.replace(cfg.sampling, stop_token_ids=stop)
    retokenizers = {name: Retokenizer.of(tokenizer, own, stop) for name, own in others.items()}
    for name, pair in retokenizers.items():
        check_spelling(name, pair)
    return RunModels(tokenizer, task, sampling, vocab_limit, student, router, retokenizers)


def teacher_tokenizer_path(source: TeacherSource) -> str:
    """The directory of a teacher's tokenizer (``teacher.tokenizer``, else its model's; ''
    for a served teacher without one: the student's)."""
    return source.tokenizer or source.path


def check_cross_tokenizer_teacher(cfg: RunConfig, source: TeacherSource) -> None:
    """A ValueError unless ``cfg`` can distil from ``source``, whose tokenizer differs from
    the student's: an estimator that compares by spans, no teacher samples, no probe that
    compares the two vocabularies id by id."""
    check_cross_tokenizer(cfg.estimator.name, source.name)
    why = f"teacher {source.name!r} has another tokenizer than the student's"
    if cfg.scoring.num_samples:
        raise ValueError(
            f"scoring.num_samples = {cfg.scoring.num_samples}: teacher samples do not map across tokenizers ({why}); "
            "allowed: 0"
        )
    if cfg.train.diagnostics_every:
        raise ValueError(
            f"train.diagnostics_every = {cfg.train.diagnostics_every}: the diagnostics compare the two models' "
            f"vocabularies id by id ({why}); allowed: 0"
        )
    extrapolation = cfg.learner.extrapolation
    if extrapolation.enabled and extrapolation.probe_metric == "reverse_kl":
        raise ValueError(
            f"learner.extrapolation.probe_metric = 'reverse_kl' compares the two models' vocabularies id by id "
            f"({why}); allowed: accuracy"
        )


def check_spelling(name: str, pair: Retokenizer) -> None:
    """A ValueError unless teacher ``name``'s tokenizer spells every student token's text."""
    missing = unspellable(pair.student_bytes, pair.teacher, pair.teacher_bytes)
    if missing:
        raise ValueError(
            f"teacher {name!r}: its tokenizer ({pair.teacher.name_or_path or '(unnamed)'}) cannot spell "
            f"{len(missing)} of the student's tokens (e.g. {', '.join(map(repr, missing[:5]))}): characters outside "
            "its vocabulary, or a normaliser that rewrites text; pick a teacher whose tokenizer covers the "
            "student's text"
        )


def make_router(cfg: RunConfig, task: PromptTask, tokenizer: Any, others: dict[str, Any] | None = None) -> Router:
    """The run's :class:`Router`: each teacher's name, weight, and prompt encoder (its own
    tokenizer's chat template: ``prompt.tokenizer``, else the teacher's tokenizer, else the
    student's). A teacher of another tokenizer (``others``: by name) always has one: by
    default the task's prompt text in its own tokens."""
    others = others or {}
    routed = []
    for source in cfg.teacher_sources:
        encode = None
        if source.prompt.own or source.name in others:
            directory = source.prompt.tokenizer or teacher_tokenizer_path(source)
            own = load_tokenizer(resolve_model_path(directory)) if directory else tokenizer
            if directory:
                check_same_vocabulary(others.get(source.name, tokenizer), own)
            template = {"auto": None, "on": True, "off": False}[source.prompt.chat_template]
            encode = functools.partial(encode_prompts, own, chat_template=template, system=source.prompt.system)
        routed.append(RoutedTeacher(source.name, source.weight, source.prompt.template, encode))
    return Router(
        routed,
        cfg.routing,
        fields=task.fields,
        prompt_text=task.prompt_text,
        items=task.bounding_items,
        where=task.where,
        pad_id=task.pad_id,
        student_slots=task.prompt_slots,
    )


# --- a stage's devices -----------------------------------------------------------------------


def stage_devices(layout: Layout, plan: StagePlan, default: list[jax.Device] | None = None) -> list[jax.Device]:
    """The devices ``plan`` runs on, in this process.

    A stage process whose devices were made visible to it by the platform's variables
    (GPU, TPU) uses every device it sees; otherwise ``plan.devices`` index this process's
    devices. ``()`` means ``default``: the learner's devices for a stage beside the learner,
    every device for the learner, and else this process's first device (a stage process
    given no devices, as before devices were configurable: one device, not a replica on
    each of, say, 8 virtual CPU devices)."""
    local = jax.local_devices()
    if not plan.devices:
        return list(default) if default else local[:1]
    if layout.stage_processes() and jax.default_backend() != "cpu":
        return local  # already restricted to plan.devices by placement.device_env
    if max(plan.devices) >= len(local):
        raise ValueError(
            f"stages.{plan.role}_devices = {','.join(map(str, plan.devices))} names device "
            f"{max(plan.devices)}, but this process has {len(local)} device(s) (0-{len(local) - 1})"
        )
    return [local[i] for i in plan.devices]


def stage_mesh(devices: list[jax.Device], mesh: MeshConfig | None = None) -> Mesh:
    """A stage's ``(data, fsdp, tensor)`` mesh over its devices, shaped as ``mesh`` says
    (``stages.rollout_mesh``, ``stages.scoring_mesh``; default: every device on ``data``)."""
    return make_mesh(mesh or MeshConfig(), devices)


def load_model(source: ModelSource, vocab_limit: int | None, mesh: Mesh) -> Decoder:
    """A model loaded straight into its shards on ``mesh`` (by the partition rules; no
    whole copy on any device first)."""
    model = from_pretrained(resolve_model_path(source.path), dtype=source.dtype, mesh=mesh)
    model.vocab_limit = vocab_limit
    model.attention = resolve_implementation(source.attention, mesh.devices.flat[0].platform)
    return model


def on_mesh(tree: Any, mesh: Mesh) -> Any:
    """``tree``'s arrays on ``mesh``: rows split over the mesh's batch axes where they
    divide, else replicated (a device-to-device copy when they live elsewhere)."""

    def sharding(x: Any) -> NamedSharding:
        axes = ("batch",) + (None,) * (np.ndim(x) - 1) if np.ndim(x) else ()
        return NamedSharding(mesh, logical_spec(axes, np.shape(x), mesh))

    return put(tree, jax.tree_util.tree_map(sharding, tree))


# --- the stages ---------------------------------------------------------------------------------


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


def build_scoring_stage(
    cfg: RunConfig, layout: Layout, plan: StagePlan, models: RunModels, default_devices: list[jax.Device] | None = None
) -> ScoringStage:
    """Load what ``cfg`` scores onto ``plan``'s devices: the teacher where the run needs its
    scores, the reference policy (``reference.path``, else the student's starting weights)
    where the loss has a KL-to-reference term."""
    mesh = stage_mesh(stage_devices(layout, plan, default_devices), cfg.stages.scoring_mesh)
    teachers: dict[str, Teacher] = {}
    loaded: dict[str, Decoder] = {}  # the in-process teachers' models
    sources = cfg.teacher_sources if cfg.needs_teacher_scores else ()
    for source in sources:
        params = source.scoring(cfg.scoring)
        pair = models.retokenizers.get(source.name)  # a teacher of another tokenizer
        teacher: Teacher
        if source.served:
            # a teacher of another tokenizer: any id its server answers is mapped (one past its tokenizer,
            # an embedding row of padding, to no student token)
            vocab = np.iinfo(np.int32).max if pair else models.vocab_limit or models.student_config.vocab_size
            teacher = ServedTeacher(source.server, params, vocab)
        else:
            loaded[source.name] = load_model(source, None if pair else models.vocab_limit, mesh)
            teacher = TeacherScorer(loaded[source.name], params, pad_rows=len(sources) > 1 or pair is not None)
        if pair is not None:
            context = loaded[source.name].config.max_position_embeddings if source.name in loaded else None
            teacher = CrossTokenizerTeacher(teacher, pair, context, source.name)
        teachers[source.name] = teacher
    reference = None
    if cfg.estimator.needs_reference_logp:
        policy = cfg.reference if cfg.reference.path else dataclasses.replace(cfg.reference, path=cfg.student.path)
        reference = ReferenceScorer(
            load_model(policy, models.vocab_limit, mesh), cfg.sampling.temperature, cfg.learner.logprob_chunk
        )
    return ScoringStage(plan, mesh, Scorers(teachers, reference), loaded)


@dataclasses.dataclass
class RolloutStage:
    """Samples rollout group ``index`` on the stage's mesh and scores it when a scoring
    stage shares its process (else the group goes to one that does)."""

    plan: StagePlan
    mesh: Mesh
    producer: GroupProducer
    scoring: ScoringStage | None

    def group(self, index: int, version: int | None = None, min_version: int = 0) -> RolloutGroup:
        """Group ``index`` from policy ``version`` (default: the newest, ``min_version`` or
        newer), scored when a scoring stage shares this process."""
        return self.scored(self.producer.sample(index, version, min_version), index)

    def scored(self, group: RolloutGroup, index: int) -> RolloutGroup:
        """Sampled group ``index``, scored when a scoring stage shares this process."""
        if self.scoring is None:
            return group
        return self.scoring.score(group, self.producer.seed, index, self.producer.tracer)


def build_rollout_stage(
    cfg: RunConfig,
    layout: Layout,
    plan: StagePlan,
    models: RunModels,
    *,
    snapshots: SnapshotStore,
    tracer: Tracer,
    scoring: ScoringStage | None,
    graphdef: nnx.GraphDef,
    default_devices: list[jax.Device] | None = None,
    interruptible: bool = True,
) -> RolloutStage:
    """The rollout stage ``plan``; ``snapshots`` delivers the policy's weights onto its mesh
    (:func:`rollout_shardings`)."""
    mesh = stage_mesh(stage_devices(layout, plan, default_devices), cfg.stages.rollout_mesh)
    producer = GroupProducer(
        sampler=make_sampler(graphdef, models.sampling, pad_id=models.task.pad_id, mesh=mesh),
        snapshots=snapshots,
        prompts=models.task.train_prompts,
        reward=RewardStage.from_config(cfg, models.task.rewards),
        group_size=layout.group_size,
        seed=layout.seed,
        prompt_slots=models.task.prompt_slots,
        tracer=tracer,
        interruptible=interruptible,
        version_timeout=cfg.stages.startup_timeout,
        router=models.router if cfg.needs_teacher_scores else None,
    )
    return RolloutStage(plan, mesh, producer, scoring)


def rollout_shardings(
    cfg: RunConfig,
    layout: Layout,
    plan: StagePlan,
    abstract_params: Any,
    default_devices: list[jax.Device] | None = None,
) -> Any:
    """The shardings the rollout stage ``plan`` reads the policy's weights into."""
    mesh = stage_mesh(stage_devices(layout, plan, default_devices), cfg.stages.rollout_mesh)
    return parameter_shardings(abstract_params, mesh)


def student_graph(cfg: RunConfig, models: RunModels) -> tuple[nnx.GraphDef, Any]:
    """The student's graph and abstract parameters (shapes and dtypes; nothing allocated):
    what a rollout stage needs to receive the policy's weights."""
    return abstract_decoder(models.student_config, cfg.student.dtype, models.vocab_limit)  # dtype: as the learner's


def with_shardings(abstract: Any, shardings: Any) -> Any:
    """``abstract``'s shapes and dtypes, placed by ``shardings`` (restores land there)."""
    return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)


def teacher_accuracies(cfg: RunConfig, models: RunModels, scoring: ScoringStage) -> dict[str, float]:
    """Each in-process teacher's held-out accuracy, by name, each through its own tokenizer."""
    return {name: models.teacher_task(cfg, name).accuracy(*nnx.split(m)) for name, m in scoring.models.items()}


def load_model_and_tokenizer(path: str, dtype: str) -> tuple[nnx.Module, Any]:
    """A model (on the default device) and its tokenizer, from a directory or ``builtin:NAME``."""
    directory = resolve_model_path(path)
    return from_pretrained(directory, dtype=dtype), load_tokenizer(directory)


def teacher_on(mesh: Mesh, cfg: RunConfig, models: RunModels, scoring: ScoringStage | None) -> nnx.Module:
    """The teacher on ``mesh`` (a probe's, beside the learner): the scoring stage's, copied
    device to device when it shares this process, else read from disk."""
    if scoring is not None and scoring.teacher is not None:
        graphdef, weights = nnx.split(scoring.teacher)
        return nnx.merge(graphdef, jax.device_put(weights, parameter_shardings(weights, mesh)))
    source = cfg.in_process_teacher
    assert source is not None, "a probe's teacher runs in-process (checked with the config)"
    return load_model(source, models.vocab_limit, mesh)
