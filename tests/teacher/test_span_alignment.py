"""Span alignment against a two-pointer oracle, on hand-made hard cases and 10,000 random
strings through real tokenizers of three kinds."""

from __future__ import annotations

import numpy as np
import pytest

from asyncopd_jax.models.token_bytes import printable_bytes, token_bytes
from asyncopd_jax.tasks.tokenizer import build_tokenizer
from asyncopd_jax.teacher.span_alignment import align_answer, align_spans
from tests.tiny_tokenizers import byte_level_bpe, sentencepiece_bpe


def oracle(student: list[int], teacher: list[int]) -> tuple[list[int], list[int], int]:
    """The spans by walking both token lists: the side that has read fewer bytes reads its
    next token, a span closes when both have read the same number of bytes, more than at
    its start, and tokens of no bytes there join it (the module's convention)."""
    out_s, out_t = [-1] * len(student), [-1] * len(teacher)
    i = j = a = b = k = 0
    while i < len(student) or j < len(teacher):
        start = a
        while (a == start or a != b) and (i < len(student) or j < len(teacher)):
            if i < len(student) and (a <= b or j >= len(teacher)):
                out_s[i], a, i = k, a + student[i], i + 1
            else:
                out_t[j], b, j = k, b + teacher[j], j + 1
        while i < len(student) and student[i] == 0:
            out_s[i], i = k, i + 1
        while j < len(teacher) and teacher[j] == 0:
            out_t[j], j = k, j + 1
        k += 1
    return out_s, out_t, k


def check_against_oracle(student, teacher) -> None:
    got = align_spans(student, teacher)
    want_s, want_t, spans = oracle(list(student), list(teacher))
    np.testing.assert_array_equal(got.student_span, want_s)
    np.testing.assert_array_equal(got.teacher_span, want_t)
    assert got.spans == spans


@pytest.mark.parametrize(
    "student, teacher, student_span, teacher_span",
    [
        ([1, 1, 1], [1, 1, 1], [0, 1, 2], [0, 1, 2]),  # the same tokens: one span each
        ([3], [1, 1, 1], [0], [0, 0, 0]),  # a student token over three teacher tokens
        ([1, 2], [3], [0, 0], [0]),  # the reverse
        ([2, 2], [1, 2, 1], [0, 0], [0, 0, 0]),  # boundaries interleave: one span
        ([2, 1, 3], [1, 2, 3], [0, 0, 1], [0, 0, 1]),  # offsets 2, 3, 6 and 1, 3, 6: common 3, 6
        ([0, 2, 0, 1], [1, 1, 0, 1], [0, 0, 0, 1], [0, 0, 0, 1]),  # tokens of no bytes
        ([], [], [], []),
        ([0], [], [0], []),  # an empty text: its empty tokens are one span
    ],
)
def test_hand_made(student, teacher, student_span, teacher_span):
    got = align_spans(student, teacher)
    np.testing.assert_array_equal(got.student_span, student_span)
    np.testing.assert_array_equal(got.teacher_span, teacher_span)
    check_against_oracle(student, teacher)


def test_random_lengths_match_the_oracle():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        text = int(rng.integers(0, 30))
        cuts = [
            np.sort(rng.choice(np.arange(1, text), size=rng.integers(0, max(text - 1, 1)), replace=False))
            for _ in range(2)
        ]
        pair = []
        for c in cuts:
            ends = [*c.tolist(), text] if text else []
            lengths = np.diff([0, *ends]).tolist()
            for _ in range(int(rng.integers(0, 3))):  # a few tokens of no bytes
                lengths.insert(int(rng.integers(0, len(lengths) + 1)), 0)
            pair.append(lengths)
        check_against_oracle(*pair)


def test_unequal_texts_are_refused():
    with pytest.raises(ValueError, match="cover different texts: 3 bytes .student. vs 2"):
        align_spans([1, 2], [2])


def test_printable_bytes_is_a_bijection():
    table = printable_bytes()
    assert sorted(table.values()) == list(range(256)) and len(table) == 256
    assert table["Ġ"] == ord(" ") and table["Ċ"] == ord("\n") and table["a"] == ord("a")
    # the hidden bytes, in order from U+0100: NUL first, DEL after the space, NBSP, the soft hyphen last
    assert table["Ā"] == 0 and table["ġ"] == 0x7F and table["ł"] == 0xA0 and table["Ń"] == 0xAD
    assert table["¡"] == 0xA1 and table["®"] == 0xAE and table["ÿ"] == 0xFF  # visible Latin-1: themselves


