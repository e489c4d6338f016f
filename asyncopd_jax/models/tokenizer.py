"""Tokenizers from local Hugging Face directories, chat templates, and the vocabulary check."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """``transformers.AutoTokenizer`` from a local directory; never downloads.

    Raises:
      FileNotFoundError: the directory or every tokenizer file is missing.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer in {path}: expected one of {', '.join(_TOKENIZER_FILES)}")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def encode_prompts(tokenizer: PreTrainedTokenizerBase, prompts: list[str], *, chat_template: bool | None = None) -> list[list[int]]:
    """Token ids of each prompt, through the chat template when the tokenizer has one.

    Args:
      tokenizer: from :func:`load_tokenizer`.
      prompts: user messages.
      chat_template: force (True) or skip (False) the template; default: use it if present.

    Returns:
      One list of ids per prompt (the template's generation prompt included).
    """
    use_template = bool(tokenizer.chat_template) if chat_template is None else chat_template
    if use_template and not tokenizer.chat_template:
        raise ValueError("chat_template=True, but the tokenizer has no chat template")
    if not use_template:
        return [tokenizer.encode(p) for p in prompts]
    encoded = []
    for prompt in prompts:
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True
        )
        # transformers >= 5 returns a BatchEncoding here, older versions a list of ids.
        encoded.append(list(out["input_ids"] if hasattr(out, "keys") else out))
    return encoded


def check_same_vocabulary(
    student: PreTrainedTokenizerBase,
    teacher: PreTrainedTokenizerBase,
    *,
    student_vocab_size: int | None = None,
    teacher_vocab_size: int | None = None,
) -> None:
    """Fail unless teacher and student map every token string to the same id.

    Distillation compares the two models' distributions id by id, so any difference in
    the vocabularies (or in the models' logit widths) silently pairs unrelated tokens.

    Args:
      student, teacher: the two tokenizers.
      student_vocab_size, teacher_vocab_size: the models' ``vocab_size`` (embedding rows,
        often padded beyond the tokenizer), checked equal when given.

    Raises:
      ValueError: saying how they differ (sizes, and the first differing tokens).
    """
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    problems = []
    if len(s_vocab) != len(t_vocab):
        problems.append(f"tokenizer sizes differ: student {len(s_vocab)}, teacher {len(t_vocab)}")
    differing = sorted(tok for tok in s_vocab.keys() | t_vocab.keys() if s_vocab.get(tok) != t_vocab.get(tok))
    if differing:
        examples = ", ".join(f"{tok!r}: student {s_vocab.get(tok)} vs teacher {t_vocab.get(tok)}" for tok in differing[:5])
        problems.append(f"{len(differing)} tokens map to different ids (e.g. {examples})")
    if student_vocab_size is not None and teacher_vocab_size is not None and student_vocab_size != teacher_vocab_size:
        problems.append(f"model vocab_size differs: student {student_vocab_size}, teacher {teacher_vocab_size}")
    if problems:
        raise ValueError("teacher and student vocabularies differ: " + "; ".join(problems))
