"""The config of several teachers and of a teacher-only prompt: what it accepts, and the
one-line error for each thing it refuses, naming the teacher's own section."""

from __future__ import annotations

import pytest

from asyncopd_jax.config import ConfigError, load_config

URL = "http://teacher.test:8000"
TWO = ["teacher.path=''", "teachers=[{name: a, path: 'builtin:teacher'}, {name: b, path: 'builtin:student'}]"]


def teachers(*entries: str) -> list[str]:
    return ["teacher.path=''", f"teachers=[{', '.join(entries)}]"]


def test_two_teachers_each_with_its_own_settings():
    cfg = load_config(
        "demo",
        teachers(
            "{name: a, path: 'builtin:teacher', weight: 3, temperature: 0.8, prompt: {template: '{answer};{prompt}'}}",
            f"{{name: b, server: {{url: '{URL}', api: asyncopd}}}}",
        ),
    )
    a, b = cfg.teacher_sources
    assert (a.name, a.weight, a.scoring(cfg.scoring).temperature, a.prompt.own) == ("a", 3.0, 0.8, True)
    assert (b.name, b.served, b.scoring(cfg.scoring).temperature, b.prompt.own) == ("b", True, 1.0, False)
    assert cfg.in_process_teacher is None  # two teachers: no probe reads "the" teacher
    one = load_config("demo")
    assert one.teacher_sources == (one.teacher,) and one.in_process_teacher is one.teacher


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (  # teachers given by override replace the file's teacher, unless teacher.path is set with them
            ["teacher.path=builtin:teacher", *TWO[1:]],
            r"^teacher.path = 'builtin:teacher' / teacher.server.url = '' is set with teachers \(2 listed\); "
            r"allowed: one of them",
        ),
        (teachers("{name: a, path: x}", "{name: a, path: y}"), r"^teachers: the name 'a' is used twice"),
        (teachers("{name: a, path: x}", "{name: b}"), r"^teachers\[1\] \('b'\) has neither path nor server.url"),
        (teachers("{name: 'a b', path: x}"), r"^teachers\[0\]: teacher name 'a b' is invalid; allowed: letters"),
        (
            teachers("{name: a, path: x, weight: 0}"),
            r"^teachers\[0\]: teacher 'a': weight = 0.0 is invalid; allowed: > 0",
        ),
        ([*TWO, "routing.by=field"], r"^routing.by = field is invalid with task.name = arith \(it has no fields\)"),
        (
            teachers("{name: a, path: x}", f"{{name: b, server: {{url: '{URL}'}}, temperature: 0.5}}"),
            r"^teachers\[1\].temperature = 0.5 is invalid with teachers\[1\].server.api = vllm: its log-probs are "
            r"the model's raw distribution",
        ),
        (
            [
                *teachers("{name: a, path: x}", f"{{name: b, server: {{url: '{URL}', api: sglang}}}}"),
                "estimator.name=reverse_kl_mc",
                "sampling.num_candidates=4",
            ],  # (vLLM: its start-up probe decides; tests/teacher/test_client.py)
            r"^estimator.name = 'reverse_kl_mc' needs .* which a teachers\[1\].server.api = sglang teacher cannot "
            r"score; allowed: an in-process teacher \(teachers\[1\].path\)",
        ),
        ([*TWO, "train.diagnostics_every=5"], r"^train.diagnostics_every = 5 needs one in-process teacher"),
        (
            ["teacher.prompt.template='{prompt}'", "train.diagnostics_every=5"],
            r"^teacher.prompt.template is invalid with train.diagnostics_every",
        ),
        (["teacher.prompt.system=hi"], r"^teacher.prompt: prompt.system = 'hi' is set without prompt.template"),
        (["teacher.prompt.template=x{"], r"^teacher.prompt: prompt.template 'x\{': a lone '\{' at character 2"),
    ],
)
def test_what_several_teachers_or_a_teacher_prompt_cannot_do_is_refused_in_one_line(overrides, expected):
    with pytest.raises(ConfigError, match=expected) as err:
        load_config("demo", overrides)
    assert "\n" not in str(err.value)
