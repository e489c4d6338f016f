"""The built-in task's tokenizers, built with `tokenizers`, saved in HF layout.

* ``characters`` (the teacher's and the student's): one token per character.
* ``merges``: a byte-pair-encoding vocabulary of 64 over the same characters, learned from
  the task's own text (prompts and solutions), so that ``12+34=46`` is ``12`` ``+34`` ``=46``
  or the like: the other-tokenizer student of cross-tokenizer distillation
  (``builtin:student_bpe``; ``docs/study/cross_tokenizer.md``).
* ``tools``: one token per character of the tool task's text (:mod:`asyncopd_jax.tasks.tool_arith`):
  the arithmetic characters, ``*``, and ``C`` (a call: the tool-call id), ``R`` (a result),
  ``E`` (an error), at ids past the character tokenizer's, which they leave as they are.
* ``tools_merges``: byte-pair merges of the tool task's characters, learned from its
  prompts and teacher trajectories (``C:12*34`` and ``R:408;`` in a few tokens each): the
  other-tokenizer student of the tool task (``builtin:student_tools_bpe``), distilled from
  the character teacher ``builtin:teacher_tools`` across observations.

Both give ``<pad>`` id 0, ``<eos>`` 1 and ``<unk>`` 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from asyncopd_jax.tasks.arith import CHARS, random_solution, sample_problems
from asyncopd_jax.tasks.tool_arith import CHARS as TOOL_CHARS
from asyncopd_jax.tasks.tool_arith import Habit
from asyncopd_jax.tasks.tool_arith import sample_problems as sample_tool_problems

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
PAD_ID, EOS_ID = 0, 1
TokenizerKind = Literal["characters", "merges", "tools", "tools_merges"]
TOKENIZER_KINDS: tuple[TokenizerKind, ...] = ("characters", "merges", "tools", "tools_merges")
MERGES_VOCAB_SIZE = 64  # 3 special tokens, the 16 characters, 45 merges
_MERGES_CORPUS = (4000, 3, 99, 7)  # problems, operands, largest operand, seed: the text the merges are learned on
_TOOL_MERGES_CORPUS = (4000, 99, 7)  # tool problems, largest operand, seed
_TOOL_MERGES_HABITS: tuple[Habit, Habit] = ("whole", "steps")  # the merges are learned on calls of both kinds


def build_tokenizer(kind: TokenizerKind = "characters") -> PreTrainedTokenizerFast:
    """The built-in tokenizer ``kind`` (module docstring)."""
    if kind == "merges":
        return _merges()
    if kind == "tools_merges":
        return _tool_merges()
    if kind == "tools":
        return _characters(TOOL_CHARS)
    if kind != "characters":
        raise ValueError(f"built-in tokenizer {kind!r} is invalid; allowed: {', '.join(TOKENIZER_KINDS)}")
    return _characters()


def _fast(core: Tokenizer) -> PreTrainedTokenizerFast:
    core.decoder = decoders.Fuse()  # tokens are their text: joined as they are
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def _merges() -> PreTrainedTokenizerFast:
    """BPE over :data:`CHARS` with :data:`MERGES_VOCAB_SIZE` tokens, learned (deterministically:
    a fixed draw of problems, each with a random order of solution) by `tokenizers`' trainer."""
    n, operands, largest, seed = _MERGES_CORPUS
    rng = np.random.default_rng(seed)
    problems = sample_problems(rng, n, operands, largest, held_out=False)
    return _learned_merges([p.prompt + random_solution(rng, p) for p in problems], CHARS)


def _tool_merges() -> PreTrainedTokenizerFast:
    """BPE over the tool task's characters with :data:`MERGES_VOCAB_SIZE` tokens, learned
    from a fixed draw of prompts, each with one calling habit's turns and observations as separate
    texts (a merge never spans a turn's edge: an observation cuts the tokens there)."""
    n, largest, seed = _TOOL_MERGES_CORPUS
    problems = sample_tool_problems(np.random.default_rng(seed), n, largest, held_out=False)
    corpus = [p.prompt for p in problems]
    for i, problem in enumerate(problems):
        for turn, observation in problem.trajectory(_TOOL_MERGES_HABITS[i % 2]):
            corpus += [turn, observation] if observation else [turn]
    return _learned_merges(corpus, TOOL_CHARS)


def _learned_merges(corpus: list[str], chars: str) -> PreTrainedTokenizerFast:
    """BPE over ``chars`` with :data:`MERGES_VOCAB_SIZE` tokens learned from ``corpus``."""
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer = trainers.BpeTrainer(
        vocab_size=MERGES_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=list(chars),
        limit_alphabet=len(chars),
        show_progress=False,
    )
    core.train_from_iterator(corpus, trainer)
    return _fast(core)


def _characters(chars: str = CHARS) -> PreTrainedTokenizerFast:
    """One token per character of ``chars``, plus ``<pad>`` (0), ``<eos>`` (1), ``<unk>``."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(chars))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("<[a-z]+>|."), behavior="isolated")
    return _fast(core)


def save_tokenizer(path: str | Path) -> Path:
    """Write the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, …) to ``path``."""
    path = Path(path)
    build_tokenizer().save_pretrained(path)
    return path
