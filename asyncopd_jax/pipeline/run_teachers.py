"""The run's teachers, resolved once from the config and their models' small files.

:func:`read_teachers` reads each teacher's tokenizer and ``config.json`` (no weights): its
context, whether its tokenizer differs from the student's (then only what compares by
spans may run: :func:`check_cross_tokenizer_teacher`), and the ids it shares with the
student. :func:`resolve_teachers` makes each a :class:`RunTeacher` (in-process or served,
its context, its tokenizer pair) and the run's :class:`Router`, and checks that each
teacher's prompt fits its context and that its tokenizer spells every student token. The
router, the scoring stage, the trainer's summary and the probes ask that list instead of
walking ``cfg.teacher_sources`` again.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from asyncopd_jax.config import RunConfig, TeacherSource
from asyncopd_jax.estimator_registry import check_cross_tokenizer
from asyncopd_jax.models import (
    DecoderConfig,
    check_same_vocabulary,
    encode_prompts,
    read_lm_head,
    shared_vocab_size,
    vocabulary_differences,
)
from asyncopd_jax.pipeline.model_files import model_config, read_tokenizer
from asyncopd_jax.tasks import PromptTask
from asyncopd_jax.tasks.assets import resolve_model_path
from asyncopd_jax.teacher.client import ServedTeacher
from asyncopd_jax.teacher.cross_tokenizer import Retokenizer
from asyncopd_jax.teacher.routing import RoutedTeacher, Router
from asyncopd_jax.teacher.scorer import ScoringParams
from asyncopd_jax.teacher.span_alignment import unspellable


@dataclasses.dataclass(frozen=True)
class RunTeacher:
    """One teacher of the run, resolved once from the config and its model's small files.

    ``context``: its positions (an in-process teacher's ``config.json``; None: served);
    ``hidden_size``: the width of its hidden states (in-process; None: served);
    ``retokenizer``: the student's and its tokenizer, when they differ (its answers are
    re-tokenised and its scores mapped back by spans:
    :mod:`asyncopd_jax.teacher.cross_tokenizer`); None: the student's tokenizer.
    """

    source: TeacherSource
    context: int | None
    retokenizer: Retokenizer | None = None
    hidden_size: int | None = None

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def served(self) -> bool:
        return self.source.served


@dataclasses.dataclass(frozen=True)
class TeacherFiles:
    """What the teachers' small files say, before the task is made: ``contexts`` of the
    in-process teachers and ``others`` (the tokenizers of the teachers of another tokenizer)
    by name; the student's ``context`` cut to every teacher of its tokenizer; the ids all
    share (``vocab_limit``; None: all)."""

    contexts: dict[str, int]
    others: dict[str, Any]
    context: int
    vocab_limit: int | None
    widths: dict[str, int] = dataclasses.field(default_factory=dict)  # in-process teacher → its hidden size


#: The estimators a ``mapping: byte_prefix`` teacher serves: its cache's top-K holds the
#: student's top-K ids (and their teacher log-masses), its token log-probs the sampled ones'.
BYTE_PREFIX_ESTIMATORS = ("forward_kl_topk", "forward_kl_topk_renormalized", "reverse_kl_pg")


def _check_byte_prefix(cfg: RunConfig, source: TeacherSource) -> None:
    where = f"teacher {source.name!r}: mapping = byte_prefix"
    if source.served and source.server.api != "asyncopd":
        raise ValueError(
            f"{where} asks the server for byte-prefix probabilities (POST /v1/byte_prefix): server.api = "
            f"{source.server.api} is invalid; allowed: asyncopd (asyncopd serve-teacher), or mapping = spans"
        )
    if cfg.estimator.name not in BYTE_PREFIX_ESTIMATORS:
        raise ValueError(
            f"{where} fills the top-K with the student's own ids: estimator.name = {cfg.estimator.name!r} is invalid; "
            f"allowed: {', '.join(BYTE_PREFIX_ESTIMATORS)}"
        )
    if cfg.sampling.student_topk < 1:
        raise ValueError(f"{where} scores the student's top-K ids: set sampling.student_topk (>= 1; e.g. 8)")
    if source.from_teacher > cfg.sampling.student_topk:
        raise ValueError(
            f"{where}: from_teacher = {source.from_teacher} is invalid; allowed: <= sampling.student_topk "
            f"({cfg.sampling.student_topk}), the ids scored at a position"
        )


def read_teachers(cfg: RunConfig, tokenizer: Any, student: DecoderConfig) -> TeacherFiles:
    """Each teacher's tokenizer and ``config.json``, against the student's ``tokenizer`` and
    config."""
    context, vocab_limit = student.max_position_embeddings, None
    contexts: dict[str, int] = {}  # in-process teacher → its context
    widths: dict[str, int] = {}  # in-process teacher → its hidden size
    others: dict[str, Any] = {}  # a teacher of another tokenizer → that tokenizer
    for source in cfg.teacher_sources:
        directory = teacher_tokenizer_path(source)
        own = read_tokenizer(directory) if directory else None
        if own is not None and vocabulary_differences(tokenizer, own):
            check_cross_tokenizer_teacher(cfg, source)
            others[source.name] = own
        elif source.mapping != "spans":
            raise ValueError(
                f"teacher {source.name!r}: mapping = {source.mapping} is for a teacher of another tokenizer; this one "
                "has the student's (its scores are the student's ids already); allowed: spans"
            )
        if not source.path:
            if source.served and source.scoring(cfg.scoring).payload == "hidden":
                widths[source.name] = _server(source).head_card().hidden_size
            continue
        teacher = model_config(source)
        contexts[source.name] = teacher.max_position_embeddings
        widths[source.name] = teacher.hidden_size
        if source.name not in others:  # embeddings padded to different sizes: all output the ids they share
            limit = shared_vocab_size(tokenizer, student.vocab_size, teacher.vocab_size)
            if limit is not None:
                vocab_limit = limit if vocab_limit is None else min(vocab_limit, limit)
    shared = [c for name, c in contexts.items() if name not in others]
    if shared:  # the student samples prompt + answer and each teacher of its tokens scores all of it
        context = min(context, *shared)
    return TeacherFiles(contexts, others, context, vocab_limit, widths)


def teacher_head(source: TeacherSource, vocab_limit: int | None) -> np.ndarray:
    """A teacher's LM head alone, ``[H, V]`` (V: ``vocab_limit``, else its vocabulary),
    for a learner that applies it to the teacher's hidden states: read from its checkpoint
    (in-process, in ``teacher.dtype``), or for a served teacher from ``teacher.head_path``
    or the server, checked against the server's digest (in the server's dtype)."""
    if not source.served:
        return read_lm_head(resolve_model_path(source.path), vocab_limit, source.dtype)
    head = _server(source).head(str(resolve_model_path(source.head_path)) if source.head_path else "")
    return head if vocab_limit is None else head[:, :vocab_limit]


def _server(source: TeacherSource) -> ServedTeacher:
    """A client of a served teacher, for its ``/v1/models`` card and head."""
    return ServedTeacher(source.server, ScoringParams(), np.iinfo(np.int32).max)


def resolve_teachers(
    cfg: RunConfig, task: PromptTask, tokenizer: Any, found: TeacherFiles, stop: tuple[int, ...]
) -> tuple[tuple[RunTeacher, ...], Router]:
    """Every teacher of ``cfg`` as a :class:`RunTeacher`, in the config's order, and the
    run's router; ``stop``: the student's stop ids (a teacher of another tokenizer's answers
    end where the student's do)."""
    teachers = tuple(
        RunTeacher(
            source,
            found.contexts.get(source.name),
            Retokenizer.of(tokenizer, found.others[source.name], stop) if source.name in found.others else None,
            found.widths.get(source.name),
        )
        for source in cfg.teacher_sources
    )
    router = make_router(cfg, task, tokenizer, teachers)
    for teacher in teachers:  # a teacher's own prompt + the answer must fit its context too
        check_teacher_context(cfg, teacher, router.prompt_slots)
    for teacher in teachers:
        if teacher.retokenizer is not None:
            check_spelling(teacher.name, teacher.retokenizer)
    return teachers, router


def check_teacher_context(cfg: RunConfig, teacher: RunTeacher, prompt_slots: int) -> None:
    """A ValueError unless an in-process teacher's own prompt (up to ``prompt_slots``
    tokens) + the answer fits its context."""
    if teacher.context is None:
        return
    if teacher.retokenizer is not None and prompt_slots >= teacher.context:
        raise ValueError(
            f"teacher {teacher.name!r}: its prompt (up to {prompt_slots} tokens) fills its context "
            f"({teacher.context} positions); shorten prompt.template"
        )
    longest = prompt_slots + cfg.sampling.max_new_tokens
    if teacher.retokenizer is None and teacher.source.prompt.own and longest > teacher.context:
        raise ValueError(
            f"teacher {teacher.name!r}: its prompt (prompt.template: up to {prompt_slots} tokens) + "
            f"sampling.max_new_tokens ({cfg.sampling.max_new_tokens}) is longer than its context "
            f"({teacher.context} positions); shorten the template or lower sampling.max_new_tokens"
        )


def teacher_tokenizer_path(source: TeacherSource) -> str:
    """The directory of a teacher's tokenizer (``teacher.tokenizer``, else its model's; ''
    for a served teacher without one: the student's)."""
    return source.tokenizer or source.path


def check_cross_tokenizer_teacher(cfg: RunConfig, source: TeacherSource) -> None:
    """A ValueError unless ``cfg`` can distil from ``source``, whose tokenizer differs from
    the student's: an estimator that compares by spans, no teacher samples, no probe that
    compares the two vocabularies id by id; with ``mapping: byte_prefix``, an in-process
    teacher, an estimator of the top-K it fills with the student's ids, and those ids."""
    why = f"teacher {source.name!r} has another tokenizer than the student's"
    if source.mapping == "byte_prefix":
        _check_byte_prefix(cfg, source)
    else:
        check_cross_tokenizer(cfg.estimator.name, source.name)
    if source.scoring(cfg.scoring).payload == "hidden":
        raise ValueError(
            f"teacher {source.name!r}: payload = hidden is invalid: its head's vocabulary is not the student's "
            f"({why}); allowed: scores"
        )
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


def make_router(cfg: RunConfig, task: PromptTask, tokenizer: Any, teachers: tuple[RunTeacher, ...]) -> Router:
    """The run's :class:`Router`: each teacher's name, weight, and prompt encoder (its own
    tokenizer's chat template: ``prompt.tokenizer``, else the teacher's tokenizer, else the
    student's). A teacher of another tokenizer always has one: by default the task's prompt
    text in its own tokens."""
    routed = []
    for teacher in teachers:
        source, pair, encode = teacher.source, teacher.retokenizer, None
        if source.prompt.own or pair is not None:
            directory = source.prompt.tokenizer or teacher_tokenizer_path(source)
            own = read_tokenizer(directory) if directory else tokenizer
            if directory:
                check_same_vocabulary(pair.teacher if pair is not None else tokenizer, own)
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
