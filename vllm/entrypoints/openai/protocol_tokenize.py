"""The /tokenize and /detokenize request and response models (vLLM's shapes)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from vllm.entrypoints.openai.protocol import (
    ChatMessageParam,
    OpenAIBaseModel,
    RequestModel,
    TokenId,
)


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(RequestModel):
    model: str | None = None
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


def tokenize_request_type(body: Any) -> type[TokenizeCompletionRequest | TokenizeChatRequest]:
    """/tokenize takes either shape, told apart by its "messages" key as vLLM does."""
    if isinstance(body, dict) and "messages" in body:
        return TokenizeChatRequest
    return TokenizeCompletionRequest
