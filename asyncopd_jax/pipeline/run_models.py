"""What every stage of a run agrees on, read from the models' small files (tokenizers,
``config.json``; no weights): the task, the shared vocabulary, the stop tokens, and the
run's teachers resolved once (:mod:`asyncopd_jax.pipeline.run_teachers`).

:func:`run_models` is called by the trainer and by every stage process, so they cannot
drift. The checks that need those files live beside it: a mixture-of-experts student here,
the teachers' in :mod:`~asyncopd_jax.pipeline.run_teachers`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from asyncopd_jax.config import ConfigError, RunConfig
from asyncopd_jax.environments.protocol import Tool
from asyncopd_jax.environments.toolbox import make_tools
from asyncopd_jax.models import DecoderConfig
from asyncopd_jax.pipeline.model_files import model_config, read_tokenizer
from asyncopd_jax.pipeline.run_teachers import RunTeacher, read_teachers, resolve_teachers
from asyncopd_jax.sampling import SamplingParams
from asyncopd_jax.tasks import PromptTask, make_task
from asyncopd_jax.teacher.cross_tokenizer import Retokenizer
from asyncopd_jax.teacher.routing import Router


@dataclasses.dataclass(frozen=True)
class RunModels:
    """What every stage of a run agrees on (no weights are read to make it).

    ``vocab_limit``: the ids student and teacher share when their embeddings are padded to
    different sizes (None: all); ``sampling``: the config's, with the stop ids filled in;
    ``teachers``: every teacher of the run, in the config's order.
    """

    tokenizer: Any
    task: PromptTask
    sampling: SamplingParams
    vocab_limit: int | None
    student_config: DecoderConfig
    router: Router  # which teacher scores each prompt, under which prompt
    teachers: tuple[RunTeacher, ...] = ()
    tools: tuple[Tool, ...] = ()  # a dataset task's (environment.tools), made at start-up

    @property
    def retokenizers(self) -> dict[str, Retokenizer]:
        """The teachers of another tokenizer than the student's, by name, with their pair."""
        return {t.name: t.retokenizer for t in self.teachers if t.retokenizer is not None}

    def hidden_width(self, cfg: RunConfig) -> int:
        """The width every teacher's hidden states are padded to in the score cache (the
        widest of the teachers with ``payload: hidden``; 0: none), so that the rows of
        teachers of different widths stack into one ``[B, T, H]``; each teacher's head is
        padded with zero rows to it (zeros add nothing to ``h · W``)."""
        widths = [t.hidden_size or 0 for t in self.teachers if t.source.scoring(cfg.scoring).payload == "hidden"]
        return max(widths, default=0)

    def teacher_task(self, cfg: RunConfig, name: str) -> PromptTask:
        """The task as teacher ``name`` reads it: through its own tokenizer (a teacher of
        another tokenizer: the built-in task's prompts and answers in its tokens)."""
        pair = self.retokenizers.get(name)
        if pair is None:
            return self.task
        return make_task(cfg.task, pair.teacher, max_new_tokens=cfg.sampling.max_new_tokens, tools=self.tools)


def check_student(cfg: RunConfig, student: DecoderConfig) -> None:
    """A ValueError for a student the learner cannot train: a mixture-of-experts model (its
    router's load-balancing loss is not in the learner's loss yet: without it a distilled
    MoE student's routing may collapse onto a few experts, silently)."""
    if student.num_experts:
        raise ValueError(
            f"student.path = {cfg.student.path!r} is a mixture-of-experts model ({student.model_type}), which the "
            "learner does not train yet (no router load-balancing loss); allowed: a dense student (a MoE teacher is)"
        )


def run_models(cfg: RunConfig) -> RunModels:
    """The task, shared vocabulary, stop tokens and teachers of ``cfg``'s student and
    teachers."""
    student = model_config(cfg.student)  # first: a missing directory is named as a model's
    check_student(cfg, student)
    tokenizer = read_tokenizer(cfg.student.path)
    found = read_teachers(cfg, tokenizer, student)
    tools = make_tools(cfg.environment.tools)  # here, at start-up: the python sandbox refuses where it cannot isolate
    task = make_task(
        cfg.task, tokenizer, max_new_tokens=cfg.sampling.max_new_tokens, max_positions=found.context, tools=tools
    )
    # the sampler stops at the tokenizer's EOS and at every EOS id of the student's config
    stop = tuple(dict.fromkeys((*cfg.sampling.stop_token_ids, task.eos_id, *student.eos_token_ids)))
    teachers, router = resolve_teachers(cfg, task, tokenizer, found, stop)
    # a multi-turn task's tool calls park their sequences (asyncopd_jax.sampling.episodes)
    if task.tool_call_ids and cfg.sampling.engine != "continuous":
        raise ConfigError(
            f"task.name = {cfg.task.name} is multi-turn: a turn that calls a tool parks until its answer, which only "
            f"the continuous engine does; sampling.engine = {cfg.sampling.engine!r} is invalid, allowed: continuous"
        )
    sampling = dataclasses.replace(cfg.sampling, stop_token_ids=stop, tool_call_ids=task.tool_call_ids)
    return RunModels(tokenizer, task, sampling, found.vocab_limit, student, router, teachers, tuple(tools))
