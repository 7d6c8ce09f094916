"""What the engine reports after each step, for stat loggers (Prometheus: ``metrics.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FinishedRequestStats:
    e2e_latency_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    finish_reason: str | None  # "stop", "length", "abort" or "error"


@dataclass
class IterationStats:
    """One engine step. ``num_prompt_tokens`` counts the prompts whose prefill ended in the
    step (their first token came out); latencies are in seconds."""

    num_running: int = 0
    num_waiting: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatLoggerBase:
    """Called in the engine's loop thread after each step."""

    def record(self, stats: IterationStats) -> None:
        raise NotImplementedError
