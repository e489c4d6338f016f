"""What a tool turn adds to a trajectory, in the student's own chat format.

The student's turn ends on its stop token (the template's end of an assistant turn: Qwen3's
``<|im_end|>``). The trajectory then goes on with what the template writes from there to
the next assistant turn's first token: the rest of the assistant turn's closing (Qwen3: a
newline), the tool turn holding the outputs (Qwen3: a ``user`` turn of ``<tool_response>``
blocks), and the generation prompt. Those are the observation's tokens: context for the
student and the teacher, outside every loss.

They are read off the tokenizer's own template, by difference: a conversation whose
assistant turn is a marker, rendered with the tool messages and the generation prompt; the
observation is what follows the marker and the stop token's text. A template that does not
close an assistant turn with the student's stop token, or that has no tool role, is refused
in one line naming the tokenizer.
"""

from __future__ import annotations

from typing import Any

#: The assistant turn's content while the template is read (no template alters it).
_MARK = "ASYNCOPD_TURN_MARK"


def observation_text(tokenizer: Any, outputs: list[str], stop_text: str) -> str:
    """The text after the student's stop token ``stop_text`` up to the next assistant turn,
    with the tool ``outputs`` in it (module docstring)."""
    name = getattr(tokenizer, "name_or_path", "") or "(unnamed)"
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {name} has no chat template: tool turns need one")
    messages = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": _MARK},
        *({"role": "tool", "content": output} for output in outputs),
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 - jinja's errors, a template without a tool role
        raise ValueError(f"tokenizer {name}: its chat template cannot render a tool turn ({err})") from None
    at = text.find(_MARK)
    if at < 0 or text.count(_MARK) != 1:
        raise ValueError(f"tokenizer {name}: its chat template does not write an assistant turn as given")
    after = text[at + len(_MARK) :]
    if not after.startswith(stop_text):
        raise ValueError(
            f"tokenizer {name}: its chat template closes an assistant turn with {after[:20]!r}, not the student's "
            f"stop token {stop_text!r}"
        )
    if any(output not in after for output in outputs):
        raise ValueError(f"tokenizer {name}: its chat template leaves a tool's output out of the tool turn")
    return after[len(stop_text) :]


def observation_ids(tokenizer: Any, outputs: list[str], stop_id: int) -> list[int]:
    """:func:`observation_text`'s token ids (after the student's stop token ``stop_id``)."""
    stop_text = tokenizer.convert_ids_to_tokens(stop_id)
    return list(tokenizer.encode(observation_text(tokenizer, outputs, stop_text), add_special_tokens=False))
