"""The request models refuse every field of ``unsupported.py``'s tables when it asks for
something, naming it, and accept each at the values that mean "off" (no server: the
models alone; test_errors.py sends some of them to a real server)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm.entrypoints.openai.unsupported import CHAT_FIELDS, SAMPLING_FIELDS

COMPLETION = {"model": "m", "prompt": "hi"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
ASKING = {"tool_choice": "required", "response_format": {"type": "json_object"}}


def _asking(name: str, offs: tuple):
    """A value of ``name`` that asks for something: not off, not None."""
    if name in ASKING:
        return ASKING[name]
    if any(isinstance(o, bool) for o in offs):
        return True
    if offs:
        return offs[0] + 0.5
    return ["x"]


@pytest.mark.parametrize(
    "cls, base, name",
    [(CompletionRequest, COMPLETION, n) for n in SAMPLING_FIELDS]
    + [(ChatCompletionRequest, CHAT, n) for n in SAMPLING_FIELDS]
    + [(ChatCompletionRequest, CHAT, n) for n in CHAT_FIELDS],
)
def test_each_field_refused_when_it_asks_accepted_when_off(cls, base, name):
    offs = {**SAMPLING_FIELDS, **CHAT_FIELDS}[name][0]
    with pytest.raises(ValidationError) as err:
        cls(**base, **{name: _asking(name, offs)})
    (error,) = err.value.errors()
    assert error["loc"] == (name,) and f"{name}=" in error["msg"], error
    assert "is not supported by this server" in error["msg"]
    for off in (None, *offs):
        cls(**base, **{name: off})


def test_chat_fields_are_not_completion_fields():
    """vLLM's completions take no tools (nor a chat template): ignored there, as unknown."""
    CompletionRequest(**COMPLETION, tools=[{"type": "function"}], chat_template="{{x}}")


def test_off_values_are_told_apart_from_lookalikes():
    CompletionRequest(**COMPLETION, min_p=0, repetition_penalty=1, bad_words=[], cache_salt="")
    with pytest.raises(ValidationError, match="use_beam_search=0"):
        CompletionRequest(**COMPLETION, use_beam_search=0)  # False only as itself
    with pytest.raises(ValidationError, match=r"priority=True"):
        CompletionRequest(**COMPLETION, priority=True)  # a bool is no priority value
    long = ["word"] * 100
    with pytest.raises(ValidationError) as err:
        CompletionRequest(**COMPLETION, bad_words=long)
    assert "..." in err.value.errors()[0]["msg"] and len(err.value.errors()[0]["msg"]) < 200
