"""Linear layers sharded over the tensor-parallel group, as vLLM's.

y = x W^T + b with W (output_size, input_size), cut in one of two ways:

- column-parallel (``ColumnParallelLinear`` and its fused kin): each rank holds a block of
  W's rows, the output features; the input is whole on every rank, the output is this
  rank's block (``gather_output`` concatenates the blocks on every rank). ``bias`` is
  sharded like the rows.
- row-parallel (``RowParallelLinear``): each rank holds a block of W's columns, the input
  features, takes the matching block of the input and computes a partial y; the sum over
  the ranks (``reduce_results``: one all-reduce) is the layer's output. ``bias`` is
  replicated and added on rank 0 only, so the sum counts it once.

``MergedColumnParallelLinear`` stacks several column-parallel outputs (gate and up of an
MLP) and shards each one; ``QKVParallelLinear`` shards q by heads and k, v by KV heads, and
when there are fewer KV heads than ranks, gives every rank one KV head, each head held by
``tp_size // num_kv_heads`` ranks (vLLM's replication).

Weights: every parameter has ``weight_loader(param, loaded_weight, shard_id=None)``.
``loaded_weight`` is the FULL checkpoint tensor: a torch tensor, or a lazy slice of a
safetensors file (``model_loader.tp_weight_utils.CheckpointSlice``), anything with
``.shape`` and indexing by a tuple of slices. Only this rank's rows or columns are read
from it, so with a lazy slice a rank reads only its part of the file. The shape of the
full tensor is checked first; a mismatch raises ValueError saying what was expected.

At world size 1 every layer is an ``nn.Linear``: the same parameter names and shapes,
``F.linear``, no collective. ``forward`` returns the output tensor (not vLLM's
(output, bias) pair: nothing here fuses the bias into a later op).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from vllm.distributed.parallel_state import get_tp_group
from vllm.distributed.utils import divide, split_tensor_along_last_dim


def read_range(loaded_weight, dim: int, start: int, stop: int) -> torch.Tensor:
    """``loaded_weight[..., start:stop, ...]`` along ``dim``: reads only those entries from
    a lazy checkpoint slice; a view of a torch tensor."""
    index = [slice(None)] * len(loaded_weight.shape)
    index[dim] = slice(start, stop)
    return loaded_weight[tuple(index)]


def check_full_shape(loaded_weight, expected: tuple[int, ...], what: str) -> None:
    got = tuple(loaded_weight.shape)
    if got != tuple(expected):
        raise ValueError(f"{what}: the checkpoint tensor is {got}, expected the full {expected}")


@torch.no_grad()
def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` across devices and dtypes; ValueError on a shape mismatch."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"a shard of shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(src)


def replicated_weight_loader(param: nn.Parameter, loaded_weight, shard_id=None) -> None:
    """The whole tensor on every rank."""
    if shard_id is not None:
        raise ValueError(f"a replicated parameter has no shards, got shard_id={shard_id!r}")
    check_full_shape(loaded_weight, tuple(param.shape), "replicated parameter")
    copy_into(param, loaded_weight[tuple(slice(None) for _ in param.shape)])


class LinearBase(nn.Module):
    """weight (out_local, in_local), bias (bias_size,) or None; sizes are this rank's.
    Subclasses define ``weight_loader`` (set on both parameters); ``forward`` is the local
    ``F.linear`` unless a subclass adds a collective. Each parameter's ``full_shape`` is
    the checkpoint tensor's (what its loader takes)."""

    def __init__(self, input_size, output_size, in_local, out_local, bias, bias_size, dtype):
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype))
        self.weight.weight_loader = self.weight_loader
        self.weight.full_shape = (output_size, input_size)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(bias_size, dtype=dtype))
            self.bias.weight_loader = self.weight_loader
            self.bias.full_shape = (output_size,)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, local={tuple(self.weight.shape)}, "
            f"bias={self.bias is not None}, tp={self.tp_rank}/{self.tp_size}"
        )


