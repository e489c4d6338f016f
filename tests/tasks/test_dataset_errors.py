"""Bad dataset files and prompts too long for the model: one line naming the file, the rows
and the fields at fault (the cases tests/tasks/test_dataset.py does not cover)."""

from __future__ import annotations

import json

import pytest

from asyncopd_jax.config import TaskConfig
from asyncopd_jax.tasks import make_task
from asyncopd_jax.tasks.dataset import DatasetError, Example, read_examples
from asyncopd_jax.tasks.tokenizer import build_tokenizer


def _lines(path, lines: list[str | dict]):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_every_invalid_json_row_is_named_not_just_the_first(tmp_path):
    path = _lines(tmp_path / "d.jsonl", [{"q": "a"}, "{not json", {"q": "b"}, '{"q": "unterminated'])
    with pytest.raises(DatasetError) as err:
        read_examples(path, "q")
    assert str(err.value) == (
        f"{path}: rows 2, 4 are not valid JSON (row 2: Expecting property name enclosed in "
        "double quotes, column 2); row 1 has: q"
    )


def test_rows_that_are_not_json_objects_are_named(tmp_path):
    path = _lines(tmp_path / "d.jsonl", ['"just text"', {"q": "a"}, "[1, 2]", "null"])
    with pytest.raises(DatasetError) as err:
        read_examples(path, "q")
    # the fields shown are those of the first object, row 2
    assert str(err.value) == f"{path}: rows 1, 3, 4 are not a JSON object (row 1: a JSON string); row 2 has: q"


def test_a_row_that_is_not_utf8_is_named_and_a_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"q": "a"}\n{"q": "caf\xe9"}\n')  # a BOM, then Latin-1 text
    with pytest.raises(DatasetError, match=r"d.jsonl: row 2 is not UTF-8 text \(byte 11\)"):
        read_examples(path, "q")
    path.write_bytes(b'\xef\xbb\xbf{"q": "a"}\n{"q": "caf\xc3\xa9"}\n')
    assert read_examples(path, "q") == [Example("a", None, 1), Example("café", None, 2)]


def test_null_answers_are_named_when_answers_are_required(tmp_path):
    path = _lines(tmp_path / "d.jsonl", [{"q": "a", "a": 1}, {"q": "b", "a": None}, {"q": "c", "a": None}])
    with pytest.raises(DatasetError) as err:
        read_examples(path, "q", "a", require_answers=True)
    assert str(err.value) == f"{path}: rows 2, 3: the answer 'a' (task.answer_field) is null; row 1 has: a, q"
    # distillation needs no answers: a null one is just absent
    assert [e.answer for e in read_examples(path, "q", "a")] == ["1", None, None]


def test_a_nested_prompt_field_whose_parent_is_not_an_object(tmp_path):
    path = _lines(tmp_path / "d.jsonl", [{"meta": {"question": "a"}}, {"meta": "flat"}])
    with pytest.raises(
        DatasetError, match=r"row 2 has no field 'meta.question' \(task.prompt_field\); row 1 has: meta"
    ):
        read_examples(path, "meta.question")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_an_unreadable_parquet_file_is_named(tmp_path, damage):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"q": ["a", "b"] * 50}), path)
    data = path.read_bytes()
    path.write_bytes(b"not parquet at all" * 10 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(DatasetError) as err:
        read_examples(path, "q")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}: cannot be read as Parquet ("), message
    assert message.endswith("; the file is truncated or corrupt: write it again"), message


# --- prompts longer than the model's context ---


def _dataset_task(path, *, max_new_tokens: int, max_positions: int):
    task = TaskConfig(name="dataset", path=str(path), prompt_field="q", answer_field="", eval_fraction=0.0)
    return make_task(task, build_tokenizer(), max_new_tokens=max_new_tokens, max_positions=max_positions)


def test_dataset_prompts_too_long_for_the_context_name_every_row(tmp_path):
    # the character tokenizer has no chat template: a prompt's tokens are its characters
    path = _lines(tmp_path / "d.jsonl", [{"q": "1+2="}, {"q": "1+" * 10 + "1="}, {"q": "3="}, {"q": "2+" * 20 + "2="}])
    with pytest.raises(DatasetError) as err:
        _dataset_task(path, max_new_tokens=16, max_positions=32)
    assert str(err.value) == (
        f"{path}: rows 2, 4: prompt + sampling.max_new_tokens (16) is longer than the models' context (32 "
        "positions; longest prompt 42 tokens), the smaller max_position_embeddings of the student's and the "
        "teacher's config.json; shorten those prompts, drop them, or lower sampling.max_new_tokens"
    )
    # exactly filling the context is fine: 22 + 10 = 32
    path = _lines(tmp_path / "e.jsonl", [{"q": "1+2="}, {"q": "1+" * 10 + "1="}])
    assert _dataset_task(path, max_new_tokens=10, max_positions=32).prompt_slots == 22


def test_builtin_prompts_too_long_for_the_context_name_the_fields(tmp_path):
    task = TaskConfig(difficulty=8, max_value=999)
    with pytest.raises(ValueError) as err:
        make_task(task, build_tokenizer(), max_new_tokens=120, max_positions=128)
    assert str(err.value) == (
        "task.name = arith: the longest prompt (34 tokens at task.difficulty = 8, task.max_value = 999) + the answer "
        "(120 tokens: sampling.max_new_tokens = 120, longest solution 104) is longer than the models' context "
        "(128 positions, the smaller max_position_embeddings of the student's and the teacher's config.json); "
        "lower sampling.max_new_tokens, task.difficulty or task.max_value"
    )
    # the evaluation's own answers count too: sampling.max_new_tokens below them does not hide them
    with pytest.raises(
        ValueError, match=r"the answer \(104 tokens: sampling.max_new_tokens = 28, longest solution 104\)"
    ):
        make_task(task, build_tokenizer(), max_new_tokens=28, max_positions=128)
    # 34 + 104 = 138 positions: exactly enough
    assert make_task(task, build_tokenizer(), max_new_tokens=28, max_positions=138).prompt_slots == 34
    # the built-in models' context holds the default task
    assert make_task(TaskConfig(), build_tokenizer(), max_new_tokens=28, max_positions=128).prompt_slots == 11
