"""Tokenizers from local directories, chat templates, and the teacher/student vocabulary check."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from asyncopd_jax.models import check_same_vocabulary, encode_prompts, load_tokenizer

TEMPLATE = (
    "{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}"
)


def make_tokenizer(path: Path, words: list[str], *, chat_template: str | None = TEMPLATE) -> Path:
    """A word-level tokenizer built with the `tokenizers` library, saved in the HF layout."""
    specials = ["<pad>", "<eos>", "<unk>", "<user>", "</user>", "<bot>"]
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Split(Regex(r"<[^>]+>|\w+|[^\w\s]"), behavior="isolated"),
        ]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    return path


def test_load_and_chat_template(tmp_path):
    tok = load_tokenizer(make_tokenizer(tmp_path / "t", ["what", "is", "2", "+", "3"]))
    plain = encode_prompts(tok, ["what is 2 + 3"], chat_template=False)
    templated = encode_prompts(tok, ["what is 2 + 3"])
    vocab = tok.get_vocab()
    assert plain == [[vocab[w] for w in ["what", "is", "2", "+", "3"]]]
    assert templated == [[vocab["<user>"], *plain[0], vocab["</user>"], vocab["<bot>"]]]


def test_without_template(tmp_path):
    tok = load_tokenizer(make_tokenizer(tmp_path / "t", ["a"], chat_template=None))
    assert encode_prompts(tok, ["a"]) == [[tok.get_vocab()["a"]]]
    with pytest.raises(ValueError, match="has no chat template"):
        encode_prompts(tok, ["a"], chat_template=True)


def test_missing_directory_or_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="expected one of tokenizer.json"):
        load_tokenizer(tmp_path / "empty")


def test_vocabulary_check(tmp_path):
    a = load_tokenizer(make_tokenizer(tmp_path / "a", ["x", "y", "z"]))
    same = load_tokenizer(make_tokenizer(tmp_path / "same", ["x", "y", "z"]))
    swapped = load_tokenizer(make_tokenizer(tmp_path / "swapped", ["x", "z", "y"]))
    bigger = load_tokenizer(make_tokenizer(tmp_path / "bigger", ["x", "y", "z", "w"]))
    check_same_vocabulary(a, same)
    with pytest.raises(ValueError, match=r"2 tokens map to different ids \(e.g. 'y': student 7 vs teacher 8"):
        check_same_vocabulary(a, swapped)
    with pytest.raises(ValueError, match="tokenizer sizes differ: student 9, teacher 10"):
        check_same_vocabulary(a, bigger)
