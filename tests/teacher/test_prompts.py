"""Teacher-only prompts: the template's slots, rendering over nested fields, and the errors
a bad template or a missing field gets."""

from __future__ import annotations

import pytest

from asyncopd_jax.teacher.prompts import TeacherPrompt, field, render, slots


def test_render_fills_each_slot_from_the_fields_dots_reaching_into_nested_ones():
    fields = {"prompt": "Q:1+2=", "meta": {"solution": "1+2=3;A=3", "n": 2}}
    assert slots("{meta.solution} {{x}} {prompt}") == ["meta.solution", "prompt"]
    assert render("S:{meta.solution}|{prompt}|{meta.n}", fields) == "S:1+2=3;A=3|Q:1+2=|2"
    assert render("{{literal}} {prompt}}}", fields) == "{literal} Q:1+2=}"
    assert render("no slots", {}) == "no slots"


def test_a_missing_field_is_a_key_error_naming_it():
    with pytest.raises(KeyError, match="meta.answer"):
        render("{prompt} {meta.answer}", {"prompt": "p", "meta": {"solution": "s"}})
    with pytest.raises(KeyError, match="prompt.text"):  # a string has no fields
        field({"prompt": "p"}, "prompt.text")


@pytest.mark.parametrize(
    ("template", "what"),
    [("{prompt", "a lone '{' at character 1"), ("a}b", "a lone '}' at character 2"), ("x{}y", "an empty slot")],
)
def test_a_lone_brace_or_an_empty_slot_fails_when_the_config_is_read(template, what):
    with pytest.raises(ValueError, match=f"prompt.template .*: {what}"):
        TeacherPrompt(template=template)


def test_a_system_message_needs_a_template():
    with pytest.raises(ValueError, match=r"^prompt.system = 'be brief' is set without prompt.template"):
        TeacherPrompt(system="be brief")
    assert TeacherPrompt(template="{prompt}", system="be brief").own
    assert not TeacherPrompt().own
