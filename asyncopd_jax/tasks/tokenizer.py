"""The built-in task's character-level tokenizer, built with `tokenizers`, saved in HF layout."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from asyncopd_jax.tasks.arith import CHARS

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
PAD_ID, EOS_ID = 0, 1


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of :data:`CHARS`, plus ``<pad>`` (0), ``<eos>`` (1), ``<unk>``."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(CHARS))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("<[a-z]+>|."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(path: str | Path) -> Path:
    """Write the tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, …) to ``path``."""
    path = Path(path)
    build_tokenizer().save_pretrained(path)
    return path
