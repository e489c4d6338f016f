"""The built-in task's tokenizers, built with `tokenizers`, saved in HF layout.

* ``characters`` (the teacher's and the student's): one token per character.
* ``merges``: a byte-pair-encoding vocabulary of 64 over the same characters, learned from
  the task's own text (prompts and solutions), so that ``12+34=46`` is ``12`` ``+34`` ``=46``
  or the like: the other-tokenizer student of cross-tokenizer distillation
  (``builtin:student_bpe``; ``docs/study/cross_tokenizer.md``).
* ``tools``: one token per character of the tool task's text (:mod:`asyncopd_jax.tasks.tool_arith`):
  the arithmetic characters, ``*``, and ``C`` (a call: the tool-call id), ``R`` (a result),
  ``E`` (an error), at ids past the character tokenizer's, which they leave as they are.

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

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
PAD_ID, EOS_ID = 0, 1
TokenizerKind = Literal["characters", "merges", "tools"]
TOKENIZER_KINDS: tuple[TokenizerKind, ...] = ("characters", "merges", "tools")
MERGES_VOCAB_SIZE = 64  # 3 special tokens, the 16 characters, 45 merges
_MERGES_CORPUS = (4000, 3, 99, 7)  # problems, operands, largest operand, seed: the text the merges are learned on


def build_tokenizer(kind: TokenizerKind = "characters") -> PreTrainedTokenizerFast:
    """The built-in tokenizer ``kind`` (module docstring)."""
    if kind == "merges":
        return _merges()
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
    corpus = [p.prompt + random_solution(rng, p) for p in problems]
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer = trainers.BpeTrainer(
        vocab_size=MERGES_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=list(CHARS),
        limit_alphabet=len(CHARS),
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
