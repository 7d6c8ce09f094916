"""RMSNorm (with the residual add fused), and the gated, grouped RMSNorm of the Mamba2 mixer.

Both compute in fp32 from inputs of any dtype and cast once, to the weight's dtype. CUDA
tensors run the one-pass Triton kernels of ``layernorm_triton``; CPU tensors the PyTorch
functions here (``rms_norm_ref``, ``rms_norm_gated_ref``), which are also the kernels'
references.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.layernorm_triton import rms_norm_triton, use_norm_kernel


def rms_norm_ref(x, weight, eps, residual=None):
    """``RMSNorm.forward`` in PyTorch: y, or (y, residual) with residual += x in place."""
    h = x.float()
    if residual is not None:
        h = h + residual.float()
        residual.copy_(h)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = (weight.float() * h).to(weight.dtype)
    return y if residual is None else (y, residual)


def rms_norm_gated_ref(x, gate, weight, eps, group_size):
    """``RMSNormGated.forward`` in PyTorch."""
    h = x.float() * F.silu(gate.float())
    g = h.unflatten(-1, (-1, group_size))
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * g.flatten(-2)).to(weight.dtype)


def _kernel_rows(*ts) -> bool:
    return all(t.dim() == 2 and t.stride(1) == 1 for t in ts) and use_norm_kernel(ts[0])


def rms_norm_gated(x, gate, weight, eps, group_size):
    """The gated, grouped RMSNorm: the Triton kernel on CUDA rows, else the reference."""
    if _kernel_rows(x, gate):
        return rms_norm_triton(x, weight, eps, gate=gate, group_size=group_size)
    return rms_norm_gated_ref(x, gate, weight, eps, group_size)


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps) over the last dimension.

    ``forward(x, residual)`` first adds: s = x + residual, written into ``residual`` (in
    place, in its dtype), and returns (norm(s), residual), as vLLM's fused add-norm.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        rows = (x,) if residual is None else (x, residual)
        if _kernel_rows(*rows):
            y = rms_norm_triton(x, self.weight, self.eps, residual=residual)
            return y if residual is None else (y, residual)
        return rms_norm_ref(x, self.weight, self.eps, residual)


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
        return rms_norm_gated(x, gate, self.weight, self.eps, self.group_size)
