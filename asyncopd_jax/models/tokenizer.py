"""Tokenizers from local Hugging Face directories, chat templates, and the vocabulary check."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, BatchEncoding, PreTrainedTokenizerBase

from asyncopd_jax.models.config import read_json

# Files that hold a vocabulary (fast, SentencePiece, byte-level BPE); tokenizer_config.json
# alone holds none, and transformers' error for that case is a paragraph about converters.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """``transformers.AutoTokenizer`` from a local directory; never downloads.

    Raises:
      FileNotFoundError: the directory is missing, or holds no vocabulary file.
      ValueError: the tokenizer files are there but cannot be read (the directory named).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        found = ", ".join(sorted(p.name for p in path.iterdir())) or "nothing"
        raise FileNotFoundError(
            f"no tokenizer in {path}: expected one of {', '.join(_TOKENIZER_FILES)} "
            f"(found: {found}); copy the model's tokenizer files into it"
        )
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as err:  # transformers and tokenizers raise many types, some multi-line
        for file in sorted(path.glob("*.json")):  # name the broken file where it is one
            read_json(file)
        cause = " ".join(str(err).split()) or type(err).__name__  # one line for the CLI
        raise ValueError(
            f"cannot load the tokenizer in {path}: {cause}; if its files are truncated or corrupt, "
            "re-download or re-save them"
        ) from None


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], *, chat_template: bool | None = None, system: str = ""
) -> list[list[int]]:
    """Token ids of each prompt, through the chat template when the tokenizer has one.

    Args:
      tokenizer: from :func:`load_tokenizer`.
      prompts: user messages.
      chat_template: force (True) or skip (False) the template; default: use it if present.
      system: a system message before each prompt (with the template only).

    Returns:
      One list of ids per prompt (the template's generation prompt included).
    """
    use_template = bool(tokenizer.chat_template) if chat_template is None else chat_template
    if use_template and not tokenizer.chat_template:
        raise ValueError("chat_template=True, but the tokenizer has no chat template")
    if not use_template:
        if system:
            raise ValueError("a system message needs the tokenizer's chat template")
        return [tokenizer.encode(p) for p in prompts]
    encoded = []
    first = [{"role": "system", "content": system}] if system else []
    for prompt in prompts:
        out = tokenizer.apply_chat_template(
            [*first, {"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True
        )
        # transformers >= 5 returns a BatchEncoding here, older versions a list of ids.
        encoded.append(list(out["input_ids"] if isinstance(out, BatchEncoding) else out))
    return encoded


def check_same_vocabulary(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase) -> None:
    """Fail unless teacher and student map every token string to the same id.

    Distillation compares the two models' distributions id by id, so any difference in
    the vocabularies silently pairs unrelated tokens. (The models' logit widths may still
    differ by padding: :func:`shared_vocab_size`.)

    Raises:
      ValueError: naming both tokenizers and saying how they differ (sizes, and the first
        differing tokens).
    """
    problems = vocabulary_differences(student, teacher)
    if problems:
        raise ValueError(
            f"teacher and student vocabularies differ ({_names(student, teacher)}): "
            + "; ".join(problems)
            + "; pick a teacher and student that share one tokenizer (the same model family)"
        )


def vocabulary_differences(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase) -> list[str]:
    """How two vocabularies differ, one phrase per difference (sizes; tokens whose ids
    differ, with the first few); empty when every token string has the same id in both."""
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    problems = []
    if len(s_vocab) != len(t_vocab):
        problems.append(f"tokenizer sizes differ: student {len(s_vocab)}, teacher {len(t_vocab)}")
    differing = sorted(tok for tok in s_vocab.keys() | t_vocab.keys() if s_vocab.get(tok) != t_vocab.get(tok))
    if differing:
        examples = ", ".join(
            f"{tok!r}: student {s_vocab.get(tok)} vs teacher {t_vocab.get(tok)}" for tok in differing[:5]
        )
        problems.append(f"{len(differing)} tokens map to different ids (e.g. {examples})")
    return problems


def shared_vocab_size(
    tokenizer: PreTrainedTokenizerBase,
    student_vocab_size: int,
    teacher_vocab_size: int,
) -> int | None:
    """The logit width both models must use, or None when their ``vocab_size`` agree.

    Models of one family share a tokenizer but may pad their embeddings to different sizes
    (Qwen2.5 0.5B: 151,936 rows, 7B: 152,064, tokenizer 151,665); the rows past the
    tokenizer are never a real token, so both are compared over the first
    ``min(student_vocab_size, teacher_vocab_size)`` ids (``Decoder.vocab_limit``).

    Raises:
      ValueError: a token id of the tokenizer has no row in one of the models.
    """
    if student_vocab_size == teacher_vocab_size:
        return None
    shared = min(student_vocab_size, teacher_vocab_size)
    largest_id = max(tokenizer.get_vocab().values())
    if largest_id >= shared:
        smaller = "student" if student_vocab_size < teacher_vocab_size else "teacher"
        raise ValueError(
            f"model vocab_size differs (student {student_vocab_size}, teacher {teacher_vocab_size}) and "
            f"the tokenizer's ids reach {largest_id}, past the {smaller}'s {shared} rows: the two models "
            "do not have a row for every token; pick a teacher and student of one family"
        )
    return shared


def _names(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase) -> str:
    return f"student {student.name_or_path or '(unnamed)'}, teacher {teacher.name_or_path or '(unnamed)'}"
