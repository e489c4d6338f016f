"""Reading user datasets: fields, nested names, bad rows named, the held-out split."""

from __future__ import annotations

import json

import pytest

from asyncopd_jax.tasks.dataset import DatasetError, Example, read_examples, split_held_out


def _jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_prompts_and_answers_are_read_with_their_rows(tmp_path):
    path = _jsonl(
        tmp_path / "d.jsonl", [{"q": "1+1?", "a": 2}, "", {"q": "Name?", "a": "Ada", "x": 1}, {"q": "No answer"}]
    )
    assert read_examples(path, "q", "a") == [
        Example("1+1?", "2", 1),
        Example("Name?", "Ada", 3),
        Example("No answer", None, 4),
    ]
    assert [e.answer for e in read_examples(path, "q")] == [None, None, None]


def test_a_dotted_field_reaches_into_nested_objects(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"meta": {"question": "Why?"}, "gold": {"value": "3"}}])
    assert read_examples(path, "meta.question", "gold.value") == [Example("Why?", "3", 1)]


def test_missing_fields_name_the_rows_and_what_the_rows_have(tmp_path):
    rows = [{"problem": "p", "solution": "s"}] + [{"question": "q", "answer": "1"}] * 2 + [{"problem": "p"}]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DatasetError) as err:
        read_examples(path, "question")
    assert str(err.value) == (
        f"{path}: rows 1, 4 have no field 'question' (task.prompt_field); row 1 has: problem, solution"
    )
    # RL needs answers: a row without one is named
    with pytest.raises(DatasetError, match=r"row 1 has no field 'answer' \(task.answer_field\)"):
        read_examples(
            _jsonl(tmp_path / "e.jsonl", [{"question": "q"}, {"question": "r", "answer": 2}]),
            "question",
            "answer",
            require_answers=True,
        )
    with pytest.raises(DatasetError, match="task.answer_field must name the reference answers"):
        read_examples(path, "problem", None, require_answers=True)


def test_many_bad_rows_are_counted_not_all_listed(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"x": i} for i in range(25)])
    with pytest.raises(DatasetError, match=r"rows 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and 15 more have no field 'q'"):
        read_examples(path, "q")


def test_bad_json_empty_prompts_and_other_formats_are_refused(tmp_path):
    with pytest.raises(DatasetError, match=r"d.jsonl: row 2 is not valid JSON"):
        read_examples(_jsonl(tmp_path / "d.jsonl", [{"q": "a"}, "{not json"]), "q")
    with pytest.raises(DatasetError, match=r"rows 2, 3: the prompt is not a non-empty string"):
        read_examples(_jsonl(tmp_path / "e.jsonl", [{"q": "a"}, {"q": 5}, {"q": "  "}]), "q")
    with pytest.raises(DatasetError, match=r"unsupported dataset format '.csv'; allowed: .jsonl, .parquet"):
        (tmp_path / "d.csv").write_text("q\n1\n")
        read_examples(tmp_path / "d.csv", "q")
    with pytest.raises(DatasetError, match="dataset file not found"):
        read_examples(tmp_path / "missing.jsonl", "q")
    with pytest.raises(DatasetError, match="no examples"):
        read_examples(_jsonl(tmp_path / "f.jsonl", [""]), "q")


def test_parquet_rows_are_read_like_jsonl_lines(tmp_path):
    import pyarrow as pa  # the parquet extra; the test extra includes it
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"q": ["a", "b"], "a": [1, 2]}), tmp_path / "d.parquet")
    assert read_examples(tmp_path / "d.parquet", "q", "a") == [Example("a", "1", 1), Example("b", "2", 2)]


def test_the_held_out_split_is_fixed_by_prompt_and_near_the_fraction():
    examples = [Example(f"prompt {i}", None, i + 1) for i in range(2000)]
    train, held = split_held_out(examples, 0.1)
    assert len(train) + len(held) == 2000 and 150 < len(held) < 250
    # the same prompts are held out whatever the order of the file (their rows change)
    _, held_reversed = split_held_out([Example(e.prompt, None, i + 1) for i, e in enumerate(examples[::-1])], 0.1)
    assert {e.prompt for e in held} == {e.prompt for e in held_reversed}
    assert split_held_out(examples, 0.0) == (examples, [])
    with pytest.raises(DatasetError, match=r"task.eval_fraction = 1.0 is invalid; allowed: 0 <= fraction < 1"):
        split_held_out(examples, 1.0)
