"""Cross-tokenizer study: its verdict rule, its token counts, the SFT arm's data, and the
quick study end to end."""

from __future__ import annotations

import numpy as np
import pytest

from asyncopd_jax.config import TaskConfig
from asyncopd_jax.studies import cross_tokenizer
from asyncopd_jax.studies.cross_tokenizer import peak_tokens, tokens_per_answer, train_sft_arm, verdict
from asyncopd_jax.tasks.arith import sample_problems
from asyncopd_jax.tasks.builtin import TaskData
from asyncopd_jax.tasks.tokenizer import EOS_ID, build_tokenizer


def test_the_verdict_is_about_the_mean_gap_and_its_side():
    same = np.array([0.97, 0.95, 0.96])
    assert verdict(same - 0.02, same) == "within 3 points: cross-tokenizer OPD ends 2.0 points below same-tokenizer OPD"
    assert verdict(same - 0.10, same).startswith("not within 3 points: cross-tokenizer OPD ends 10.0 points below")
    assert verdict(same + 0.05, same).startswith("not within 3 points: cross-tokenizer OPD ends 5.0 points above")


def test_tokens_per_answer_reads_the_first_and_last_batches():
    result = {"records": [{"step": i, "tokens": 64.0 * (10 if i < 20 else 20)} for i in range(40)]}
    assert tokens_per_answer(result, 64, first=True) == 10.0
    assert tokens_per_answer(result, 64, first=False) == 20.0


def test_peak_tokens_finds_where_the_answers_are_longest():
    counts = [16] * 30 + [21] * 12 + [18] * 60
    result = {"records": [{"step": i + 1, "tokens": 64.0 * c} for i, c in enumerate(counts)]}
    step, tokens = peak_tokens(result, 64)
    assert tokens == pytest.approx(21.0) and 31 <= step <= 42


def test_the_sft_arm_trains_on_the_answers_in_the_students_tokens():
    merges = build_tokenizer("merges")
    task = TaskData(TaskConfig(), merges)
    problems = sample_problems(np.random.default_rng(0), 2, 3, 99, held_out=False)
    texts = [p.solution((0, 1, 2)) for p in problems]
    batch = task.answer_batch(problems, texts, task.prompt_slots, task.max_new_tokens)
    for row, text in enumerate(texts):
        ids = np.asarray(batch.response_tokens)[row][np.asarray(batch.response_mask)[row]].tolist()
        assert ids == merges.encode(text) + [EOS_ID] and len(ids) < len(text)  # byte pairs, not characters


@pytest.mark.extended  # a teacher sampling and an SFT step, 8 s: CI's second step (the quick study is slow)
def test_the_sft_arm_records_its_losses_and_evaluations(tmp_path):
    sets = cross_tokenizer._sft_sets(0, cross_tokenizer.Settings(steps=2, batch_size=4, eval_every=2, eval_prompts=8))
    line, seconds = train_sft_arm(tmp_path, "sft", sets)
    assert line["name"] == "sft" and line["sets"] == sets and line["error"] is None and seconds > 0
    assert line["columns"]["step"] == [1, 2] and all(np.isfinite(line["columns"]["loss"]))
    assert line["columns"]["eval_accuracy"] == {"at": [1], "values": [line["summary"]["student_after"]]}
    assert line["summary"]["teacher_accuracy"] > 0.9


@pytest.mark.slow
def test_the_quick_study_writes_its_report(tmp_path):
    path = cross_tokenizer.run(tmp_path / "docs", tmp_path / "work", quick=True, seeds=1, command="asyncopd study x")
    text = path.read_text()
    assert "## Verdict" in text and all(arm in text for arm in cross_tokenizer.ARMS)
    assert (tmp_path / "docs" / "cross_tokenizer" / "accuracy.png").is_file()
    assert len((tmp_path / "docs" / "cross_tokenizer" / "runs.jsonl").read_text().splitlines()) == 5


def test_the_byte_prefix_arm_is_the_cross_tokenizer_arm_with_the_mapping():
    from asyncopd_jax.config import load_config
    from asyncopd_jax.pipeline.run_models import run_models

    spans = cross_tokenizer._opd_sets("cross_tokenizer", 1, cross_tokenizer.QUICK)
    byte_prefix = cross_tokenizer._opd_sets("byte_prefix", 1, cross_tokenizer.QUICK)
    assert byte_prefix == [*spans, "teacher.mapping=byte_prefix", "sampling.student_topk=8", "teacher.from_teacher=4"]
    cfg = load_config(cross_tokenizer.DEMO, byte_prefix)
    assert cfg.teacher.mapping == "byte_prefix" and list(run_models(cfg).retokenizers) == ["teacher"]
