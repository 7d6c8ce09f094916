"""POST /tokenize and /detokenize (vLLM's extra endpoints): the served tokenizer, with the
same chat rendering and special-token defaults as the generation endpoints; GET
/tokenizer_info (with ``--enable-tokenizer-info-endpoint``, as in vLLM): its class, special
tokens and chat template."""

from __future__ import annotations

from http import HTTPStatus

from vllm.entrypoints.openai.async_tokenizer import TokenizerProcessError
from vllm.entrypoints.openai.errors import APIError
from vllm.entrypoints.openai.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from vllm.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        self.models.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            text = await self.render_chat_off_loop(request.messages, request.add_generation_prompt)
        else:
            text = request.prompt
        try:
            encoded = await self.async_tokenizer.encode(text, request.add_special_tokens)
        except TokenizerProcessError as err:
            raise APIError(str(err), HTTPStatus.INTERNAL_SERVER_ERROR) from None
        return TokenizeResponse(
            count=encoded.count, max_model_len=self.max_model_len, tokens=list(encoded.ids)
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.models.check_model(request.model)
        self.check_token_ids(request.tokens, param="tokens")
        return DetokenizeResponse(prompt=await self.async_tokenizer.decode(request.tokens))

    def tokenizer_info(self) -> dict:
        return self.tokenizer.info()
