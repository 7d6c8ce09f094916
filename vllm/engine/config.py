"""EngineConfig: every knob of the engine, checked once."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

import torch

from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

_SSM_CACHE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass
class EngineConfig:
    """``model`` is an HF model directory or a ``Mamba2ModelConfig`` (dummy weights).

    ``max_num_seqs`` is both the most sequences in a step and the number of state slots: a
    running sequence always owns a slot, so admission never needs preemption.
    ``max_num_batched_tokens`` is the token budget of one step (decodes + prefill chunks); it
    must cover a decode token of every running sequence. ``enforce_eager`` turns the CUDA
    graphs of decode-only steps off (they are never used off CUDA).
    ``mamba_ssm_cache_dtype`` (vLLM's name) is the dtype of the SSM state pool: "float32"
    (default), "bfloat16" or "float16"; the scan and the decode update compute in fp32
    whatever it is, and read and write the pool in it. ``async_scheduling`` dispatches
    each step before the host reads the previous step's tokens (``llm_engine.py``).
    ``max_model_len`` bounds prompt + output tokens (a longer prompt is refused, and
    generation stops there with finish reason "length"); None takes the config's
    ``max_position_embeddings``, else 2048 (vLLM's fallback). ``served_model_name`` is the
    name the server answers to (default: the model argument).
    """

    model: str | os.PathLike | Mamba2ModelConfig
    tokenizer: str | os.PathLike | None = None
    load_format: str = "auto"
    dtype: str | None = None
    device: str = "auto"
    seed: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enforce_eager: bool = False
    mamba_ssm_cache_dtype: str = "float32"
    async_scheduling: bool = True
    max_model_len: int | None = None
    served_model_name: str | None = None

    def __post_init__(self):
        if isinstance(self.mamba_ssm_cache_dtype, torch.dtype):
            self.mamba_ssm_cache_dtype = str(self.mamba_ssm_cache_dtype).removeprefix("torch.")
        if self.mamba_ssm_cache_dtype not in _SSM_CACHE_DTYPES:
            raise ValueError(
                f"mamba_ssm_cache_dtype must be one of {', '.join(_SSM_CACHE_DTYPES)}, got "
                f"{self.mamba_ssm_cache_dtype!r}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): every running sequence decodes each step"
            )
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.tokenizer is None and not isinstance(self.model, Mamba2ModelConfig):
            self.tokenizer = self.model
        if self.max_model_len is None:
            self.max_model_len = self.model_config.max_position_embeddings or 2048
        if (
            isinstance(self.max_model_len, bool)
            or not isinstance(self.max_model_len, int)
            or self.max_model_len < 1
        ):
            raise ValueError(
                f"max_model_len must be a positive integer, got {self.max_model_len!r}"
            )
        if self.served_model_name is None:
            self.served_model_name = (
                "mamba2" if isinstance(self.model, Mamba2ModelConfig) else str(self.model)
            )

    @cached_property
    def model_config(self) -> Mamba2ModelConfig:
        if isinstance(self.model, Mamba2ModelConfig):
            return self.model
        return Mamba2ModelConfig.from_pretrained(self.model)

    @property
    def ssm_state_dtype(self) -> torch.dtype:
        return _SSM_CACHE_DTYPES[self.mamba_ssm_cache_dtype]
