"""The tensor-parallel group of this process, on torch.distributed.

One process per rank; the tensor-parallel group is the whole world (no pipeline stages).
``init_distributed`` joins it (NCCL for CUDA tensors, gloo for CPU ones); every layer and
collective then reads it through ``get_tp_group()``. This module is the one place that
holds that state: layers read their rank and world size here when they are built, and
the collectives of ``communication_op`` find their process groups here.

World size 1 needs no process group at all: before ``init_distributed`` (or after
``init_distributed(1, 0)``) the group is a single rank, every collective is the identity
and no torch.distributed call is made, so single-GPU code pays nothing.

Under NCCL each rank also gets a gloo group over the same ranks (``cpu_group``), for
Python objects and host tensors; under gloo the two are one group. NVLink multicast is
switched off for NCCL (``MULTICAST_OFF_ENV``): a program that uses it can take the GPUs of
a shared host out of service, so the variables are set unless the user has set them.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
BACKENDS = ("nccl", "gloo")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

# NCCL's, PyTorch's and NVSHMEM's own switches for NVLink multicast (NVLS): off.
MULTICAST_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group.

    ``device_group`` runs the collectives of tensors on ``device`` (NCCL on CUDA, gloo on
    CPU); ``cpu_group`` (gloo) those of Python objects and host tensors. Both are None for
    a single rank. ``owns_process_group``: ``init_distributed`` created torch.distributed's
    default group (and ``destroy`` tears it down); False when it found one already made,
    e.g. by torchrun and the user.
    """

    rank: int
    world_size: int
    backend: str | None
    device: torch.device
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    owns_process_group: bool = False

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def group_for(self, tensor: torch.Tensor) -> dist.ProcessGroup | None:
        """The group whose backend can move ``tensor`` (host tensors go over gloo)."""
        if tensor.device.type == "cpu":
            return self.cpu_group
        if self.backend != "nccl":
            raise ValueError(
                f"a {tensor.device} tensor cannot go through the {self.backend} group; "
                "initialise with backend='nccl' for CUDA tensors"
            )
        return self.device_group


_SINGLE_RANK = TPGroup(rank=0, world_size=1, backend=None, device=torch.device("cpu"))
_TP: TPGroup = _SINGLE_RANK
_INITIALIZED = False


def _check_int(name: str, value, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")


def init_distributed(
    world_size: int,
    rank: int,
    backend: str | None = None,
    init_method: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    store: dist.Store | None = None,
) -> TPGroup:
    """Join the tensor-parallel group of ``world_size`` ranks as ``rank``; returns it.

    ``backend``: "nccl" (CUDA; the rank uses GPU ``rank % device_count``) or "gloo" (CPU);
    None picks NCCL when CUDA is available, gloo otherwise. ``init_method`` is
    torch.distributed's ("tcp://host:port", "file:///path"; None: "env://", which reads
    MASTER_ADDR and MASTER_PORT). ``timeout_s`` bounds every collective: a rank that stops
    answering makes the others' collectives fail after it instead of hanging. ``store``: a
    rendezvous store already made (MultiprocExecutor's), in place of ``init_method``; when
    it is on this host's loopback address, so are gloo's sockets.

    World size 1 creates no process group. Raises RuntimeError when called twice without
    ``destroy`` in between, ValueError for arguments that cannot work.
    """
    global _TP, _INITIALIZED
    if _INITIALIZED:
        raise RuntimeError(
            f"the tensor-parallel group is already initialised (rank {_TP.rank} of "
            f"{_TP.world_size}); call destroy() first"
        )
    _check_int("world_size", world_size, 1)
    _check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if store is not None and init_method is not None:
        raise ValueError("give init_method or store, not both")
    if world_size == 1:
        _TP, _INITIALIZED = _SINGLE_RANK, True
        return _TP

    if backend is None and dist.is_initialized():
        backend = dist.get_backend()  # joining a group made by someone else (torchrun)
    elif backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    device = torch.device("cpu")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA GPUs; use 'gloo' on CPUs")
        for key, value in MULTICAST_OFF_ENV.items():
            os.environ.setdefault(key, value)
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)

    timeout = datetime.timedelta(seconds=timeout_s)
    owns = not dist.is_initialized()
    local = getattr(store, "host", None) in LOOPBACK_HOSTS
    if owns:
        where = (
            dict(store=store) if store is not None else dict(init_method=init_method or "env://")
        )
        _unnamed_groups_from_zero()
        try:
            with _gloo_on_loopback(local):
                dist.init_process_group(
                    backend, world_size=world_size, rank=rank, timeout=timeout, **where
                )
        except BaseException:
            _unnamed_groups_from_zero()
            raise
    elif (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
        raise ValueError(
            f"torch.distributed is already initialised as rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, not rank {rank} of {world_size}"
        )
    world = dist.group.WORLD
    cpu_group = world
    if backend == "nccl":
        try:
            with _gloo_on_loopback(local):
                cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        except BaseException:
            if owns:  # leave no half-made world behind (destroying it resets the names)
                with contextlib.suppress(Exception):  # the error to report is the first
                    dist.destroy_process_group()
                _unnamed_groups_from_zero()
            raise
    _TP = TPGroup(rank, world_size, backend, device, world, cpu_group, owns)
    _INITIALIZED = True
    return _TP


def _unnamed_groups_from_zero() -> None:
    """torch names each group made without a name from a per-process counter, and that
    name prefixes the store keys of the group's rendezvous. It resets the counter only when
    a default group is destroyed, so an ``init_process_group`` that failed (a rank that
    never came) leaves it advanced: this process's next rank 0 would then wait on other keys
    than its freshly started workers, each side until the timeout. With no default group no
    group is alive, so the count starts from 0 again, as in a fresh process."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count") and not dist.is_initialized():
        world.group_count = 0


@contextlib.contextmanager
def _gloo_on_loopback(active: bool):
    """Gloo's sockets over the loopback device while the groups are made (the variable
    ``GLOO_SOCKET_IFNAME``, unless the user set it; restored after), for a group whose
    ranks all run on this host. Without it gloo binds the address the host name resolves
    to, so a start-up hangs or fails where that name is missing, slow to resolve or not
    reachable."""
    names = {name for _, name in socket.if_nameindex()} if active else set()
    loopback = next((name for name in ("lo", "lo0") if name in names), None)
    if loopback is None or os.environ.get("GLOO_SOCKET_IFNAME"):
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = loopback
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def destroy() -> None:
    """Leave the group (tearing down torch.distributed's default group where
    ``init_distributed`` created it); the process is a single rank again."""
    global _TP, _INITIALIZED
    tp = _TP
    _TP, _INITIALIZED = _SINGLE_RANK, False
    if not tp.is_distributed or not dist.is_initialized():
        return
    if tp.owns_process_group:
        dist.destroy_process_group()
    elif tp.cpu_group is not tp.device_group:
        dist.destroy_process_group(tp.cpu_group)


def is_initialized() -> bool:
    """Whether ``init_distributed`` has run (a single rank needs it not)."""
    return _INITIALIZED


def get_tp_group() -> TPGroup:
    return _TP


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size
