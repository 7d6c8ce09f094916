"""Helpers shared by the CUDA-pathway tests (test_causal_conv1d_cuda*.py)."""

from __future__ import annotations

import torch


def width_major(pool: torch.Tensor) -> torch.Tensor:
    """A copy of a state pool in the CUDA ops' layout: (lines, dim, state_len), stride(2) == 1.

    Always a copy (``contiguous()`` would return the pool itself when state_len == 1).
    """
    return pool.clone(memory_format=torch.contiguous_format)


def silu_flag(activation) -> bool:
    """The CUDA ops' ``silu`` flag for an activation of the Triton ops."""
    return activation is not None
