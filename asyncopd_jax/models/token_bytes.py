"""What text each token id stands for, in bytes: the common ground of two tokenizers.

Cross-tokenizer distillation (:mod:`asyncopd_jax.teacher.span_alignment`) compares a student and a
teacher that cut the same text into different tokens. It needs, for every id of each
vocabulary, the exact bytes the id adds to the text when it is decoded mid-sequence: a
byte-level BPE token may hold half of a UTF-8 character, and a byte-fallback token
(``<0xE2>``) one byte of it, so characters are too coarse a unit.

Three ways of writing a token's bytes cover the fast tokenizers in use, told apart by the
tokenizer's decoder (``tokenizer.json``):

* byte-level (GPT-2, Llama 3, Qwen): each character of the token string stands for one
  byte through GPT-2's printable-byte table;
* SentencePiece-style (Llama 2, Gemma, Mistral): ``▁`` is a space and ``<0xNN>`` is the
  byte NN (byte fallback);
* plain (word-level or character vocabularies, as the built-in task's): the token string
  is its text.

Added tokens (specials such as ``<|im_end|>``) stand for their own content. A WordPiece
vocabulary (``##`` continuations) or a slow tokenizer is refused with an error naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any

import numpy as np

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _visible(byte: int) -> bool:
    """Whether a byte's Latin-1 character is visible: not a control, space, DEL, NBSP or
    the soft hyphen."""
    return 0x21 <= byte <= 0x7E or 0xA1 <= byte <= 0xAC or 0xAE <= byte <= 0xFF


@functools.cache
def printable_bytes() -> dict[str, int]:
    """The byte-level BPE alphabet, read backwards: the character a token string writes
    for each byte → that byte.

    By the definition of byte-level BPE, every byte is written as one visible character:
    a byte whose Latin-1 character is visible (:func:`_visible`: 188 of them) as itself, and
    the other 68, taken in increasing order, as U+0100, U+0101, … (so the space, 0x20, is
    ``Ġ``, U+0120, and the newline, 0x0A, is ``Ċ``, U+010A)."""
    hidden = [byte for byte in range(256) if not _visible(byte)]
    table = {chr(byte): byte for byte in range(256) if _visible(byte)}
    table.update({chr(0x100 + n): byte for n, byte in enumerate(hidden)})
    return table


def _decoder_steps(decoder: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The decoder of ``tokenizer.json`` as a flat list of steps."""
    if decoder is None:
        return []
    if decoder.get("type") == "Sequence":
        return [step for inner in decoder["decoders"] for step in _decoder_steps(inner)]
    return [decoder]


@dataclasses.dataclass(frozen=True)
class TokenBytes:
    """The bytes of every id of one tokenizer.

    Attributes:
      name: the tokenizer's directory (for errors).
      pieces: ``pieces[i]``, the bytes id ``i`` adds to the text (b'' for an id the
        vocabulary does not use).
      special: the ids of special tokens (``<eos>``, ``<pad>``, chat markers).
      strips_leading_space: the decoder drops a space at the start of a text that the
        encoder adds (SentencePiece's ``▁`` prefix): a text's first token holds one byte
        more than the text.
    """

    name: str
    pieces: tuple[bytes, ...]
    special: frozenset[int]
    strips_leading_space: bool

    def lengths(self, ids: Any) -> np.ndarray:
        """``[n]`` int64 bytes of each id of ``ids``."""
        return np.asarray([len(self.pieces[int(i)]) for i in ids], np.int64)

    def join(self, ids: Any) -> bytes:
        """The bytes of ``ids`` in order."""
        return b"".join(self.pieces[int(i)] for i in ids)

    def at_text_start(self, data: bytes) -> bytes:
        """``data`` at the start of a text: without the leading space the decoder drops
        (:attr:`strips_leading_space`: the encoder's ``▁``, not the text's)."""
        return data[1:] if self.strips_leading_space and data.startswith(b" ") else data

    @functools.cached_property
    def by_bytes(self) -> dict[bytes, int]:
        """Each non-special token's bytes → its id (the lowest, where two ids share them)."""
        table: dict[bytes, int] = {}
        for i, piece in enumerate(self.pieces):
            if piece and i not in self.special:
                table.setdefault(piece, i)
        return table


def token_bytes(tokenizer: Any) -> TokenBytes:
    """The :class:`TokenBytes` of a fast Hugging Face tokenizer (module docstring).

    Raises:
      ValueError: a slow tokenizer (no ``tokenizer.json``), or a vocabulary whose tokens'
        bytes cannot be read off their strings (WordPiece); the tokenizer named.
    """
    name = getattr(tokenizer, "name_or_path", "") or "(unnamed)"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"tokenizer {name}: a slow tokenizer; cross-tokenizer distillation needs a fast one "
            "(a tokenizer.json in the directory)"
        )
    spec = json.loads(backend.to_str())
    steps = _decoder_steps(spec.get("decoder"))
    kinds = {step.get("type") for step in steps}
    if "WordPiece" in kinds or spec.get("model", {}).get("type") == "WordPiece":
        raise ValueError(
            f"tokenizer {name}: a WordPiece vocabulary ('##' pieces), whose tokens' text depends on their "
            "neighbours; allowed across tokenizers: byte-level BPE, SentencePiece-style, or plain vocabularies"
        )
    byte_level = "ByteLevel" in kinds
    metaspace = "Metaspace" in kinds or any(
        step.get("type") == "Replace" and step.get("pattern", {}).get("String") == "▁" for step in steps
    )
    strips = any(step.get("type") == "Strip" and step.get("start", 0) >= 1 for step in steps) or any(
        step.get("type") == "Metaspace" and step.get("prepend_scheme", "always") != "never" for step in steps
    )
    table = printable_bytes()
    added = {int(i): tok.content for i, tok in tokenizer.added_tokens_decoder.items()}
    special = frozenset(int(i) for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    size = max([*tokenizer.get_vocab().values(), *added, -1]) + 1
    pieces = [b""] * size
    for token, i in tokenizer.get_vocab().items():
        if i in added:
            pieces[i] = added[i].encode("utf-8")
        elif byte_level:
            pieces[i] = bytes(table[c] for c in token) if all(c in table for c in token) else token.encode("utf-8")
        elif match := _BYTE_TOKEN.fullmatch(token):
            pieces[i] = bytes([int(match.group(1), 16)])
        elif metaspace:
            pieces[i] = token.replace("▁", " ").encode("utf-8")
        else:
            pieces[i] = token.encode("utf-8")
    return TokenBytes(name, tuple(pieces), special, strips and not byte_level)


__all__ = ["TokenBytes", "printable_bytes", "token_bytes"]
