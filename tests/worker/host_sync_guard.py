"""``no_host_sync()``: a context in which any op that would read device data back to the host
on CUDA raises (``HostSyncError``), so a CPU test can show that what a CUDA graph captures
makes no such read. On CUDA such a read fails the capture or, worse, freezes the value of
the capture's step into every replay.

Caught: ``.item()``, ``int()``, ``float()``, ``bool()`` / ``if tensor:`` (aten's
``_local_scalar_dense``), ``.tolist()``, ``.cpu()``, ``torch.nonzero`` / ``argwhere``,
``masked_select``, ``torch.unique`` (all forms), ``repeat_interleave`` without
``output_size``, and indexing by a boolean mask (``x[mask]``, ``x[mask] = v``), whose
output sizes depend on device data.

Reads that run on CPU tensors only (argument checks behind ``device.type == "cpu"``, which
cost nothing there and never run on CUDA) and the Triton interpreter's own work are
allowed: ``CPU_ONLY`` names them by (file, function). Keep it short, and add a function
only after reading that its data reads are behind such a guard.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# (file name, function) whose data reads run on CPU tensors only.
CPU_ONLY = {
    # Mamba1's scan and update checks read index data behind ``device.type == "cpu"``.
    ("selective_scan_host.py", "check_scan_args"),
    ("selective_scan_host.py", "check_update_args"),
}

_SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.argwhere.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
}
_MASK_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


class HostSyncError(AssertionError):
    pass


def _allowed() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if "triton" in path.parts:  # the interpreter (CPU) runs the kernels
            return True
        if (path.name, frame.f_code.co_name) in CPU_ONLY:
            return True
        frame = frame.f_back
    return False


def _where() -> str:
    """The innermost frame of the engine's code (file:line), for the message."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if "vllm" in path.parts:
            return f"{'/'.join(path.parts[path.parts.index('vllm') :])}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _why(func, args, kwargs) -> str | None:
    if func in _SYNC_OPS:
        return str(func)
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
        if kwargs.get("output_size") is None:
            return f"{func} without output_size"
    if func in _MASK_INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return f"{func} with a boolean mask"
    return None


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = _why(func, args, kwargs)
        if why is not None and not _allowed():
            raise HostSyncError(f"a host sync inside the captured region: {why} at {_where()}")
        return func(*args, **kwargs)


def _guard(name: str, method):
    def guarded(self, *args, **kwargs):
        if not _allowed():
            raise HostSyncError(
                f"a host sync inside the captured region: Tensor.{name} at {_where()}"
            )
        return method(self, *args, **kwargs)

    return guarded


@contextlib.contextmanager
def no_host_sync():
    """Raise ``HostSyncError`` on a host sync (module docstring) inside the block."""
    saved = {n: getattr(torch.Tensor, n) for n in ("tolist", "cpu")}
    try:
        for name, method in saved.items():
            setattr(torch.Tensor, name, _guard(name, method))
        with _Mode():
            yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
