"""SamplingParams: how one request's tokens are drawn and when its generation stops."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """vLLM's meaning: ``temperature`` 0 is greedy; ``top_k`` -1 (or 0) and ``top_p`` 1.0
    keep every token; ``max_tokens`` new tokens at most; ``ignore_eos`` keeps generating past
    the end-of-sequence token; ``stop`` strings end generation (the output text is cut before
    the stop string); ``seed`` gives the request its own random stream, so its tokens do not
    depend on what else is in the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or positive, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.stop_strings = stop

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
