"""A tool turn's tokens, read off the student's chat template. The template here is written
for these tests from Qwen3's documented format (ChatML turns; tool outputs as a ``user`` turn
of ``<tool_response>`` blocks, consecutive ones together), not downloaded."""

from __future__ import annotations

import copy

import pytest

from asyncopd_jax.environments.chat_turns import observation_ids, observation_text
from tests.tiny_tokenizers import byte_level_bpe

QWEN3_STYLE = (  # one line: every newline is in a string, none from the template's layout
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chatml():
    tokenizer = copy.deepcopy(byte_level_bpe())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = QWEN3_STYLE
    return tokenizer


def test_the_tool_turn_follows_the_students_stop_token(chatml):
    text = observation_text(chatml, ["408", "11"], "<|im_end|>")
    assert text == (
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\n11\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_its_ids_continue_a_trajectory_as_the_template_writes_the_whole(chatml):
    """The student's turn (its ids, up to its stop token) and the observation's ids are the
    ids of the template's rendering of the conversation, from the student's turn on."""
    stop = chatml.convert_tokens_to_ids("<|im_end|>")
    turn = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'
    ids = chatml.encode(turn, add_special_tokens=False) + [stop] + observation_ids(chatml, ["408"], stop)
    whole = chatml.apply_chat_template(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": turn}, {"role": "tool", "content": "408"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    start = whole.index(turn)
    assert chatml.decode(ids) == whole[start:]
    assert ids[-3:] == chatml.encode("<|im_start|>assistant\n", add_special_tokens=False)[-3:]


@pytest.mark.parametrize(
    "template, stop, says",
    [
        (None, "<|im_end|>", "has no chat template"),
        (QWEN3_STYLE, "<eos>", r"closes an assistant turn with '<\|im_end\|>.*not the student's stop token '<eos>'"),
        (
            QWEN3_STYLE.replace("+ m.content + '\\n</tool_response>'", "+ '</tool_response>'"),
            "<|im_end|>",
            "leaves a tool",
        ),
        ("{{ raise_exception('no tools') }}", "<|im_end|>", "cannot render a tool turn"),
    ],
)
def test_a_template_that_cannot_write_a_tool_turn_is_refused_in_one_line(chatml, template, stop, says):
    tokenizer = copy.deepcopy(chatml)
    tokenizer.chat_template = template
    with pytest.raises(ValueError, match=says):
        observation_text(tokenizer, ["408"], stop)


def test_a_tool_environment_answers_in_the_templates_tool_turn(chatml):
    import functools

    from asyncopd_jax.environments import Calculator, ToolEnvironment

    env = ToolEnvironment([Calculator()], render=functools.partial(observation_text, chatml, stop_text="<|im_end|>"))
    observation = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>')
    assert observation.text == (
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
