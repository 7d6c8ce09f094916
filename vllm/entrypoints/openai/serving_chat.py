"""POST /v1/chat/completions: the messages rendered by the tokenizer's chat template, one
engine request, a whole response or an SSE stream (role first, then content deltas, the
finish reason in each choice's last content chunk).

vLLM's ``return_token_ids`` adds the response's ``prompt_token_ids`` (in a stream: on each
choice's role chunk) and each choice's generated ``token_ids`` (a stream chunk's: the ids it
adds, sent even while their text is held back)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request

from vllm.entrypoints.openai.errors import APIError
from vllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    now,
    random_id,
)
from vllm.entrypoints.openai.serving_engine import (
    MIN_LOGPROB,
    OpenAIServing,
    cached_tokens,
    clamp,
    ranked,
)
from vllm.entrypoints.openai.sse import DONE, SSEResponse, sse_data, sse_error, unless_disconnected
from vllm.logger import init_logger

logger = init_logger(__name__)

ROLE = "assistant"


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request):
        model = self.models.check_model(request.model)
        prompt = await self.render_chat_off_loop(request.messages, request.add_generation_prompt)
        # The template already wrote the special tokens it wants (BOS, role markers).
        token_ids = await self.encode_prompt(prompt, request.add_special_tokens, "messages")
        max_tokens = self.check_length(len(token_ids), request.max_new_tokens(), "messages")
        top = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, top)
        request_id = random_id("chatcmpl")
        requests = await self.add_requests(request_id, [token_ids], [params])
        if request.stream:
            return SSEResponse(self._stream(request, request_id, model, token_ids, requests))
        [(final, num_cached)] = await unless_disconnected(raw_request, self._collect(requests))
        choices, generated = [], 0
        for out in sorted(final, key=lambda o: o.index):
            generated += len(out.token_ids)
            logprobs = None
            if request.logprobs:
                logprobs = self._logprobs(out.token_ids, out.logprobs, top)
            choices.append(
                ChatCompletionResponseChoice(
                    index=out.index,
                    message=ChatMessage(role=ROLE, content=out.text),
                    logprobs=logprobs,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                    token_ids=list(out.token_ids) if request.return_token_ids else None,
                )
            )
        usage = self.usage(len(token_ids), generated, num_cached)
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=usage,
            prompt_token_ids=token_ids if request.return_token_ids else None,
        )

    async def _collect(self, requests) -> list[tuple[list, int]]:
        """Each request's final outputs (its n samples merged by index) and its cached
        prompt tokens."""
        finals: list[dict] = [{} for _ in requests]
        cached = [0] * len(requests)
        async with aclosing(self.iterate(requests)) as outputs:
            async for i, res in outputs:
                finals[i].update({o.index: o for o in res.outputs})
                cached[i] = max(cached[i], cached_tokens(res))
        return [(list(f.values()), c) for f, c in zip(finals, cached, strict=True)]

    def _logprobs(self, token_ids, positions, top: int) -> ChatCompletionLogProbs:
        """OpenAI's chat format: per token its text, bytes, logprob and the ``top`` most
        likely alternatives."""
        content = []
        positions = positions if positions is not None else [None] * len(token_ids)
        for token_id, position in zip(token_ids, positions, strict=True):
            sampled = position.get(token_id) if position else None
            token = self.token_text(token_id, sampled)
            alternatives = [
                ChatCompletionLogProb(
                    token=(alt_token := self.token_text(t, alt)),
                    logprob=clamp(alt.logprob),
                    bytes=_utf8(alt_token),
                )
                for t, alt in (ranked(position)[:top] if position else [])
            ]
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=clamp(sampled.logprob) if sampled else MIN_LOGPROB,
                    bytes=_utf8(token),
                    top_logprobs=alternatives,
                )
            )
        return ChatCompletionLogProbs(content=content)

    def _chunk(self, request_id, created, model, choice, usage_field: bool, **ids) -> str:
        chunk = ChatCompletionStreamResponse(
            id=request_id, created=created, model=model, choices=[choice], **ids
        )
        data = chunk.model_dump()
        # As OpenAI sends deltas: the role chunk has no content key, content chunks no role;
        # "usage": null in every chunk only when the client asked for usage at the end.
        for c in data["choices"]:
            c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
        if not usage_field:
            del data["usage"]
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def _stream(self, request, request_id, model, prompt_ids, requests) -> AsyncIterator[str]:
        created = now()
        usage_field = request.include_usage
        # return_token_ids: every chunk has the keys; the role chunks carry the prompt's ids.
        return_ids = request.return_token_ids
        role_ids = dict(prompt_token_ids=prompt_ids) if return_ids else {}
        later_ids = dict(prompt_token_ids=None) if return_ids else {}
        top = (request.top_logprobs or 0) if request.logprobs else None
        generated: dict[int, int] = defaultdict(int)
        num_cached = 0
        try:
            for index in range(request.n):
                role = ChatCompletionResponseStreamChoice(
                    index=index,
                    delta=DeltaMessage(role=ROLE, content=""),
                    logprobs=None,
                    finish_reason=None,
                    **(dict(token_ids=None) if return_ids else {}),
                )
                yield self._chunk(request_id, created, model, role, usage_field, **role_ids)
            async with aclosing(self.iterate(requests)) as outputs:
                async for _, res in outputs:
                    num_cached = max(num_cached, cached_tokens(res))
                    for out in res.outputs:
                        generated[out.index] += len(out.token_ids)
                        if (
                            not out.text
                            and out.finish_reason is None
                            and not (request.logprobs and out.token_ids)
                            and not (return_ids and out.token_ids)
                        ):
                            continue  # nothing to show yet (an unfinished character)
                        choice = ChatCompletionResponseStreamChoice(
                            index=out.index,
                            delta=DeltaMessage(content=out.text),
                            finish_reason=out.finish_reason,
                            stop_reason=out.stop_reason,
                            **(dict(token_ids=list(out.token_ids)) if return_ids else {}),
                        )
                        if request.logprobs:
                            choice.logprobs = self._logprobs(out.token_ids, out.logprobs, top)
                        yield self._chunk(
                            request_id, created, model, choice, usage_field, **later_ids
                        )
            if request.include_usage:
                num_generated = sum(generated.values())
                usage = self.usage(len(prompt_ids), num_generated, num_cached)
                chunk = ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[], usage=usage
                )
                yield sse_data(chunk)
        except APIError as err:
            yield sse_error(err)
        except Exception:  # a defect of ours: the client still gets an SSE error
            logger.exception("stream %s failed", request_id)
            yield sse_error(APIError("Internal server error", 500))
        yield DONE
