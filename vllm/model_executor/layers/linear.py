"""Linear layers sharded over the tensor-parallel group, as vLLM's: the models' only linear
layers, at every world size.

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
MLP; z | x | B | C | dt of a Mamba2 mixer) and shards each one on its own (``RowShards``).
An output may be cut in units (heads, groups) rather than rows: when there are fewer units
than ranks, each rank holds one unit, shared by ``tp_size / units`` ranks (vLLM's
replication of KV heads and of Mamba2 groups). ``QKVParallelLinear`` is the merged q | k | v
of attention, cut by heads and KV heads.

At world size 1 every layer holds the whole weight and its forward is ``F.linear`` on it
(the collectives return their input untouched), so a model has one path at every world
size. ``forward`` returns the output tensor (not vLLM's (output, bias) pair: nothing here
fuses the bias into a later op).

Weights: every parameter has ``weight_loader(param, loaded_weight, shard_id=None)``.
``loaded_weight`` is the FULL checkpoint tensor: a torch tensor, or a lazy slice of a
safetensors file (``model_loader.weight_utils.CheckpointSlice``), anything with ``.shape``
and indexing by a tuple of slices. Only this rank's rows or columns are read from it, so
with a lazy slice a rank reads only its part of the file. The full shape is checked first
(``WeightShapeError``). ``full_shape`` on a parameter is the checkpoint tensor's shape and,
on a merged layer's, ``shard_shapes`` that of each part's own tensor, by shard id: dummy
weights are drawn at those shapes, the same at every world size.
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


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape is not the one a parameter loads from."""

    def __init__(self, what: str, got: tuple[int, ...], expected: tuple[int, ...]):
        super().__init__(f"{what}: the checkpoint tensor is {got}, expected the full {expected}")
        self.got, self.expected = got, expected


def read_range(loaded_weight, dim: int, start: int, stop: int) -> torch.Tensor:
    """``loaded_weight[..., start:stop, ...]`` along ``dim``: reads only those entries from
    a lazy checkpoint slice; a view of a torch tensor."""
    index = [slice(None)] * len(loaded_weight.shape)
    index[dim] = slice(start, stop)
    return loaded_weight[tuple(index)]


def check_full_shape(loaded_weight, expected: tuple[int, ...], what: str) -> None:
    got = tuple(loaded_weight.shape)
    if got != tuple(expected):
        raise WeightShapeError(what, got, tuple(expected))


