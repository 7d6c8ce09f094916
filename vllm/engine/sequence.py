"""Sequence: one request's tokens, its progress through the model, and its state slot."""

from __future__ import annotations

import enum

from vllm.sampling_params import SamplingParams

# A token the model sampled on the device that the host has not read yet (async
# scheduling: the next step is dispatched before the previous step's tokens come back).
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """``token_ids`` = prompt + generated tokens; the model has consumed the first
    ``num_computed_tokens`` of them into the state of slot ``slot``.

    A sequence with exactly one token left to compute and some state already is decoding;
    any other with work left is (still) prefilling, possibly in chunks. Sampled tokens the
    host has not read yet stand in ``token_ids`` as ``PENDING_TOKEN`` (at most the last
    two); they count towards ``max_tokens`` already, so no step is scheduled past it.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival: int = 0,
        max_tokens: int | None = None,
    ):
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: the prompt has no tokens")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival = arrival
        self.status = SequenceStatus.WAITING
        self.slot: int | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens restored from the prefix cache
        self.pending_row = 0  # row of the newest pending token in its step's tokens
        self.output_text = ""
        self.finish_reason: str | None = None
        # params.max_tokens, capped by what max_model_len leaves after the prompt.
        self.max_tokens = max_tokens if max_tokens is not None else (params.max_tokens or 2**62)
        self.eos_token_id: int | None = None
        # Gathered chunk by chunk while the prompt is prefilled ([None] for the first token).
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, the pending ones included."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_decode(self) -> bool:
        return self.num_computed_tokens > 0 and self.num_uncomputed == 1

    @property
    def wants_tokens(self) -> bool:
        """A step may compute for it: its prompt is not done, or it may still grow."""
        return self.num_uncomputed > 1 or self.num_output_tokens < self.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}, {self.status.value}, slot={self.slot}, "
            f"computed={self.num_computed_tokens}/{len(self.token_ids)})"
        )
