"""RMSNorm, and the gated, grouped RMSNorm of the Mamba2 mixer.

Both compute in fp32 from inputs of any dtype and cast once, to the weight's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps) over the last dimension."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(self.weight.dtype)


class RMSNormGated(nn.Module):
    """Mamba2's output norm: gate first, then RMSNorm within each group of channels.

    y = w * g / sqrt(mean_group(g^2) + eps) with g = x * silu(z); the last dimension is cut
    into groups of ``group_size`` channels (one per ``n_groups`` of the mixer).
    """

    def __init__(
        self,
        hidden_size: int,
        group_size: int,
        eps: float = 1e-6,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if group_size < 1 or hidden_size % group_size:
            raise ValueError(f"group_size={group_size} must divide hidden_size={hidden_size}")
        self.eps = eps
        self.group_size = group_size
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float() * F.silu(gate.float())
        g = h.unflatten(-1, (-1, self.group_size))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * g.flatten(-2)).to(self.weight.dtype)