class ReplicatedLinear(LinearBase):
    """The whole layer on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, dtype=None):
        super().__init__(input_size, output_size, input_size, output_size, bias, output_size, dtype)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        replicated_weight_loader(param, loaded_weight, shard_id)


class ColumnParallelLinear(LinearBase):
    """Output features split evenly over the ranks: rank r holds rows
    ``[r * n, (r + 1) * n)`` of W with ``n = output_size / tp_size``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        dtype=None,
    ):
        out_local = divide(output_size, get_tp_group().world_size, "output_size")
        super().__init__(input_size, output_size, input_size, out_local, bias, out_local, dtype)
        self.gather_output = gather_output

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards, got shard_id={shard_id!r}")
        full = (self.output_size, self.input_size)[: param.dim()]
        check_full_shape(loaded_weight, full, type(self).__name__)
        n = param.shape[0]
        copy_into(param, read_range(loaded_weight, 0, self.tp_rank * n, (self.tp_rank + 1) * n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return tensor_model_parallel_all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matrix (e.g. an MLP's gate and up), each
    sharded on its own: rank r's rows are its block of output 0, then of output 1, ...

    ``weight_loader(param, w, shard_id=i)`` loads output i from its own checkpoint tensor
    (``output_sizes[i]`` rows); ``shard_id=None`` loads a fused checkpoint tensor holding
    all outputs stacked.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        gather_output: bool = False,
        dtype=None,
    ):
        tp_size = get_tp_group().world_size
        local_sizes = [divide(s, tp_size, f"output_sizes[{i}]") for i, s in enumerate(output_sizes)]
        super().__init__(input_size, sum(output_sizes), bias, gather_output, dtype)
        self.output_sizes = list(output_sizes)
        self.local_sizes = local_sizes

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is not None and shard_id not in range(len(self.output_sizes)):
            raise ValueError(f"shard_id must be one of 0..{len(self.output_sizes) - 1} or None")
        ids = range(len(self.output_sizes)) if shard_id is None else [shard_id]
        rows = self.output_size if shard_id is None else self.output_sizes[shard_id]
        check_full_shape(loaded_weight, (rows, self.input_size)[: param.dim()], "merged linear")
        for i in ids:
            n = self.local_sizes[i]
            src = (sum(self.output_sizes[:i]) if shard_id is None else 0) + self.tp_rank * n
            dst = sum(self.local_sizes[:i])
            copy_into(param[dst : dst + n], read_range(loaded_weight, 0, src, src + n))


def qkv_tp_problems(num_heads: int, num_kv_heads: int, tp_size: int) -> list[str]:
    """Why q/k/v heads cannot shard over ``tp_size`` ranks (empty: they can)."""
    problems = []
    if num_heads % tp_size:
        problems.append(f"num_attention_heads={num_heads} is not divisible by tp_size={tp_size}")
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        problems.append(f"num_key_value_heads={num_kv_heads} is not divisible by tp_size={tp_size}")
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        problems.append(
            f"num_key_value_heads={num_kv_heads} is fewer than tp_size={tp_size} and does "
            "not divide it, so the KV heads cannot be replicated evenly"
        )
    return problems


class QKVParallelLinear(LinearBase):
    """q, k and v projections of attention, stacked, sharded by heads.

    Rank r holds q heads ``[r * h, (r + 1) * h)`` (h = num_heads / tp_size) and
    ``num_kv_heads`` KV heads from ``kv_head_start``: its block when there are at least as
    many KV heads as ranks, else the single head ``r // num_kv_head_replicas``. The local
    output is q | k | v of ``q_size``, ``kv_size``, ``kv_size`` features. ``shard_id``
    "q", "k", "v" loads one projection's checkpoint tensor; None a fused qkv tensor.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        dtype=None,
    ):
        tp = get_tp_group()
        total_kv = total_num_heads if total_num_kv_heads is None else total_num_kv_heads
        problems = qkv_tp_problems(total_num_heads, total_kv, tp.world_size)
        if problems:
            raise ValueError("; ".join(problems))
        num_heads = total_num_heads // tp.world_size
        num_kv_heads = max(1, total_kv // tp.world_size)
        out_local = (num_heads + 2 * num_kv_heads) * head_size
        full = (total_num_heads + 2 * total_kv) * head_size
        super().__init__(hidden_size, full, hidden_size, out_local, bias, out_local, dtype)
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_kv
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.num_kv_head_replicas = max(1, tp.world_size // total_kv)
        self.kv_head_start = (tp.rank // self.num_kv_head_replicas) * num_kv_heads
        self.q_size = num_heads * head_size
        self.kv_size = num_kv_heads * head_size

    def _blocks(self) -> dict[str, tuple[int, int, int, int]]:
        """shard id -> (its first row in a fused checkpoint tensor, the first row of this
        rank's part in the projection's own tensor, the first local row, rows)."""
        q_full = self.total_num_heads * self.head_size
        kv_full = self.total_num_kv_heads * self.head_size
        q_src, kv_src = self.tp_rank * self.q_size, self.kv_head_start * self.head_size
        return {
            "q": (0, q_src, 0, self.q_size),
            "k": (q_full, kv_src, self.q_size, self.kv_size),
            "v": (q_full + kv_full, kv_src, self.q_size + self.kv_size, self.kv_size),
        }

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id not in (None, "q", "k", "v"):
            raise ValueError(f"shard_id must be 'q', 'k', 'v' or None, got {shard_id!r}")
        kv_rows = self.total_num_kv_heads * self.head_size
        rows = {
            None: self.output_size,
            "q": self.total_num_heads * self.head_size,
            "k": kv_rows,
            "v": kv_rows,
        }[shard_id]
        what = f"QKVParallelLinear shard {shard_id or 'qkv'}"
        check_full_shape(loaded_weight, (rows, self.input_size)[: param.dim()], what)
        for name, (fused_start, own_start, dst, n) in self._blocks().items():
            if shard_id is not None and name != shard_id:
                continue
            src = own_start + (fused_start if shard_id is None else 0)
            copy_into(param[dst : dst + n], read_range(loaded_weight, 0, src, src + n))


class RowParallelLinear(LinearBase):
    """Input features split evenly over the ranks: rank r holds columns
    ``[r * n, (r + 1) * n)`` of W with ``n = input_size / tp_size``.

    ``input_is_parallel``: x is already this rank's block of features (the output of a
    column-parallel layer); otherwise x is whole and the layer takes its block.
    ``reduce_results``: all-reduce the partial sums (off: the caller reduces later).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        dtype=None,
    ):
        in_local = divide(input_size, get_tp_group().world_size, "input_size")
        super().__init__(input_size, output_size, in_local, output_size, bias, output_size, dtype)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear has no shards, got shard_id={shard_id!r}")
        if param.dim() == 1:  # the bias: replicated
            replicated_weight_loader(param, loaded_weight)
            return
        check_full_shape(loaded_weight, (self.output_size, self.input_size), "RowParallelLinear")
        n = param.shape[1]
        copy_into(param, read_range(loaded_weight, 1, self.tp_rank * n, (self.tp_rank + 1) * n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel and self.tp_size > 1:
            x = split_tensor_along_last_dim(x, self.tp_size)[self.tp_rank]
        y = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        return tensor_model_parallel_all_reduce(y) if self.reduce_results else y
