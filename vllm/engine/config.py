"""EngineConfig: every knob of the engine, checked once."""

from __future__ import annotations

import os
from dataclasses import dataclass

from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig


@dataclass
class EngineConfig:
    """``model`` is an HF model directory or a ``Mamba2ModelConfig`` (dummy weights).

    ``max_num_seqs`` is both the most sequences in a step and the number of state slots: a
    running sequence always owns a slot, so admission never needs preemption.
    ``max_num_batched_tokens`` is the token budget of one step (decodes + prefill chunks); it
    must cover a decode token of every running sequence. ``enforce_eager`` turns the CUDA
    graphs of decode-only steps off (they are never used off CUDA).
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

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): every running sequence decodes each step"
            )
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.tokenizer is None and not isinstance(self.model, Mamba2ModelConfig):
            self.tokenizer = self.model