@torch.no_grad()
def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` across devices and dtypes; ValueError on a shape mismatch."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"a shard of shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(src)


def replicated_weight_loader(param: nn.Parameter, loaded_weight, shard_id=None) -> None:
    """The whole tensor on every rank (the loader of a parameter that carries none)."""
    if shard_id is not None:
        raise ValueError(f"a replicated parameter has no shards, got shard_id={shard_id!r}")
    check_full_shape(loaded_weight, tuple(param.shape), "replicated parameter")
    copy_into(param, loaded_weight[tuple(slice(None) for _ in param.shape)])


def shard_units(units: int, tp_size: int, tp_rank: int, what: str = "units") -> range:
    """The units (heads, groups, rows) of one output that rank ``tp_rank`` holds: its block
    of ``units / tp_size`` when the ranks divide the units; when the units divide the ranks
    (fewer units than ranks), the one unit ``tp_rank // (tp_size / units)``, which the
    ``tp_size / units`` ranks around it hold too."""
    if units % tp_size == 0:
        n = units // tp_size
        return range(tp_rank * n, (tp_rank + 1) * n)
    if tp_size % units == 0:
        unit = tp_rank // (tp_size // units)
        return range(unit, unit + 1)
    raise ValueError(f"{what}={units} neither divides nor is divisible by tp_size={tp_size}")


class RowShards:
    """This rank's rows of a tensor made of outputs stacked along dim 0 (a fused checkpoint
    tensor holds them in this order): output i has ``output_sizes[i]`` rows in ``units[i]``
    equal units (default: one unit per row, split evenly), cut by ``shard_units``. Locally
    the rank's part of each output follows the previous one's."""

    def __init__(self, output_sizes, units=None, tp_rank=None, tp_size=None):
        tp = get_tp_group()
        self.tp_rank = tp.rank if tp_rank is None else tp_rank
        self.tp_size = tp.world_size if tp_size is None else tp_size
        self.output_sizes = [int(s) for s in output_sizes]
        if units is None:
            for i, size in enumerate(self.output_sizes):
                divide(size, self.tp_size, f"output_sizes[{i}]")
            units = self.output_sizes
        self.starts, self.local_sizes = [], []
        for i, (rows, n_units) in enumerate(zip(self.output_sizes, units, strict=True)):
            per_unit = divide(rows, n_units, f"output_sizes[{i}] in {n_units} units")
            held = shard_units(n_units, self.tp_size, self.tp_rank, f"units[{i}]")
            self.starts.append(held.start * per_unit)
            self.local_sizes.append(len(held) * per_unit)
        # Some units sit on several ranks (fewer units than ranks).
        self.replicated = any(
            n * self.tp_size != size
            for n, size in zip(self.local_sizes, self.output_sizes, strict=True)
        )

    @property
    def full_size(self) -> int:
        return sum(self.output_sizes)

    @property
    def local_size(self) -> int:
        return sum(self.local_sizes)

    def load(self, param, loaded_weight, index: int | None, what: str) -> None:
        """Copy this rank's rows of output ``index`` (from that output's own tensor) or, for
        None, of every output (from the fused tensor) into ``param``'s rows; reads nothing
        else of ``loaded_weight``."""
        ids = range(len(self.output_sizes)) if index is None else [index]
        rows = self.full_size if index is None else self.output_sizes[index]
        check_full_shape(loaded_weight, (rows, *param.shape[1:]), what)
        for i in ids:
            offset = sum(self.output_sizes[:i]) if index is None else 0
            src, dst, n = offset + self.starts[i], sum(self.local_sizes[:i]), self.local_sizes[i]
            copy_into(param[dst : dst + n], read_range(loaded_weight, 0, src, src + n))


class LinearBase(nn.Module):
    """weight (out_local, in_local), bias (bias_size,) or None; sizes are this rank's.
    Subclasses define ``weight_loader`` (set on both parameters); ``forward`` is the local
    ``F.linear`` unless a subclass adds a collective."""

    def __init__(self, input_size, output_size, in_local, out_local, bias, bias_size, dtype):
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(bias_size, dtype=dtype)) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader
                param.full_shape = (output_size, input_size)[: param.dim()]

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
    """Output features split over the ranks: rank r holds rows ``[r * n, (r + 1) * n)`` of
    W with ``n = output_size / tp_size`` (of each of ``output_sizes``, stacked, when given;
    in ``units`` of several rows each, when given: ``RowShards``)."""

    # Ids of the parts a checkpoint may hold as separate tensors (none for a plain layer).
    shard_ids: tuple = ()

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        dtype=None,
        *,
        output_sizes: list[int] | None = None,
        units: list[int] | None = None,
    ):
        shards = RowShards([output_size] if output_sizes is None else output_sizes, units)
        if shards.full_size != output_size:
            raise ValueError(f"output_sizes {shards.output_sizes} do not add up to {output_size}")
        if gather_output and shards.replicated:
            raise ValueError("gather_output would repeat the units that ranks share")
        local = shards.local_size
        super().__init__(input_size, output_size, input_size, local, bias, local, dtype)
        self.shards = shards
        self.gather_output = gather_output

    def _part_index(self, shard_id) -> int | None:
        if shard_id is None:
            return None
        if not self.shard_ids:
            raise ValueError(f"{type(self).__name__} has no shards, got shard_id={shard_id!r}")
        if shard_id not in self.shard_ids:
            ids = ", ".join(map(repr, self.shard_ids))
            raise ValueError(f"shard_id must be one of {ids} or None, got {shard_id!r}")
        return self.shard_ids.index(shard_id)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        index = self._part_index(shard_id)
        what = type(self).__name__ + ("" if shard_id is None else f" shard {shard_id!r}")
        self.shards.load(param, loaded_weight, index, what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        return tensor_model_parallel_all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matrix (an MLP's gate and up; a Mamba2
    mixer's z | x | B | C | dt, in ``units`` of heads and groups), each sharded on its own:
    rank r's rows are its part of output 0, then of output 1, ...

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
        units: list[int] | None = None,
    ):
        super().__init__(
            input_size,
            sum(output_sizes),
            bias,
            gather_output,
            dtype,
            output_sizes=output_sizes,
            units=units,
        )
        self.output_sizes = self.shards.output_sizes
        self.local_sizes = self.shards.local_sizes
        self.shard_ids = tuple(range(len(output_sizes)))
        self._set_shard_shapes()

    def _set_shard_shapes(self) -> None:
        for param in (self.weight, self.bias):
            if param is not None:
                full = [(rows, self.input_size)[: param.dim()] for rows in self.output_sizes]
                param.shard_shapes = dict(zip(self.shard_ids, full, strict=True))


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


class QKVParallelLinear(MergedColumnParallelLinear):
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
        tp_size = get_tp_group().world_size
        total_kv = total_num_heads if total_num_kv_heads is None else total_num_kv_heads
        problems = qkv_tp_problems(total_num_heads, total_kv, tp_size)
        if problems:
            raise ValueError("; ".join(problems))
        heads = [total_num_heads, total_kv, total_kv]
        sizes = [n * head_size for n in heads]
        super().__init__(hidden_size, sizes, bias, dtype=dtype, units=heads)
        self.shard_ids = ("q", "k", "v")
        self._set_shard_shapes()
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_kv
        self.q_size, self.kv_size = self.local_sizes[0], self.local_sizes[1]
        self.num_heads, self.num_kv_heads = self.q_size // head_size, self.kv_size // head_size
        self.num_kv_head_replicas = max(1, tp_size // total_kv)
        self.kv_head_start = self.shards.starts[1] // head_size

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v (views) of this layer's output."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


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
