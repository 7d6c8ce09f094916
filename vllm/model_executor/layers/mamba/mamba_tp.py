"""The Mamba2 mixer sharded by heads over the tensor-parallel group (vLLM's scheme).

Sizes: H heads of P channels (I = H * P), G groups of N state features, hpg = H / G heads
per group, conv width W. The checkpoint's tensors, row by row::

    in_proj  (2I + 2GN + H, hidden):  z (I) | x (I) | B (GN) | C (GN) | dt (H)
    conv1d   (I + 2GN, [1,] W):       x (I) | B (GN) | C (GN)
    A_log, D, dt_bias (H,);  norm.weight (I,);  out_proj (hidden, I)

Rank r of T holds heads ``[r H/T, (r+1) H/T)``: the z and x channels of those heads, their
dt, A, D, dt_bias, norm gains and out_proj columns (out_proj is row-parallel: one
all-reduce). It holds the B and C features of the groups those heads read:

- T divides G: groups ``[r G/T, (r+1) G/T)``, every norm group whole on one rank;
- G divides T (G = 1 among them): the single group ``r G / T``, replicated on the T/G ranks
  that share it (vLLM does this for G = 1). A norm group then spans those ranks, so the
  gated RMSNorm sums its squares across them (``sharded_gated_rmsnorm``).

Any other pair (G = 2 with T = 3, say) cannot keep each rank's heads and groups aligned and
is refused (``mamba2_tp_problems``). In both cases a rank's heads map to its groups exactly
as the unsharded layer's do (local head h reads local group h // (local H / local G)), so
the conv, the scan and the decode update run unchanged on the local tensors.

``Mamba2Shard`` is the one place these ranges come from: the checkpoint rows each
parameter reads (``in_proj_blocks``, ``conv_blocks``, ``head_slice``, ``channel_slice``),
the loaders built from them (``mamba2_weight_loaders``), and the per-rank state pool
(``state_spec``: conv dim I/T + 2 (local G) N, H/T SSM heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed.communication_op import tensor_model_parallel_all_reduce
from vllm.distributed.parallel_state import get_tp_group
from vllm.model_executor.layers.layernorm import rms_norm_gated_ref
from vllm.model_executor.layers.linear import (
    LinearBase,
    check_full_shape,
    copy_into,
    read_range,
    replicated_weight_loader,
)
from vllm.model_executor.layers.mamba.mamba_utils import Mamba2StateSpec, mamba2_state_spec


def mamba2_tp_problems(
    num_heads: int,
    n_groups: int,
    tp_size: int,
    names: tuple[str, str] = ("num_heads", "n_groups"),
) -> list[str]:
    """Why a Mamba2 layer of ``num_heads`` heads in ``n_groups`` groups cannot shard over
    ``tp_size`` ranks (empty: it can). ``names``: the two sizes' names in the messages
    (a hybrid's config calls them otherwise)."""
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


@dataclass(frozen=True)
class RowBlock:
    """Rows ``src`` of a full checkpoint tensor go to rows ``dst`` of this rank's parameter."""

    name: str
    src: slice
    dst: slice


def _block(name: str, src_start: int, dst_start: int, n: int) -> RowBlock:
    return RowBlock(name, slice(src_start, src_start + n), slice(dst_start, dst_start + n))


@dataclass(frozen=True)
class Mamba2Shard:
    """What rank ``tp_rank`` of ``tp_size`` holds of a Mamba2 mixer of the given (full) sizes."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    tp_size: int
    tp_rank: int

    def __post_init__(self):
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} is out of range for tp_size={self.tp_size}")
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of n_groups={self.n_groups}"
            )
        problems = mamba2_tp_problems(self.num_heads, self.n_groups, self.tp_size)
        if problems:
            raise ValueError("Mamba2 layer cannot be sharded: " + "; ".join(problems))

    # -- ranges, in global indices -----------------------------------------------------

    @property
    def heads(self) -> range:
        n = self.num_heads // self.tp_size
        return range(self.tp_rank * n, (self.tp_rank + 1) * n)

    @property
    def groups(self) -> range:
        """The groups whose B and C this rank holds (the groups its heads read)."""
        hpg = self.num_heads // self.n_groups
        return range(self.heads.start // hpg, (self.heads.stop - 1) // hpg + 1)

    @property
    def groups_replicated(self) -> bool:
        """Each group is held by several ranks (fewer groups than ranks)."""
        return self.n_groups < self.tp_size

    @property
    def norm_spans_ranks(self) -> bool:
        """A norm group (one SSM group's channels) spans ranks: the gated RMSNorm reduces."""
        return self.groups_replicated

    @property
    def norm_group_size(self) -> int:
        """Channels per group of the gated RMSNorm (the full layer's, I / G)."""
        return self.intermediate_size // self.n_groups

    # -- full sizes (the checkpoint tensors' rows) ----------------------------------------

    @property
    def intermediate_size(self) -> int:
        """I: rows of z (and of x), of norm.weight, columns of out_proj."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """I + 2GN: rows of conv1d (x | B | C)."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def in_proj_size(self) -> int:
        """2I + 2GN + H: rows of in_proj (z | x | B | C | dt)."""
        return self.intermediate_size + self.conv_dim + self.num_heads

    # -- local sizes ---------------------------------------------------------------------

    @property
    def local_num_heads(self) -> int:
        return len(self.heads)

    @property
    def local_n_groups(self) -> int:
        return len(self.groups)

    @property
    def local_intermediate_size(self) -> int:
        return self.local_num_heads * self.head_dim

    @property
    def local_conv_dim(self) -> int:
        return self.local_intermediate_size + 2 * self.local_n_groups * self.state_size

    @property
    def local_in_proj_size(self) -> int:
        return self.local_intermediate_size + self.local_conv_dim + self.local_num_heads

    def state_spec(self) -> Mamba2StateSpec:
        """The per-slot state of this rank: what its state pool allocates per layer."""
        return mamba2_state_spec(
            num_heads=self.local_num_heads,
            head_dim=self.head_dim,
            state_size=self.state_size,
            n_groups=self.local_n_groups,
            conv_kernel=self.conv_kernel,
        )

    # -- checkpoint rows -----------------------------------------------------------------

    @property
    def head_slice(self) -> slice:
        """This rank's entries of A_log, D, dt_bias (and of dt)."""
        return slice(self.heads.start, self.heads.stop)

    @property
    def channel_slice(self) -> slice:
        """This rank's channels of z, x, y: rows of norm.weight, columns of out_proj."""
        p = self.head_dim
        return slice(self.heads.start * p, self.heads.stop * p)

    def _xbc_blocks(self, x_src: int, dst: int) -> list[RowBlock]:
        """x, B, C of this rank when the full x block starts at row ``x_src``."""
        inter = self.intermediate_size
        gn, n = self.n_groups * self.state_size, self.state_size
        li, lgn = self.local_intermediate_size, self.local_n_groups * n
        return [
            _block("x", x_src + self.channel_slice.start, dst, li),
            _block("B", x_src + inter + self.groups.start * n, dst + li, lgn),
            _block("C", x_src + inter + gn + self.groups.start * n, dst + li + lgn, lgn),
        ]

    def in_proj_blocks(self) -> list[RowBlock]:
        """z, x, B, C, dt: rows of the full in_proj (weight and bias) -> local rows."""
        inter = self.intermediate_size
        li = self.local_intermediate_size
        dt_src, dt_dst = inter + self.conv_dim + self.heads.start, li + self.local_conv_dim
        return [
            _block("z", self.channel_slice.start, 0, li),
            *self._xbc_blocks(inter, li),
            _block("dt", dt_src, dt_dst, self.local_num_heads),
        ]

    def conv_blocks(self) -> list[RowBlock]:
        """x, B, C: rows (channels) of the full conv1d weight, bias and conv state."""
        return self._xbc_blocks(0, 0)


def mamba2_shard(
    *,
    num_heads: int,
    head_dim: int,
    state_size: int,
    n_groups: int,
    conv_kernel: int,
    tp_size: int | None = None,
    tp_rank: int | None = None,
) -> Mamba2Shard:
    """The shard of this process (``parallel_state``'s rank) unless rank and size are given."""
    tp = get_tp_group()
    return Mamba2Shard(
        num_heads,
        head_dim,
        state_size,
        n_groups,
        conv_kernel,
        tp.world_size if tp_size is None else tp_size,
        tp.rank if tp_rank is None else tp_rank,
    )


def load_row_blocks(param, loaded_weight, blocks: list[RowBlock], full_rows: int) -> None:
    """Copy each block's checkpoint rows into the parameter's rows; reads nothing else.

    A conv weight in nn.Conv1d's (dim, 1, W) layout loads into ours, (dim, W).
    """
    shape = tuple(loaded_weight.shape)
    squeeze = len(shape) == 3 and shape[1] == 1 and param.dim() == 2
    want = (full_rows, *param.shape[1:])
    check_full_shape(loaded_weight, (full_rows, 1, param.shape[1]) if squeeze else want, "Mamba2")
    for b in blocks:
        part = read_range(loaded_weight, 0, b.src.start, b.src.stop)
        copy_into(param[b.dst], part.squeeze(1) if squeeze else part)


def mamba2_weight_loaders(shard: Mamba2Shard) -> dict[str, object]:
    """``weight_loader(param, full_tensor, shard_id=None)`` for each parameter of a mixer
    (keys: its names relative to the mixer, as in HF checkpoints)."""
    inter, conv_rows, in_rows = shard.intermediate_size, shard.conv_dim, shard.in_proj_size

    def rows(blocks, full_rows):
        def loader(param, loaded_weight, shard_id=None):
            if shard_id is not None:
                raise ValueError(f"Mamba2 parameters have no shards, got {shard_id!r}")
            load_row_blocks(param, loaded_weight, blocks, full_rows)

        return loader

    heads = rows(
        [_block("heads", shard.head_slice.start, 0, shard.local_num_heads)], shard.num_heads
    )
    channels = [_block("channels", shard.channel_slice.start, 0, shard.local_intermediate_size)]

    def out_proj_weight(param, loaded_weight, shard_id=None):
        if shard_id is not None:
            raise ValueError(f"Mamba2 parameters have no shards, got {shard_id!r}")
        check_full_shape(loaded_weight, (param.shape[0], inter), "Mamba2 out_proj")
        cols = shard.channel_slice
        copy_into(param, read_range(loaded_weight, 1, cols.start, cols.stop))

    return {
        "in_proj.weight": rows(shard.in_proj_blocks(), in_rows),
        "in_proj.bias": rows(shard.in_proj_blocks(), in_rows),
        "conv1d.weight": rows(shard.conv_blocks(), conv_rows),
        "conv1d.bias": rows(shard.conv_blocks(), conv_rows),
        "A_log": heads,
        "D": heads,
        "dt_bias": heads,
        "norm.weight": rows(channels, inter),
        "out_proj.weight": out_proj_weight,
        "out_proj.bias": replicated_weight_loader,
    }


def attach_mixer_loaders(mixer: nn.Module, shard: Mamba2Shard) -> None:
    """Give a sharded mixer's own parameters (conv1d, A_log, D, dt_bias, norm gains; the
    linears carry theirs) the loader that reads their rows from the full checkpoint tensor
    and ``full_shape``, that tensor's shape (dummy weights are drawn at it)."""
    inter, conv_rows = shard.intermediate_size, shard.conv_dim
    full_shapes = {
        "conv1d.weight": (conv_rows, shard.conv_kernel),
        "conv1d.bias": (conv_rows,),
        "A_log": (shard.num_heads,),
        "D": (shard.num_heads,),
        "dt_bias": (shard.num_heads,),
        "norm.weight": (inter,),
    }
    loaders = mamba2_weight_loaders(shard)
    for name, param in mixer.named_parameters():
        if name in full_shapes:
            param.weight_loader = loaders[name]
            param.full_shape = full_shapes[name]


class Mamba2InProj(LinearBase):
    """in_proj of one rank: its z | x | B | C | dt rows (``Mamba2Shard.in_proj_blocks``),
    loaded from the full checkpoint tensor; column-parallel with no gather (the rank's
    heads stay local up to out_proj)."""

    def __init__(self, shard: Mamba2Shard, hidden_size: int, bias: bool, dtype=None):
        full, local = shard.in_proj_size, shard.local_in_proj_size
        super().__init__(hidden_size, full, hidden_size, local, bias, local, dtype)
        self.shard = shard

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"Mamba2 in_proj has no shards, got shard_id={shard_id!r}")
        load_row_blocks(param, loaded_weight, self.shard.in_proj_blocks(), self.output_size)


def sharded_gated_rmsnorm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, shard: Mamba2Shard
) -> torch.Tensor:
    """Mamba2's gated grouped RMSNorm on this rank's channels (tokens, local I).

    y = w * g / sqrt(mean over the norm group of g^2 + eps), g = x * silu(gate). Where the
    norm groups are whole on each rank this is the local norm. Where a group spans ranks,
    each rank sums its channels' squares into that group's column of a (tokens, G) buffer
    and one all-reduce of the buffer gives every rank its group's full sum (ranks of other
    groups add zeros), so no sub-group of ranks is needed.
    """
    if not shard.norm_spans_ranks:
        return rms_norm_gated_ref(x, gate, weight, eps, shard.norm_group_size)
    g = x.float() * F.silu(gate.float())
    sums = torch.zeros(*g.shape[:-1], shard.n_groups, dtype=torch.float32, device=g.device)
    group = shard.groups.start
    sums[..., group] = g.pow(2).sum(-1)
    sums = tensor_model_parallel_all_reduce(sums)
    inv_rms = torch.rsqrt(sums[..., group : group + 1] / shard.norm_group_size + eps)
    return (weight.float() * g * inv_rms).to(weight.dtype)


class ShardedRMSNormGated(nn.Module):
    """The gated RMSNorm of a rank whose norm group spans ranks (fewer groups than ranks):
    ``weight`` holds this rank's channels' gains (parameter name ``weight``, as
    ``RMSNormGated``'s), the forward reduces the groups' sums of squares across the ranks
    (``sharded_gated_rmsnorm``; PyTorch, no fused kernel yet)."""

    def __init__(self, shard: Mamba2Shard, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.shard = shard
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(shard.local_intermediate_size, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return sharded_gated_rmsnorm(x, gate, self.weight, self.eps, self.shard)
