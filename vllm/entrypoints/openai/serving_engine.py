"""What the completion and chat handlers share: prompt checks against max_model_len, the
SamplingParams of a request, atomic admission of a request's prompts into the engine, and
one stream of every prompt's outputs that aborts whatever is unfinished when it is closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from http import HTTPStatus

from vllm.entrypoints.openai.async_tokenizer import AsyncTokenizer, TokenizerProcessError
from vllm.entrypoints.openai.errors import APIError, bad_request
from vllm.entrypoints.openai.protocol import ChatMessageParam, PromptTokenUsageInfo, UsageInfo
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.logger import init_logger
from vllm.outputs import Logprob, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)

# JSON has no -inf; OpenAI-compatible servers report an impossible token's logprob so.
MIN_LOGPROB = -9999.0


class OpenAIServing:
    def __init__(
        self,
        engine,
        models: OpenAIServingModels,
        async_tokenizer: AsyncTokenizer,
        enable_prompt_tokens_details: bool = False,
    ):
        self.engine = engine
        # --enable-prompt-tokens-details: usage gets prompt_tokens_details.cached_tokens.
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.models = models
        self.tokenizer = engine.tokenizer
        self.async_tokenizer = async_tokenizer
        self.max_model_len = engine.config.max_model_len

    # ----------------------------------------------------------------------------------
    # Checks
    # ----------------------------------------------------------------------------------

    def check_length(
        self, num_prompt_tokens: int, max_tokens: int | None, field: str = "messages"
    ) -> int:
        """The request's max_tokens, or what max_model_len leaves when it gave none; a prompt
        that does not fit is a 400 in vLLM's words (clients and lm-eval match on them),
        naming the request's ``field`` that holds the prompt ("messages" or "prompt")."""
        limit = self.max_model_len
        what = "input messages" if field == "messages" else field
        if num_prompt_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {num_prompt_tokens} input tokens. Please reduce the length of "
                f"the {what}.",
                param=field,
            )
        if max_tokens is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                f"the {field}, {max_tokens} in the completion). Please reduce the length of "
                f"the {field} or completion.",
                param="max_tokens",
            )
        return max_tokens

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(
                f"{param}: token id {bad[0]} is out of the vocabulary (0..{vocab - 1})", param=param
            )

    async def encode_prompt(self, text: str, add_special_tokens: bool, field: str) -> list[int]:
        """The prompt's token ids, tokenized off the event loop; a prompt too long for
        max_model_len is refused by its count (its ids never reach this process)."""
        try:
            encoded = await self.async_tokenizer.encode(
                text, add_special_tokens, max_ids=self.max_model_len - 1
            )
        except TokenizerProcessError as err:
            raise APIError(str(err), HTTPStatus.INTERNAL_SERVER_ERROR) from None
        if encoded.ids is None:
            self.check_length(encoded.count, None, field)  # raises: it does not fit
        return encoded.ids

    async def render_chat_off_loop(
        self, messages: list[ChatMessageParam], add_generation_prompt: bool
    ) -> str:
        return await self.async_tokenizer.run(self.render_chat, messages, add_generation_prompt)

    def render_chat(self, messages: list[ChatMessageParam], add_generation_prompt: bool) -> str:
        """The messages as the tokenizer's chat template renders them."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise bad_request(
                "this model's tokenizer has no chat template, so chat messages cannot be "
                "turned into a prompt; use /v1/completions with a prompt instead",
                param="messages",
            )
        conversation = [{"role": m.role, "content": m.text()} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt
            )
        except Exception as err:
            # The template is the model's data, not our code: what it rejects (roles out of
            # order, say, through its raise_exception) is the request's fault.
            raise bad_request(
                f"the chat template cannot render these messages: {err}", param="messages"
            ) from None

    def sampling_params(
        self,
        request,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        try:
            return SamplingParams(
                n=request.n,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=-1 if request.top_k is None else request.top_k,
                min_p=0.0 if request.min_p is None else request.min_p,
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=request.repetition_penalty or 1.0,
                min_tokens=request.min_tokens,
                logit_bias=request.logit_bias,
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos,
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                max_tokens=max_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                # Streams send each token as soon as it exists; a whole answer needs only
                # the end (no per-step copies of the text so far).
                output_kind=RequestOutputKind.DELTA
                if request.stream
                else RequestOutputKind.FINAL_ONLY,
            )
        except ValueError as err:
            raise bad_request(str(err)) from None

    # ----------------------------------------------------------------------------------
    # The engine side
    # ----------------------------------------------------------------------------------

    async def add_requests(
        self, request_id: str, prompts: list[list[int]], params: list[SamplingParams]
    ) -> list[tuple[str, object]]:
        """Queue one engine request per prompt, all or none: a prompt the engine refuses
        (ValueError, naming the field) aborts those already queued, and is a 400."""
        added: list[tuple[str, object]] = []
        for i, (token_ids, p) in enumerate(zip(prompts, params, strict=True)):
            engine_id = f"{request_id}-{i}"
            try:
                added.append((engine_id, self.engine.add_request(engine_id, token_ids, p)))
            except Exception as err:
                for queued_id, _ in added:
                    await self._abort(queued_id)
                if isinstance(err, ValueError):
                    raise bad_request(str(err)) from None
                # Not the request's fault: the engine cannot take it (its loop died).
                logger.exception("the engine refused request %s", engine_id)
                raise APIError(f"the engine cannot take requests: {err}", 500) from None
        return added

    async def _abort(self, engine_id: str) -> None:
        try:
            # Shielded: a cancelled handler (client gone) must still free the slot.
            await asyncio.shield(self.engine.abort(engine_id))
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("aborting request %s failed", engine_id)

    async def _pump(self, i: int, engine_id: str, stream, queue: asyncio.Queue) -> None:
        finished = False
        try:
            async for out in stream:
                finished = out.finished
                queue.put_nowait((i, out, None))
                if finished:
                    break
        except Exception as err:
            finished = True  # the engine ended it (its slot is freed): nothing to abort
            queue.put_nowait((i, None, err))
        finally:
            if not finished:
                await self._abort(engine_id)
            queue.put_nowait((i, None, None))

    async def iterate(
        self, requests: list[tuple[str, object]]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every request as they come. Closing it early (the
        client left, an error) aborts every unfinished request; a request's failure is
        raised here as a 500 APIError, and the others are aborted."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [
            asyncio.ensure_future(self._pump(i, engine_id, stream, queue))
            for i, (engine_id, stream) in enumerate(requests)
        ]
        remaining = len(tasks)
        try:
            while remaining:
                i, out, err = await queue.get()
                if err is not None:
                    # The engine failed this request (or died): the client hears why, the
                    # server log keeps the traceback.
                    logger.error("request %s failed", requests[i][0], exc_info=err)
                    raise APIError(f"the request failed: {err}", 500) from err
                if out is None:
                    remaining -= 1
                    continue
                yield i, out
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ----------------------------------------------------------------------------------
    # Logprobs
    # ----------------------------------------------------------------------------------

    def usage(self, num_prompt: int, num_generated: int, num_cached: int) -> UsageInfo:
        """The usage of a response; ``num_cached``, the prompt tokens the prefix cache
        restored, shows only with --enable-prompt-tokens-details (as in vLLM)."""
        usage = UsageInfo(
            prompt_tokens=num_prompt,
            completion_tokens=num_generated,
            total_tokens=num_prompt + num_generated,
        )
        if self.enable_prompt_tokens_details:
            usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=num_cached)
        return usage

    def token_text(self, token_id: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id])


def ranked(position: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    """A position's (token id, Logprob) pairs, most likely first."""
    return sorted(
        position.items(),
        key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 62, -kv[1].logprob),
    )


def cached_tokens(out: RequestOutput) -> int:
    """The prompt tokens of ``out``'s request that the prefix cache restored."""
    return out.num_cached_tokens or 0


def clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)
