"""POST /v1/completions: one engine request per prompt, choices indexed prompt_i * n + j (as
vLLM numbers them), a whole response or an SSE stream of deltas.

``echo`` puts the prompt in front of each choice's text; with ``logprobs`` k its tokens get
logprobs too (None for the first, which nothing predicts; then the token's and the k best),
which is how lm-eval's ``local-completions`` scores loglikelihood tasks
(``{prompt, max_tokens: 1, logprobs: 1, echo: true}``). ``max_tokens: 0`` is allowed with
echo only, as in vLLM: the prompt comes back scored with no completion (the engine
generates one token, which is dropped; finish reason "length", no completion tokens).

vLLM's ``return_token_ids`` adds each choice's ``prompt_token_ids`` and generated
``token_ids`` (never the echoed prompt); a stream sends each chunk's new ids, the prompt's in
a choice's first chunk, and then sends a chunk for new ids whose text is still held back.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request

from vllm.entrypoints.openai.errors import APIError, bad_request
from vllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    now,
    random_id,
)
from vllm.entrypoints.openai.serving_engine import OpenAIServing, cached_tokens, clamp, ranked
from vllm.entrypoints.openai.sse import DONE, SSEResponse, sse_data, sse_error, unless_disconnected
from vllm.logger import init_logger
from vllm.outputs import RequestOutput

logger = init_logger(__name__)


class _Prompt:
    """One prompt of the request: its token ids, and its text for echo (decoded from the
    ids when the client sent ids)."""

    def __init__(self, serving: OpenAIServing, text: str | None, token_ids: list[int]):
        self._serving, self._text, self.token_ids = serving, text, token_ids

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._serving.tokenizer.decode(self.token_ids)
        return self._text


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request):
        model = self.models.check_model(request.model)
        if request.max_tokens == 0 and not request.echo:
            raise bad_request(
                "max_tokens must be at least 1; 0 is allowed with echo only (the prompt back, "
                "with its logprobs, and no completion)",
                param="max_tokens",
            )
        prompts = await self._prompts(request)
        # With echo, the prompt's own logprobs come first (what lm-eval's loglikelihood reads).
        prompt_logprobs = request.logprobs if request.echo else None
        max_tokens = 1 if request.max_tokens == 0 else request.max_tokens
        params = [
            self.sampling_params(
                request,
                self.check_length(len(p.token_ids), max_tokens, "prompt"),
                request.logprobs,
                prompt_logprobs,
            )
            for p in prompts
        ]
        request_id = random_id("cmpl")
        requests = await self.add_requests(request_id, [p.token_ids for p in prompts], params)
        if request.stream:
            return SSEResponse(self._stream(request, request_id, model, prompts, requests))
        finals = await unless_disconnected(raw_request, self._collect(requests))
        return self._response(request, request_id, model, prompts, finals)

    async def _prompts(self, request: CompletionRequest) -> list[_Prompt]:
        prompt = request.prompt
        single = isinstance(prompt, str) or isinstance(prompt[0], int)
        out = []
        for item in [prompt] if single else prompt:
            if isinstance(item, str):
                ids = await self.encode_prompt(item, request.add_special_tokens, "prompt")
                out.append(_Prompt(self, item, ids))
            else:
                # Ids outside the vocabulary are the engine's to refuse (add_requests: 400).
                ids = list(item)
                text = None
                if request.echo and self._admissible(ids):
                    # Echo shows the prompt's text: decoded here, off the loop, for a prompt
                    # that the checks ahead will let through.
                    text = await self.async_tokenizer.decode(ids)
                out.append(_Prompt(self, text, ids))
        return out

    def _admissible(self, ids: list[int]) -> bool:
        vocab = self.tokenizer.vocab_size
        return 0 < len(ids) < self.max_model_len and all(0 <= t < vocab for t in ids)

    async def _collect(self, requests) -> list[RequestOutput]:
        """Each prompt's final output, its n samples merged (by index) if they come apart."""
        finals: dict[int, RequestOutput] = {}
        async with aclosing(self.iterate(requests)) as outputs:
            async for i, out in outputs:
                if i in finals:
                    merged = {o.index: o for o in finals[i].outputs}
                    merged.update({o.index: o for o in out.outputs})
                    out.outputs = list(merged.values())
                    out.prompt_logprobs = out.prompt_logprobs or finals[i].prompt_logprobs
                finals[i] = out
        return [finals[i] for i in range(len(requests))]

    def _logprobs(self, token_ids, positions, offset: int) -> CompletionLogProbs:
        """OpenAI's completions format: each token's text, its logprob, the alternatives
        (the sampled token among them) and where its text starts in the choice's text."""
        lp = CompletionLogProbs()
        positions = positions if positions is not None else [None] * len(token_ids)
        for token_id, position in zip(token_ids, positions, strict=True):
            if position is None:  # the first prompt token has nothing before it
                token = self.token_text(token_id, None)
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
            else:
                sampled = position.get(token_id)
                token = self.token_text(token_id, sampled)
                lp.token_logprobs.append(clamp(sampled.logprob) if sampled else None)
                lp.top_logprobs.append(
                    {self.token_text(t, alt): clamp(alt.logprob) for t, alt in ranked(position)}
                )
            lp.tokens.append(token)
            lp.text_offset.append(offset)
            offset += len(token)
        return lp

    def _response(self, request, request_id, model, prompts, finals) -> CompletionResponse:
        choices, generated = [], 0
        for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            for out in sorted(final.outputs, key=lambda o: o.index):
                text, token_ids, positions, finish, stop = _shown(request, out)
                generated += len(token_ids)
                ids = {}
                if request.return_token_ids:  # the generated ids only, echo or not
                    ids = dict(prompt_token_ids=prompt.token_ids, token_ids=token_ids)
                if request.echo:
                    positions = _echo_positions(prompt, final, positions, len(token_ids))
                    text = prompt.text + text
                    token_ids = prompt.token_ids + token_ids
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._logprobs(token_ids, positions, 0)
                choices.append(
                    CompletionResponseChoice(
                        index=i * request.n + out.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=finish,
                        stop_reason=stop,
                        **ids,
                    )
                )
        num_prompt = sum(len(p.token_ids) for p in prompts)
        num_cached = sum(cached_tokens(final) for final in finals)
        usage = self.usage(num_prompt, generated, num_cached)
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _stream(self, request, request_id, model, prompts, requests) -> AsyncIterator[str]:
        created = now()
        generated: dict[int, int] = defaultdict(int)
        offsets: dict[int, int] = defaultdict(int)
        echoed: set[int] = set()
        started: set[int] = set()  # choices that have sent a chunk
        cached: dict[int, int] = defaultdict(int)  # per prompt
        try:
            async with aclosing(self.iterate(requests)) as outputs:
                async for i, res in outputs:
                    cached[i] = max(cached[i], cached_tokens(res))
                    for out in res.outputs:
                        index = i * request.n + out.index
                        text, token_ids, positions, finish, stop = _shown(request, out)
                        generated[index] += len(token_ids)
                        new_ids = token_ids
                        if request.echo and index not in echoed:
                            echoed.add(index)
                            prompt = prompts[i]
                            positions = _echo_positions(prompt, res, positions, len(token_ids))
                            text = prompt.text + text
                            token_ids = prompt.token_ids + token_ids
                        if (
                            not text
                            and finish is None
                            and not (request.logprobs is not None and token_ids)
                            and not (request.return_token_ids and new_ids)
                        ):
                            continue  # nothing to show yet (an unfinished character)
                        logprobs = None
                        if request.logprobs is not None:
                            logprobs = self._logprobs(token_ids, positions, offsets[index])
                        offsets[index] += len(text)
                        ids = {}
                        if request.return_token_ids:
                            prompt_ids = None if index in started else prompts[i].token_ids
                            ids = dict(prompt_token_ids=prompt_ids, token_ids=new_ids)
                        started.add(index)
                        choice = CompletionResponseStreamChoice(
                            index=index,
                            text=text,
                            logprobs=logprobs,
                            finish_reason=finish,
                            stop_reason=stop,
                            **ids,
                        )
                        chunk = CompletionStreamResponse(
                            id=request_id, created=created, model=model, choices=[choice]
                        )
                        yield sse_data(chunk)
            if request.include_usage:
                num_prompt = sum(len(p.token_ids) for p in prompts)
                num_generated = sum(generated.values())
                usage = self.usage(num_prompt, num_generated, sum(cached.values()))
                yield sse_data(
                    CompletionStreamResponse(
                        id=request_id, created=created, model=model, choices=[], usage=usage
                    )
                )
        except APIError as err:
            yield sse_error(err)
        except Exception:  # a defect of ours: the client still gets an SSE error
            logger.exception("stream %s failed", request_id)
            yield sse_error(APIError("Internal server error", 500))
        yield DONE


def _shown(request: CompletionRequest, out):
    """What a choice shows of a sample's output: (text, token ids, logprob positions,
    finish reason, stop reason); nothing of it for max_tokens 0 (echo only), which the
    engine ran as 1."""
    if request.max_tokens == 0:
        finish = None if out.finish_reason is None else "length"
        return "", [], None, finish, None
    return out.text, list(out.token_ids), out.logprobs, out.finish_reason, out.stop_reason


def _echo_positions(prompt: _Prompt, res: RequestOutput, positions, num_generated: int):
    """The prompt's logprob positions (None for the first token), then the output's."""
    before = res.prompt_logprobs
    if before is None or len(before) != len(prompt.token_ids):
        before = [None] * len(prompt.token_ids)
    after = positions if positions is not None else [None] * num_generated
    return list(before) + list(after)
