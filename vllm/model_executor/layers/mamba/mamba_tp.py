"""The Mamba2 mixer's tensors over the tensor-parallel group, cut by heads (vLLM's scheme).

Sizes: H heads of P channels (I = H * P), G groups of N state features, conv width W. The
checkpoint's tensors, row by row::

    in_proj  (2I + 2GN + H, hidden):  z (I) | x (I) | B (GN) | C (GN) | dt (H)
    conv1d   (I + 2GN, [1,] W):       x (I) | B (GN) | C (GN)
    A_log, D, dt_bias (H,);  norm.weight (I,);  out_proj (hidden, I)

Rank r of T holds heads ``[r H/T, (r+1) H/T)``: the z and x channels of those heads, their
dt, A, D, dt_bias, norm gains and out_proj columns (out_proj is row-parallel: one
all-reduce). It holds the B and C features of the groups those heads read:

- T divides G: groups ``[r G/T, (r+1) G/T)``, every norm group whole on one rank;
- G divides T (G = 1 among them): the single group ``r G / T``, replicated on the T/G ranks
  that share it (vLLM does this for G = 1). A norm group then spans those ranks, so the
  gated RMSNorm sums its squares across them (``Mixer2RMSNormGated``).

Any other pair (G = 2 with T = 3, say) cannot keep each rank's heads and groups aligned and
is refused (``mamba2_tp_problems``). In both cases a rank's heads map to its groups exactly
as the whole layer's do (local head h reads local group h // (local H / local G)), so the
conv, the scan and the decode update run unchanged on the local tensors.

``mamba2_layout`` is the one place these rules are written: each tensor as stacked outputs
and the units (heads or groups) each is cut in. ``linear.RowShards`` turns it into this
rank's rows, for in_proj (a ``MergedColumnParallelLinear``), the conv weights, the per-head
parameters and the norm gains alike; every parameter's loader reads those rows of the full
checkpoint tensor. At world size 1 each rank-range is the whole tensor and the norm never
reduces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed.communication_op import tensor_model_parallel_all_reduce
from vllm.distributed.parallel_state import get_tp_group
from vllm.model_executor.layers.layernorm import rms_norm_gated
from vllm.model_executor.layers.linear import RowShards
from vllm.model_executor.layers.mamba.mamba_utils import Mamba2Shape


def mamba2_tp_problems(
    num_heads: int,
    n_groups: int,
    tp_size: int,
    names: tuple[str, str] = ("num_heads", "n_groups"),
) -> list[str]:
    """Why a Mamba2 layer of ``num_heads`` heads in ``n_groups`` groups cannot shard over
    ``tp_size`` ranks (empty: it can). ``names``: the two sizes' names in the messages
    (each config calls them its own way)."""
    heads_name, groups_name = names
    problems = []
    if num_heads % tp_size:
        problems.append(f"{heads_name}={num_heads} is not divisible by tp_size={tp_size}")
    if n_groups % tp_size and tp_size % n_groups:
        problems.append(
            f"{groups_name}={n_groups} neither divides tp_size={tp_size} (groups replicated "
            "per rank) nor is divisible by it (groups split)"
        )
    return problems


def mamba2_layout(
    shape: Mamba2Shape, tp_size: int | None = None
) -> dict[str, tuple[list[int], list[int]]]:
    """Each of a mixer's tensors as (output sizes, the units each output is cut in): the
    rows of in_proj, of the conv (weight and bias), of the per-head parameters and of the
    per-channel ones (norm gains). ValueError when the heads and groups cannot shard over
    ``tp_size`` ranks (default: this process's tensor-parallel group)."""
    h, g, inter = shape.num_heads, shape.n_groups, shape.intermediate_size
    if h % g:
        raise ValueError(f"num_heads={h} must be a multiple of n_groups={g}")
    tp_size = get_tp_group().world_size if tp_size is None else tp_size
    problems = mamba2_tp_problems(h, g, tp_size)
    if problems:
        raise ValueError("Mamba2 layer cannot be sharded: " + "; ".join(problems))
    gn = g * shape.state_size
    return {
        "in_proj": ([inter, inter, gn, gn, h], [h, h, g, g, h]),
        "conv1d": ([inter, gn, gn], [h, g, g]),
        "heads": ([h], [h]),
        "channels": ([inter], [h]),
    }


class _Conv1dLayout:
    """A checkpoint conv weight in nn.Conv1d's (dim, 1, W) layout, indexed as ours (dim, W):
    a lazy slice stays lazy (only the indexed rows are read)."""

    def __init__(self, loaded_weight):
        self.loaded_weight = loaded_weight
        self.shape = (loaded_weight.shape[0], loaded_weight.shape[2])

    def __getitem__(self, index):
        rows, cols = index
        return self.loaded_weight[rows, slice(None), cols].squeeze(1)


class RowsLoader:
    """``weight_loader`` of a mixer parameter that holds this rank's rows (``shards``) of a
    checkpoint tensor that has no separate parts."""

    def __init__(self, shards: RowShards, what: str):
        self.shards, self.what = shards, what

    def __call__(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"{self.what} has no shards, got shard_id={shard_id!r}")
        shape = tuple(loaded_weight.shape)
        if len(shape) == 3 and shape[1] == 1 and param.dim() == 2:
            loaded_weight = _Conv1dLayout(loaded_weight)
        self.shards.load(param, loaded_weight, None, self.what)


def row_parameter(shards: RowShards, local: torch.Tensor, what: str) -> nn.Parameter:
    """A parameter holding ``local`` (this rank's rows, initial values), with the loader of
    its rows and the checkpoint tensor's ``full_shape``."""
    param = nn.Parameter(local)
    param.weight_loader = RowsLoader(shards, what)
    param.full_shape = (shards.full_size, *local.shape[1:])
    return param


class DepthwiseConvWeights(nn.Module):
    """The conv1d's parameters: weight (dim, width) with stride(1) == 1, optional bias, over
    this rank's x | B | C channels (``shards``)."""

    def __init__(self, shards: RowShards, width: int, bias: bool, dtype: torch.dtype | None):
        super().__init__()
        weight = torch.empty(shards.local_size, width, dtype=dtype)
        nn.init.uniform_(weight, -(width**-0.5), width**-0.5)
        self.weight = row_parameter(shards, weight, "Mamba2 conv1d")
        self.bias = None
        if bias:
            zeros = torch.zeros(shards.local_size, dtype=dtype)
            self.bias = row_parameter(shards, zeros, "Mamba2 conv1d bias")


class Mixer2RMSNormGated(nn.Module):
    """Mamba2's gated norm on this rank's channels (``shards``: its heads' channels of the
    I = ``shards.full_size`` the layer has): y = w * g / sqrt(mean over the norm group of
    g^2 + eps), g = x * silu(gate), in ``n_groups`` groups of I / G channels.

    Where this rank holds whole groups, it is the local norm (the fused kernel on CUDA).
    Where a group spans ranks (fewer groups than ranks), each rank puts its channels' sum
    of squares into its group's column of a (tokens, G) buffer and one all-reduce gives
    every rank its group's full sum (ranks of other groups add zeros), so no sub-group of
    ranks is needed (PyTorch: no fused kernel for the partial sums yet).
    """

    def __init__(self, shards: RowShards, n_groups: int, eps: float, dtype=None):
        super().__init__()
        self.eps = eps
        self.n_groups = n_groups
        self.group_size = shards.full_size // n_groups
        ones = torch.ones(shards.local_size, dtype=dtype)
        self.weight = row_parameter(shards, ones, "Mamba2 norm")
        # The group whose channels this rank shares with others; None: its groups are whole.
        spans = shards.local_size < self.group_size
        self.shared_group = shards.starts[0] // self.group_size if spans else None

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.shared_group is None:
            return rms_norm_gated(x, gate, self.weight, self.eps, self.group_size)
        g = x.float() * F.silu(gate.float())
        sums = torch.zeros(*g.shape[:-1], self.n_groups, dtype=torch.float32, device=g.device)
        group = self.shared_group
        sums[..., group] = g.pow(2).sum(-1)
        sums = tensor_model_parallel_all_reduce(sums)
        inv_rms = torch.rsqrt(sums[..., group : group + 1] / self.group_size + self.eps)
        return (self.weight.float() * g * inv_rms).to(self.weight.dtype)
