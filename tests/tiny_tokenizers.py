"""Small tokenizers of the three kinds cross-tokenizer distillation reads
(:mod:`asyncopd_jax.models.token_bytes`), trained here with `tokenizers` in milliseconds:
a byte-level BPE, a SentencePiece-style BPE with byte fallback, and the built-in task's
character vocabulary (:mod:`asyncopd_jax.tasks.tokenizer`)."""

from __future__ import annotations

import functools
import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Text with merges to learn (repeated words, runs of spaces and newlines) and characters of
# two, three and four UTF-8 bytes
CORPUS = [
    "the cat sat on the mat  and the dog sat on the log\n\n",
    "12+34=46  so 46-12=34\n",
    "héllo wörld, café crème brûlée",
    "世界 你好 世界 你好",
    "emoji 🙂 and 🙂🙂 done",
    "    indented  code\tline\n",
] * 4
SPECIALS = ["<eos>", "<|sep|>"]


@functools.cache
def byte_level_bpe(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """GPT-2-style: byte-level pre-tokeniser and decoder; every byte is a token."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=SPECIALS
    )
    core.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", clean_up_tokenization_spaces=False)


@functools.cache
def sentencepiece_bpe(vocab_size: int = 160) -> PreTrainedTokenizerFast:
    """Llama-2-style: ``▁`` for spaces, a ``▁`` prefix the decoder strips, and ``<0xNN>`` byte
    tokens for any character outside its 40-character alphabet."""
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, limit_alphabet=40)
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    core.train_from_iterator(CORPUS, trainer)
    learned = json.loads(core.to_str())["model"]
    vocab = dict(learned["vocab"])
    for byte in range(256):  # the byte tokens live in the model's vocabulary, as Llama 2's do
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    fallback = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    fallback.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    fallback.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    fallback.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=fallback, eos_token="<eos>", clean_up_tokenization_spaces=False)
