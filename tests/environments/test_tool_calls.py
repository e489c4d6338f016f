"""Tool calls in Qwen3's format (Hermes-style, as its documentation writes them: a JSON object
between ``<tool_call>`` tags; outputs between ``<tool_response>`` tags), parsed and rendered."""

from __future__ import annotations

from asyncopd_jax.environments import ToolCall, parse_hermes, render_hermes

# An assistant turn as Qwen3 writes one: thinking, then two calls.
TURN = """<think>
I need two products.
</think>

<tool_call>
{"name": "calculator", "arguments": {"expression": "12*34"}}
</tool_call>
<tool_call>
{"name": "calculator", "arguments": "{\\"expression\\": \\"5+6\\"}"}
</tool_call>"""


def test_each_call_is_parsed_in_order_with_string_arguments_read_as_json():
    parsed = parse_hermes(TURN)
    assert parsed.calls == [
        ToolCall("calculator", {"expression": "12*34"}),
        ToolCall("calculator", {"expression": "5+6"}),
    ]
    assert parsed.errors == [] and parsed.any


def test_a_turn_without_calls_is_an_answer():
    parsed = parse_hermes("The answer is 408.")
    assert parsed.calls == [] and parsed.errors == [] and not parsed.any


def test_calls_that_do_not_parse_are_errors_naming_their_place():
    text = (
        "<tool_call>{not json}</tool_call>"
        '<tool_call>["calculator"]</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": 5}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
        "<tool_call>{"
    )
    parsed = parse_hermes(text)
    assert parsed.calls == [ToolCall("calculator", {"expression": "1+1"})]
    assert [e.split(" ")[2] for e in parsed.errors[:3]] == ["1", "2", "3"]
    assert "is not JSON" in parsed.errors[0] and '"name" string' in parsed.errors[1]
    assert '"arguments" must be an object' in parsed.errors[2]
    assert parsed.errors[3] == "1 <tool_call> without </tool_call>"


def test_outputs_are_rendered_between_tool_response_tags():
    assert (
        render_hermes(["408", "11"]) == "<tool_response>\n408\n</tool_response>\n<tool_response>\n11\n</tool_response>"
    )
