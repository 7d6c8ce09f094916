"""The collectives of the tensor-parallel group, on torch.distributed.

Each is the identity on a single rank (no process group, no copy). Tensors on the
rank's device go through the device group (NCCL on CUDA); host tensors and Python objects
through the gloo group (``parallel_state.TPGroup``). Every rank of the group must make the
same calls in the same order, with tensors of the same shape and dtype; a rank that
fails or stops makes the others' calls raise after the group's timeout (gloo notices a
dead peer at once).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from vllm.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the ranks. Reduces in place (``x`` itself is returned) when
    ``x`` is contiguous; otherwise a contiguous copy is reduced and returned."""
    tp = get_tp_group()
    if not tp.is_distributed:
        return x
    if not x.is_contiguous():
        x = x.contiguous()
    dist.all_reduce(x, group=tp.group_for(x))
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in rank order (every rank gets it)."""
    tp = get_tp_group()
    if not tp.is_distributed:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.world_size)]
    dist.all_gather(parts, x, group=tp.group_for(x))
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_gather(
    x: torch.Tensor, dst: int = 0, dim: int = -1
) -> torch.Tensor | None:
    """The ranks' ``x`` concatenated along ``dim`` on rank ``dst``; None on the others."""
    tp = get_tp_group()
    if not tp.is_distributed:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.world_size)] if tp.rank == dst else None
    dist.gather(x, parts, dst=dst, group=tp.group_for(x))
    return torch.cat(parts, dim=dim) if parts is not None else None


def min_over_ranks(value: int) -> int:
    """The least of the ranks' ``value`` (over the gloo group): a size each rank measures
    from its own free memory (KV blocks, checkpoint lines) that every rank must share."""
    tp = get_tp_group()
    if not tp.is_distributed:
        return value
    box = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(box, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return int(box.item())


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank ``src``'s ``x`` into every rank's ``x`` (in place; same shape and dtype)."""
    tp = get_tp_group()
    if tp.is_distributed:
        dist.broadcast(x, src=src, group=tp.group_for(x))
    return x


def broadcast_object(obj: Any = None, src: int = 0) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (the others pass nothing)."""
    tp = get_tp_group()
    if not tp.is_distributed:
        return obj
    box = [obj if tp.rank == src else None]
    dist.broadcast_object_list(box, src=src, group=tp.cpu_group)
    return box[0]


def broadcast_tensor_dict(
    tensor_dict: dict[str, Any] | None = None, src: int = 0
) -> dict[str, Any]:
    """Rank ``src``'s dict on every rank: its tensors through the collectives (device
    tensors arrive on each rank's device, host tensors on the host), the other values
    pickled. One object broadcast carries the keys, the values and the tensors' shapes and
    dtypes; then one tensor broadcast per tensor."""
    tp = get_tp_group()
    if not tp.is_distributed:
        if tensor_dict is None:
            raise ValueError("broadcast_tensor_dict on a single rank needs the dict")
        return tensor_dict
    if tp.rank == src:
        if tensor_dict is None:
            raise ValueError(f"rank {src} (the source) must pass the dict")
        meta = {
            key: (
                ("tensor", v.dtype, tuple(v.shape), v.device.type)
                if isinstance(v, torch.Tensor)
                else ("value", v)
            )
            for key, v in tensor_dict.items()
        }
    else:
        meta = None
    meta = broadcast_object(meta, src=src)
    out: dict[str, Any] = {}
    for key, entry in meta.items():
        if entry[0] == "value":
            out[key] = entry[1]
            continue
        _, dtype, shape, device_type = entry
        device = torch.device("cpu") if device_type == "cpu" else tp.device
        if tp.rank == src:
            t = tensor_dict[key].contiguous()
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
        out[key] = broadcast(t, src=src)
    return out
