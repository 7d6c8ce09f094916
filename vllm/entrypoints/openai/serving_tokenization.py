"""POST /tokenize and /detokenize (vLLM's extra endpoints): the served tokenizer, with the
same chat rendering and special-token defaults as the generation endpoints; GET
/tokenizer_info (with ``--enable-tokenizer-info-endpoint``, as in vLLM): its class, special
tokens and chat template."""

from __future__ import annotations

from vllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from vllm.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        self.models.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            text = self.render_chat(request.messages, request.add_generation_prompt)
        else:
            text = request.prompt
        tokens = self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        return TokenizeResponse(
            count=len(tokens), max_model_len=self.max_model_len, tokens=list(tokens)
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.models.check_model(request.model)
        self.check_token_ids(request.tokens, param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))

    def tokenizer_info(self) -> dict:
        return self.tokenizer.info()