def test_printable_bytes_is_the_alphabet_of_a_real_byte_level_tokenizer():
    """Hugging Face tokenizers' byte-level pre-tokenizer writes every byte with the same
    256 characters, and ASCII text with the same ones."""
    from tokenizers.pre_tokenizers import ByteLevel

    table = printable_bytes()
    assert set(ByteLevel.alphabet()) == set(table)
    text = "".join(map(chr, range(128)))
    written = "".join(piece for piece, _ in ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text))
    assert [table[c] for c in written] == list(range(128))


TOKENIZERS = {"byte_level": byte_level_bpe, "sentencepiece": sentencepiece_bpe, "characters": build_tokenizer}


def spans_spell_the_text(s_bytes, t_bytes, ids, alignment) -> None:
    """Every span holds the same bytes on both sides (``s_bytes``, ``t_bytes``: the
    tokenizers' :class:`TokenBytes`), and the spans spell the answer."""
    spans = alignment.spans
    text = alignment.text.encode()
    pieces_s = [b""] * spans.spans
    pieces_t = [b""] * spans.spans
    lengths = s_bytes.lengths(ids)
    data = s_bytes.join(ids)
    if s_bytes.strips_leading_space and data.startswith(b" "):
        data, lengths[int(np.argmax(lengths > 0))] = data[1:], lengths[int(np.argmax(lengths > 0))] - 1
    offset = 0
    for k, n in zip(spans.student_span, lengths):
        if k >= 0:
            pieces_s[k] += data[offset : offset + n]
        offset += n
    t_lengths = t_bytes.lengths(alignment.teacher_ids)
    t_data = t_bytes.join(alignment.teacher_ids)
    if t_data == b" " + text:  # the tokenizer's own prefix space
        t_data, t_lengths[int(np.argmax(t_lengths > 0))] = t_data[1:], t_lengths[int(np.argmax(t_lengths > 0))] - 1
    offset = 0
    for k, n in zip(spans.teacher_span, t_lengths):
        pieces_t[k] += t_data[offset : offset + n]
        offset += n
    assert pieces_s == pieces_t
    assert b"".join(pieces_t) == text
    check_against_oracle([n for k, n in zip(spans.student_span, lengths) if k >= 0], t_lengths.tolist())


ALPHABET = list("abcdefgh 0123456789+-=\n\t") + ["  ", "é", "ü", "世", "界", "🙂", "ß", "€", "😀", "<|sep|>"]


@pytest.mark.parametrize(
    "student_name, teacher_name",
    # the reverse pair is the same property at another setting: CI's second step
    [("byte_level", "sentencepiece"), pytest.param("sentencepiece", "byte_level", marks=pytest.mark.extended)],
)
def test_ten_thousand_random_strings(student_name, teacher_name):
    student, teacher = TOKENIZERS[student_name](), TOKENIZERS[teacher_name]()
    s_bytes, t_bytes = token_bytes(student), token_bytes(teacher)
    rng = np.random.default_rng(1)
    texts = ["".join(rng.choice(ALPHABET, size=int(rng.integers(0, 24)))) for _ in range(10_000)]
    encoded = student(texts, add_special_tokens=False)["input_ids"]
    for ids in encoded:
        alignment = align_answer(s_bytes, teacher, t_bytes, ids, stopped=False, teacher_eos=teacher.eos_token_id)
        # the answer's text is what the student's tokenizer decodes (a SentencePiece-style one
        # drops a leading space, as it does here)
        assert alignment.text == student.decode(ids, skip_special_tokens=False)
        assert (alignment.spans.student_span >= 0).all()
        spans_spell_the_text(s_bytes, t_bytes, ids, alignment)


