"""What generation returns: one RequestOutput per request (per prompt of ``LLM.generate``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """A token's log-probability under the model (raw logits, before temperature and
    filtering, as vLLM reports them), its rank among the vocabulary (1 = most likely) and
    its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Position by position: {token id: Logprob} holding the sampled (or prompt) token and the
# top-k alternatives.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]  # None for the first prompt token


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, a stop string or token), "length", "abort"
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    # The stop string or stop token id that ended it (None for EOS, length or running).
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    # Set when the request failed while running (finish reason "error"); others go on.
    error: str | None = None
    # Prompt tokens restored from the prefix cache (None until the first token is out).
    num_cached_tokens: int | None = None
