"""Reading a checkpoint rank by rank: lazy safetensors slices, and the per-parameter loaders.

Under tensor parallelism each rank reads only its part of every sharded tensor:
``iterate_checkpoint_slices`` yields, for each tensor of a safetensors checkpoint, a
``CheckpointSlice`` (its full shape and dtype, no data read), and a parameter's
``weight_loader`` (``layers/linear.py``, ``layers/vocab_parallel_embedding.py``,
``layers/mamba/mamba_tp.py``) indexes it with this rank's rows or columns; safetensors'
``get_slice`` then reads those bytes only. ``bytes_read`` counts what was read, so a test
(or a log line) can show that a rank read its share and no more.

``load_tp_weights`` drives the loaders over (name, tensor-or-slice) pairs with the errors of
``models/utils.load_named_weights``, unequal copies of a shared parameter among them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from vllm.model_executor.layers.linear import replicated_weight_loader
from vllm.model_executor.model_loader.weight_utils import open_safetensors, safetensors_files

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointSlice:
    """One tensor of an open safetensors file, read on indexing only.

    ``shape`` and ``dtype`` are the full tensor's; ``self[i0, i1, ...]`` with one slice (or
    int) per dimension reads that region from the file and returns a CPU tensor;
    ``bytes_read`` adds up what indexing has read. Valid while its file is open (during
    the iteration step of ``iterate_checkpoint_slices`` that yielded it).
    """

    def __init__(self, name: str, safe_slice):
        self.name = name
        self._slice = safe_slice
        self.shape = tuple(safe_slice.get_shape())
        self.dtype = _SAFETENSORS_DTYPES.get(safe_slice.get_dtype())
        self.bytes_read = 0

    def __getitem__(self, index) -> torch.Tensor:
        if not isinstance(index, tuple):
            index = (index,)
        if any(not isinstance(i, (slice, int)) for i in index):
            raise TypeError(f"{self.name}: index by slices or ints, got {index!r}")
        tensor = self._slice[index]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def full(self) -> torch.Tensor:
        """The whole tensor."""
        return self[tuple(slice(None) for _ in self.shape)]

    def __repr__(self) -> str:
        return f"CheckpointSlice({self.name!r}, shape={self.shape}, dtype={self.dtype})"


def iterate_checkpoint_slices(
    model_dir: str | os.PathLike,
) -> Iterator[tuple[str, CheckpointSlice]]:
    """(name, lazy slice) for every tensor of every ``*.safetensors`` shard; nothing is read
    until a slice is indexed."""
    for path in safetensors_files(model_dir):
        with open_safetensors(path) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, CheckpointSlice(name, f.get_slice(name))


WeightTarget = tuple[str, object] | str | None


def load_tp_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, object]],
    to_param: Callable[[str], WeightTarget],
) -> set[str]:
    """Load a checkpoint's (name, full tensor or ``CheckpointSlice``) pairs into ``model``,
    each through its parameter's ``weight_loader`` (whole-tensor copy where it has none).

    ``to_param(checkpoint_name)`` gives our parameter name, or (name, shard id) for one
    part of a fused parameter (``"q"`` of a qkv projection, ``0`` of gate_up), or None to
    skip the tensor. Several checkpoint names may reach the same parameter (part): the
    copies of a shared weight (Zamba2's blocks). The first is loaded; each later one is read
    the same way (this rank's rows only) into a scratch copy and must equal what is there.
    Returns the names of the parameters loaded. Raises ValueError naming the checkpoint
    tensor for a shape that does not fit, for names the model does not know, for copies of
    a shared parameter that differ (in this rank's rows), and for parameters no tensor
    reached.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    first_source: dict[tuple[str, object], str] = {}
    unknown: list[str] = []
    for ckpt_name, weight in weights:
        target = to_param(ckpt_name)
        if target is None:
            continue
        name, shard_id = (target, None) if isinstance(target, str) else target
        param = params.get(name)
        if param is None:
            unknown.append(ckpt_name)
            continue
        loader = getattr(param, "weight_loader", replicated_weight_loader)
        first = first_source.get((name, shard_id))
        dst = param if first is None else param.detach().clone()
        try:
            loader(dst, weight, shard_id)
        except ValueError as err:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} -> {name!r}: {err}") from None
        if first is not None:
            if not torch.equal(dst, param):
                raise ValueError(
                    f"checkpoint weights {first!r} and {ckpt_name!r} are copies of the "
                    f"shared parameter {name!r} but differ"
                )
            continue
        first_source[(name, shard_id)] = ckpt_name
        loaded.add(name)
    if unknown:
        raise ValueError(f"checkpoint has weights this model does not know: {sorted(unknown)}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks weights the model needs: {missing}")
    return loaded
