"""Read device tensors on the host without waiting for the work queued after them.

``tensor.tolist()`` on a CUDA tensor waits for everything queued on its stream. Under async
scheduling step N+1 is queued before step N's tokens are read, so such a read also waits for
step N+1, and the host's work between steps (applying the tokens, scheduling and preparing
step N+2) then runs while the GPU has nothing queued. ``HostCopy`` queues copies into pinned
host memory right behind the tensors' producers and records an event; ``get()`` waits for
that event only, so step N+1 keeps the GPU busy while the host works.

``DeviceSpan`` times a step's device work the same way, with two CUDA timing events: read
once the step's host copy (queued after its end) is done, it needs no sync of its own.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class HostCopy:
    """Host copies of ``tensors``, in order. CUDA tensors are copied asynchronously into
    pinned buffers behind the work queued so far on the current stream; others are kept as
    they are. ``get()`` returns the host tensors once their copies are done."""

    def __init__(self, tensors: Iterable[torch.Tensor]):
        tensors = tuple(tensors)
        self._event: torch.cuda.Event | None = None
        if any(t.is_cuda for t in tensors):
            host = []
            for t in tensors:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                host.append(h)
            self._event = torch.cuda.Event()
            self._event.record()
            tensors = tuple(host)
        self._tensors = tensors

    @property
    def pending(self) -> bool:
        """Whether a copy is queued that ``get()`` has not waited for yet."""
        return self._event is not None

    def get(self) -> tuple[torch.Tensor, ...]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._tensors


class DeviceSpan:
    """A span of the current stream's work: ``DeviceSpan.open(device)`` records its start
    (None off CUDA), ``close()`` its end; ``seconds()`` once the end is done (the GPU
    reaching the start, everything queued before it done, to the end)."""

    def __init__(self):
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()
        self._end: torch.cuda.Event | None = None

    @classmethod
    def open(cls, device: torch.device) -> DeviceSpan | None:
        return cls() if device.type == "cuda" else None

    def close(self) -> DeviceSpan:
        self._end = torch.cuda.Event(enable_timing=True)
        self._end.record()
        return self

    def seconds(self) -> float:
        if self._end is None:
            raise RuntimeError("DeviceSpan.seconds() before close()")
        return self._start.elapsed_time(self._end) / 1e3
