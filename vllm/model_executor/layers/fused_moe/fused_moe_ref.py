"""The fp32 reference of the fused-MoE op: a loop over the experts in PyTorch.

It is the CPU path (no Triton interpreter) and the oracle of the kernels' tests. It reads
which experts are used from the device (``nonzero``), so it is neither sync-free nor
capturable in a CUDA graph: the kernels are the serving path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def activation_ref(g: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(g)
    if activation == "relu2":
        return torch.relu(g).square()
    raise ValueError(f"activation must be 'silu' or 'relu2', got {activation!r}")


def fused_experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    is_act_and_mul: bool = True,
) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), in fp32, returned in x's
    dtype. An expert is W2[e] act(W_gate[e] x) * (W_up[e] x) with W13[e] = [W_gate; W_up]
    (``is_act_and_mul``), else W2[e] act(W13[e] x)."""
    inter = w2.shape[2]
    xf = x.float()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        token, k = (ids == e).nonzero(as_tuple=True)
        h = xf[token] @ w13[e].float().t()
        if is_act_and_mul:
            h = activation_ref(h[:, :inter], activation) * h[:, inter:]
        else:
            h = activation_ref(h, activation)
        y = (h @ w2[e].float().t()) * topk_weights[token, k].float()[:, None]
        out.index_add_(0, token, y)
    return out.to(x.dtype)
