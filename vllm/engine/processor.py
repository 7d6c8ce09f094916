"""InputProcessor: a prompt and its SamplingParams checked and tokenized, or a ValueError
that names what is wrong. Nothing reaches the engine before it passed here, so a call that
is refused leaves nothing behind."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.config import EngineConfig
from vllm.inputs.data import PROMPT_KEYS
from vllm.sampling_params import SamplingParams

# vLLM's default cap on logprobs / prompt_logprobs per position.
MAX_LOGPROBS = 20


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def process(self, prompt, params) -> ProcessedPrompt:
        """``prompt``: text, a list of token ids, or vLLM's ``TextPrompt`` /
        ``TokensPrompt`` (``{"prompt": text}`` / ``{"prompt_token_ids": ids}``)."""
        self.check_params(params)
        text, ids = self._tokenize(prompt)
        self.check_ids(ids)
        return ProcessedPrompt(text, ids)

    def check_params(self, params) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > MAX_LOGPROBS:
                raise ValueError(f"{name} must be at most {MAX_LOGPROBS}, got {k}")
        outside = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if outside:
            raise ValueError(
                f"logit_bias token id {outside[0]} is outside the vocabulary [0, {self.vocab_size})"
            )

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            unknown = [k for k in prompt if k not in PROMPT_KEYS]
            if unknown:
                raise ValueError(
                    f"a prompt dict may hold {' or '.join(PROMPT_KEYS)}; {unknown[0]!r} is not "
                    "supported by this package"
                )
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
                if not isinstance(prompt, list | tuple):
                    raise ValueError(
                        f"prompt_token_ids must be a list of integers, got {type(prompt).__name__}"
                    )
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            else:
                raise ValueError("a prompt dict needs a 'prompt' or a 'prompt_token_ids' key")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, list | tuple):
            for pos, t in enumerate(prompt):
                if isinstance(t, bool) or not isinstance(t, int):
                    raise ValueError(
                        f"prompt token ids must be integers: position {pos} holds {t!r}"
                    )
            return None, list(prompt)
        raise ValueError(
            f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        )

    def check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt has no tokens")
        for pos, t in enumerate(ids):
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt token id {t} at position {pos} is outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, which leaves no room for output within "
                f"the maximum model length of {limit} tokens"
            )