def aligned(student, teacher, text: str, *, stopped: bool = False, cut: int = 0):
    """``text`` written by ``student`` (its last ``cut`` tokens cut off, its EOS added when
    ``stopped``), aligned to ``teacher``: (student tokens, teacher tokens, alignment)."""
    ids = student.encode(text, add_special_tokens=False)
    ids = ids[: len(ids) - cut] + ([student.eos_token_id] if stopped else [])
    alignment = align_answer(
        token_bytes(student), teacher, token_bytes(teacher), ids, stopped=stopped, teacher_eos=teacher.eos_token_id
    )
    return student.convert_ids_to_tokens(ids), teacher.convert_ids_to_tokens(alignment.teacher_ids), alignment


def test_a_character_split_into_bytes_on_both_sides():
    # 😀 is F0 9F 98 80: the byte-level student holds it as F09F | 98 | 80, the byte-fallback
    # teacher as four byte tokens; the spans cut inside the character where both do
    student, teacher, a = aligned(byte_level_bpe(), sentencepiece_bpe(), "a 😀b")
    assert student == ["a", "Ġ", "ðŁ", "ĺ", "Ģ", "b"]
    assert teacher == ["▁", "a", "▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "b"]
    assert a.spans.student_span.tolist() == [0, 1, 2, 3, 4, 5]
    assert a.spans.teacher_span.tolist() == [0, 0, 1, 2, 2, 3, 4, 5]  # the prefix ▁ holds no byte of the text


def test_whitespace_merged_on_one_side():
    student, teacher, a = aligned(sentencepiece_bpe(), byte_level_bpe(), "the  cat\n\n")
    assert student == ["▁the", "▁", "▁cat", "\n\n"] and teacher == ["the", "Ġ", "Ġc", "at", "ĊĊ"]
    assert a.spans.student_span.tolist() == [0, 1, 2, 3] and a.spans.teacher_span.tolist() == [0, 1, 2, 2, 3]


@pytest.mark.parametrize("reverse", [False, True])
def test_one_token_over_several_and_the_eos_span(reverse):
    # the built-in task's characters against a BPE that merged digits: each of '12', '34',
    # '46' is one token over two; the EOS tokens are a span of their own
    characters, bpe = build_tokenizer(), byte_level_bpe()
    student, teacher, a = aligned(*((bpe, characters) if reverse else (characters, bpe)), "12+34=46", stopped=True)
    chars, merged = [0, 0, 1, 2, 2, 3, 4, 4, 5], [0, 1, 2, 3, 4, 5]
    assert (a.spans.student_span.tolist(), a.spans.teacher_span.tolist()) == (
        (merged, chars) if reverse else (chars, merged)
    )
    assert student[-1] == teacher[-1] == "<eos>" and a.spans.spans == 6


def test_special_tokens_are_their_text():
    student, teacher, a = aligned(byte_level_bpe(), sentencepiece_bpe(), "a<|sep|>b", stopped=True)
    assert student == ["a", "<|sep|>", "b", "<eos>"] and teacher == ["▁", "a", "<|sep|>", "b", "<eos>"]
    assert a.spans.student_span.tolist() == [0, 1, 2, 3] and a.spans.teacher_span.tolist() == [0, 0, 1, 2, 3]


def test_an_answer_cut_inside_a_character():
    # cut at the length limit after F09F | 98 of 😀: the text stops before it, the two tokens
    # are in no span, and no EOS span (the student did not stop)
    student, teacher, a = aligned(byte_level_bpe(), sentencepiece_bpe(), "a😀", cut=1)
    assert student == ["a", "ðŁ", "ĺ"] and a.text == "a"
    assert a.spans.student_span.tolist() == [0, -1, -1] and teacher == ["▁", "a"]
    # stopped on EOS right after the cut bytes (a student writing bytes that are no text):
    # the EOS cannot be compared either
    _, _, stopped = aligned(byte_level_bpe(), sentencepiece_bpe(), "a😀", cut=1, stopped=True)
    assert stopped.spans.student_span.tolist() == [0, -1, -1, -1] and stopped.spans.spans == 1


def test_a_teacher_that_cannot_spell_the_text_is_named():
    with pytest.raises(ValueError, match="teacher tokenizer .*spell .*not the text"):
        aligned(byte_level_bpe(), build_tokenizer(), "the cat")  # the characters lack 't', 'h', ...


def test_wordpiece_is_refused():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    core.decoder = decoders.WordPiece()
    with pytest.raises(ValueError, match="WordPiece vocabulary"):
        token_bytes(PreTrainedTokenizerFast(tokenizer_object=core))
