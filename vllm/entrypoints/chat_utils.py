"""Chat-template resolution, where vLLM keeps it (``vllm.entrypoints.chat_utils``).

lm-eval's vllm backend calls ``resolve_hf_chat_template`` once at start-up (for vLLM
versions >= 0.8.3) and hands the result to ``tokenizer.apply_chat_template`` when it is run
with ``--apply_chat_template``.
"""

from __future__ import annotations

from typing import Any


def resolve_hf_chat_template(
    tokenizer,
    chat_template: str | None,
    tools: list[dict[str, Any]] | None,
    *,
    model_config=None,
    trust_remote_code: bool | None = None,
) -> str | None:
    """The template to render chats with: ``chat_template`` when one is given, else the
    tokenizer's own (for a tokenizer with several named templates, the one transformers
    picks for ``tools``), else None. ``model_config`` and ``trust_remote_code`` are vLLM's
    keywords for its processor-template and fallback-template look-ups: this package has
    neither (text-only models, no bundled fallback templates), so they change nothing."""
    if chat_template is not None:
        return chat_template
    get = getattr(tokenizer, "get_chat_template", None)
    if get is not None:
        try:
            return get(None, tools=tools)
        except ValueError:  # transformers: the tokenizer has no chat template
            return None
    return getattr(tokenizer, "chat_template", None)
