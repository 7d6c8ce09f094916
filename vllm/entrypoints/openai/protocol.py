"""The OpenAI API's request and response bodies (pydantic v2), with OpenAI's and vLLM's field
names, so that the official clients and vLLM's users send what they already send.

Requests validate strictly (a string where a number belongs is a 400, not a silent cast) and
ignore fields they do not know, as OpenAI-compatible servers do for newer client fields.
Fields that would change the output but are not implemented (penalties, logit_bias, suffix,
best_of > n, vLLM's extras: ``unsupported.py``) are refused by name, not ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from vllm.entrypoints.openai.unsupported import ChatExtras, SamplingExtras

# vLLM's default --max-logprobs: more top alternatives per token than this is refused.
MAX_LOGPROBS = 20
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1

TokenId = Annotated[int, Field(ge=0)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestModel(OpenAIBaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(RequestModel):
    include_usage: bool = False


class _SamplingFields(RequestModel, SamplingExtras):
    """What completions and chat share (vLLM's extra fields included)."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=128)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    # OpenAI's: token ids as strings; biases clamped to [-100, 100], as vLLM does.
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's: the prompt's and each choice's token ids in the response (serving_*.py).
    return_token_ids: bool | None = False

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[int, float] | None:
        if not value:
            return None
        out = {}
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids (digits), got {key!r}")
            out[int(key)] = min(100.0, max(-100.0, bias))
        return out

    @model_validator(mode="after")
    def _check_common(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given when stream is true")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# Completions --------------------------------------------------------------------------

_PROMPT_SHAPES = "a string, a list of token ids, or a list of strings or of token-id lists"


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _check_prompt(prompt: Any) -> str | list[int] | list[str] | list[list[int]]:
    """One clear message for a malformed prompt (a pydantic union lists every member)."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        one = [prompt]
    elif isinstance(prompt, list) and (
        all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt)
    ):
        one = prompt
    else:
        raise ValueError(f"prompt must be {_PROMPT_SHAPES}")
    if not one or any(len(p) == 0 for p in one):
        raise ValueError("prompt must not be empty")
    if any(t < 0 for p in one if not isinstance(p, str) for t in p):
        raise ValueError("token ids must be non-negative integers")
    return prompt


class CompletionRequest(_SamplingFields):
    # Any, checked by _prompt_shape: str | list[int] | list[str] | list[list[int]].
    prompt: Any
    # 0: echo without generation (serving_completion refuses it without echo).
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, value: Any):
        return _check_prompt(value)

    @model_validator(mode="after")
    def _check_completion(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported by this server")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        return self


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache restored (not recomputed)


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    # Only with the server's --enable-prompt-tokens-details; left out of the JSON otherwise.
    prompt_tokens_details: PromptTokenUsageInfo | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_details(self, handler: SerializerFunctionWrapHandler) -> dict:
        data = handler(self)
        if data.get("prompt_tokens_details", 0) is None:
            del data["prompt_tokens_details"]
        return data


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token id that ended the choice (None for EOS/length).
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids only
    token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class _OmitsUnsetTokenIds(OpenAIBaseModel):
    """Token-id fields in a chunk's JSON only when set (return_token_ids), else no key."""

    @model_serializer(mode="wrap")
    def _omit_unset_token_ids(self, handler: SerializerFunctionWrapHandler) -> dict:
        data = handler(self)
        for name in ("prompt_token_ids", "token_ids"):
            if name in data and name not in self.model_fields_set:
                del data[name]
        return data


class CompletionResponseStreamChoice(_OmitsUnsetTokenIds):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # the first chunk of the choice only
    token_ids: list[int] | None = None  # the ids this chunk adds


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# Chat completions ---------------------------------------------------------------------


class ChatContentPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessageParam(RequestModel):
    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as the chat template gets it: text parts joined by newlines, as vLLM
        joins them."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields, ChatExtras):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def max_new_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's newer name) wins over max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids only


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # one prompt for all choices, as in vLLM


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(_OmitsUnsetTokenIds):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(_OmitsUnsetTokenIds):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # each choice's role chunk


# Errors, models, tokenizer endpoints --------------------------------------------------


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
