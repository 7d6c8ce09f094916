"""vLLM's prompt dicts: ``TextPrompt(prompt="...")`` and ``TokensPrompt(prompt_token_ids=[...])``.

They are plain ``TypedDict``s, as in vLLM, so a client that builds them (lm-eval does) and
one that writes the dict literal send the same thing. ``LLM.generate`` also takes a bare
string or a list of token ids. The engine checks every prompt before it queues any
(``vllm/engine/processor.py``); keys other than these two are refused by name, since this
package has no multi-modal inputs, token type ids or cache salts.
"""

from __future__ import annotations

from typing import TypedDict

# The keys a prompt dict may hold here (processor.py refuses the others by name).
PROMPT_KEYS = ("prompt", "prompt_token_ids")


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt
