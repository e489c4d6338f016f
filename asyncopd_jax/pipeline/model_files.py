"""A model's small files, read without its weights: its ``config.json`` and its tokenizer
(a local directory or ``builtin:NAME``)."""

from __future__ import annotations

from typing import Any

from asyncopd_jax.config import ModelSource
from asyncopd_jax.models import DecoderConfig, from_pretrained, load_tokenizer
from asyncopd_jax.models.config import read_hf_config
from asyncopd_jax.tasks.assets import resolve_model_path


def model_config(source: ModelSource) -> DecoderConfig:
    """A model's ``config.json``, read and checked as the loader does (no weights)."""
    directory = resolve_model_path(source.path)
    if not directory.is_dir():
        from_pretrained(directory)  # raises the loader's own error naming the directory
    return read_hf_config(directory)[0]


def read_tokenizer(path: str) -> Any:
    """The tokenizer of the model directory (or ``builtin:NAME``) ``path``."""
    return load_tokenizer(resolve_model_path(path))
