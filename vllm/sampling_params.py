"""SamplingParams: how one request's tokens are drawn and when its generation stops.

Every field is checked when the object is made, and the error names the field: a request
the engine accepts can never fail later because of its parameters.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1  # torch.Generator.manual_seed's range


class RequestOutputKind(enum.Enum):
    """What each output of a request holds (vLLM's names)."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request finishes


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _finite(name: str, value) -> float:
    if not _is_number(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


@dataclass
class SamplingParams:
    """vLLM's meaning: ``n`` samples of the prompt; ``temperature`` 0 is greedy;
    ``top_k`` -1 (or 0) and ``top_p`` 1.0 keep every token; ``min_p`` p > 0 drops the tokens
    less likely than p times the most likely one (after temperature; 0 keeps every token);
    ``max_tokens`` new tokens at
    most (None: up to ``max_model_len``); ``ignore_eos`` keeps generating past the
    end-of-sequence token; ``stop`` strings end generation (the output text is cut before
    the stop string); ``stop_token_ids`` end it on those tokens (kept in the output);
    ``seed`` gives the request its own random stream, so its tokens do not depend on what
    else is in the batch (sample ``i`` of ``n`` uses ``seed + i``); ``logprobs`` k returns
    the log-probability of each sampled token and of the k most likely ones;
    ``prompt_logprobs`` k does the same for each prompt token after the first.
    ``detokenize`` False leaves the output text empty and the logprobs without their
    token text (token ids and logprobs only; stop strings need it on);
    ``skip_special_tokens`` leaves special tokens out of the output text (True, vLLM's
    default) or keeps them; ``spaces_between_special_tokens`` is passed to the tokenizer's
    decode (only transformers' slow tokenizers use it, as in vLLM).

    Penalties (vLLM's and OpenAI's meaning, applied to the logits before temperature and
    the filters, greedy rows included): ``presence_penalty`` in [-2, 2] is subtracted from
    every token already in the output, ``frequency_penalty`` in [-2, 2] times its count
    there; ``repetition_penalty`` > 0 divides the positive logits of the tokens in the
    prompt or the output by it and multiplies their negative ones (1: off).
    ``logit_bias`` {token id: bias in [-100, 100]} is added to those logits (ids checked
    against the vocabulary when the request is added). ``min_tokens``: until that many
    tokens are out, the end-of-sequence token (unless ``ignore_eos``) and the
    ``stop_token_ids`` cannot be drawn and stop strings do not end the output.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        self.temperature = _finite("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _finite("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer, -1 (off) or positive, got {self.top_k!r}")
        self.min_p = _finite("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        seed = self.seed
        if seed is not None and (not _is_int(seed) or not _SEED_MIN <= seed <= _SEED_MAX):
            raise ValueError(
                f"seed must be an integer in [-2**63, 2**64 - 1] or None, got {self.seed!r}"
            )
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0 or None, got {value!r}")
        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        self.stop_strings = self._stop_strings(self.stop)
        if self.stop_strings and not self.detokenize:
            raise ValueError(
                "stop strings need the output text: they cannot be used with detokenize=False"
            )
        ids = self.stop_token_ids
        if ids is None:
            ids = []
        if not isinstance(ids, list | tuple) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(
                "stop_token_ids must be a list of non-negative integers, got "
                f"{self.stop_token_ids!r}"
            )
        self.stop_token_ids = list(ids)
        self._check_penalties()

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _finite(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _finite("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
            )
        bias = self.logit_bias
        if bias is None or bias == {}:
            self.logit_bias = None
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id to bias, got {bias!r}")
        checked = {}
        for token, value in bias.items():
            if not _is_int(token) or token < 0:
                raise ValueError(
                    f"logit_bias keys must be token ids (integers >= 0), got {token!r}"
                )
            value = _finite(f"logit_bias[{token}]", value)
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {value}")
            checked[token] = value
        self.logit_bias = checked

    @property
    def has_penalties(self) -> bool:
        """The output (and for repetition, the prompt) changes this request's logits: the
        sampler keeps token counts for it."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @staticmethod
    def _stop_strings(stop) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        return list(stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def child(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of ``n``: one sample, its own seed."""
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed > _SEED_MAX:
            seed -= 2**64
        # Every field carried over (a new field cannot be forgotten here), checked again.
        return dataclasses.replace(self, n=1, seed=seed, stop=self.stop_strings or None)
