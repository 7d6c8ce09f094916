"""Sequence: one request's tokens, its progress through the model, and its state slot."""

from __future__ import annotations

import enum

from vllm.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """``token_ids`` = prompt + generated tokens; the model has consumed the first
    ``num_computed_tokens`` of them into the state of slot ``slot``.

    A sequence with exactly one token left to compute and some state already is decoding;
    any other with work left is (still) prefilling, possibly in chunks.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival: int = 0,
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
        self.output_text = ""
        self.finish_reason: str | None = None

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
    def is_decode(self) -> bool:
        return self.num_computed_tokens > 0 and self.num_uncomputed == 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}, {self.status.value}, slot={self.slot}, "
            f"computed={self.num_computed_tokens}/{len(self.token_ids)})"
        )
