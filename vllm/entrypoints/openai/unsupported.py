"""Request fields OpenAI's API and vLLM's server take and this one does not implement.

With ``extra="ignore"`` such a field would be dropped without a word, and the request
served as if it had not been sent: a ``length_penalty``, ``bad_words``, a JSON
``response_format`` or a ``cache_salt`` silently without effect. Each is declared here
instead, as ``Any``, and refused (400, naming it) when it asks for something: a value other
than the one that means "off". Sent at that value (clients that fill in defaults), it is
accepted, since the request then means what this server does.

``SamplingExtras`` holds the fields completions and chat share (vLLM's extra sampling and
serving parameters), ``ChatExtras`` the chat-only ones. Both are mixins of the request
models in ``protocol.py``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, create_model, field_validator


def _off(value: Any, *offs: Any) -> bool:
    """``value`` asks for nothing: None, an empty string, list or dict, or one of ``offs``
    (a bool only as itself: ``1`` is not ``True``, nor ``False`` a ``0.0``)."""
    if value is None or (isinstance(value, str | list | dict) and not value):
        return True
    for off in offs:
        if isinstance(off, bool) or isinstance(value, bool):
            if value is off:
                return True
        elif value == off:
            return True
    return False


# name: (values that mean "off", what to say instead). Hints point at what this server has.
SAMPLING_FIELDS: dict[str, tuple[tuple, str]] = {
    "length_penalty": ((1.0,), "leave it at 1"),
    "use_beam_search": ((False,), "beam search is not implemented"),
    "include_stop_str_in_output": ((False,), "stop strings are left out of the output"),
    "truncate_prompt_tokens": ((), "send the prompt truncated"),
    "allowed_token_ids": ((), "use logit_bias"),
    "bad_words": ((), "use logit_bias"),
    "logits_processors": ((), "no custom logits processors"),
    "prompt_logprobs": ((), "completions give prompt logprobs with echo and logprobs"),
    "priority": ((0,), "requests are served first come, first served"),
    "return_tokens_as_token_ids": ((False,), "use return_token_ids"),
    "response_format": (({"type": "text"},), "no structured outputs"),
    "guided_json": ((), "no structured outputs"),
    "guided_regex": ((), "no structured outputs"),
    "guided_choice": ((), "no structured outputs"),
    "guided_grammar": ((), "no structured outputs"),
    "structured_outputs": ((), "no structured outputs"),
    "prompt_embeds": ((), "send text or token ids"),
    "cache_salt": ((), "the prefix cache is shared by all requests"),
    "kv_transfer_params": ((), "no disaggregated prefill"),
    "vllm_xargs": ((), "no custom extra arguments"),
}
CHAT_FIELDS: dict[str, tuple[tuple, str]] = {
    "tools": ((), "no tool calling"),
    "tool_choice": (("none", "auto"), "no tool calling"),
    "continue_final_message": ((False,), "end the prompt with add_generation_prompt false"),
    "chat_template": ((), "the model's own template is used"),
    "chat_template_kwargs": ((), "the model's own template is used, as it is"),
    "documents": ((), "put the documents in the messages"),
    "mm_processor_kwargs": ((), "text-only models"),
    "reasoning_effort": ((), "no reasoning parser"),
}


def _refuse(table: dict[str, tuple[tuple, str]], name: str, value: Any) -> Any:
    offs, hint = table[name]
    if not _off(value, *offs):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise ValueError(f"{name}={shown} is not supported by this server ({hint})")
    return value


def _extras(name: str, table: dict[str, tuple[tuple, str]]) -> type[BaseModel]:
    """A model with ``table``'s fields, each ``Any`` (None by default), each refused by
    ``_refuse`` when it asks for something. The validator is named after the model: a
    request model that mixes in two of them keeps both (one name would shadow the other)."""

    def check(cls, value: Any, info) -> Any:
        return _refuse(table, info.field_name, value)

    return create_model(
        name,
        __config__=ConfigDict(extra="ignore"),
        __validators__={f"_check_{name}": field_validator(*table, mode="after")(check)},
        **{field: (Any, None) for field in table},
    )


SamplingExtras = _extras("SamplingExtras", SAMPLING_FIELDS)
ChatExtras = _extras("ChatExtras", CHAT_FIELDS)
