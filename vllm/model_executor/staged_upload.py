"""One host-to-device copy for a step's host-built tensors.

The model runner gathers what a step sends to the device (input ids, positions, sampled
rows; the Mamba metadata, the conv tile map, the attention metadata) as named host tensors
and hands them to ``StagedUpload.upload`` at once: they are packed into one pinned host
buffer and copied with ONE non-blocking copy into a device buffer kept across steps. The
returned device tensors are views of that buffer, valid until the next ``upload``.

Every field starts 16-byte aligned, as a fresh allocation would, so a kernel taking one is
specialised the same way (Triton keys its compiled variants on 16-byte pointer alignment)
whatever the sizes of the fields before it. Before the host buffer is refilled, the
previous step's copy out of it is waited for (queued a whole step ago, so normally free).
Both buffers only grow (to a power of two), so a steady workload never reallocates.
"""

from __future__ import annotations

import torch

ALIGN_BYTES = 16


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def packed_offsets(nbytes: dict[str, int]) -> tuple[dict[str, int], int]:
    """Each named field's first byte when packed in order, every one 16-byte aligned, and
    the bytes in all: the layout of an upload (and of a CUDA graph's fixed buffers)."""
    offsets, total = {}, 0
    for name, n in nbytes.items():
        offsets[name] = total
        total += _aligned(n)
    return offsets, total


class StagedUpload:
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._host: torch.Tensor | None = None
        self._device: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self.num_grows = 0
        self.num_uploads = 0  # host-to-device copies made (a fast-path test counts them)

    @property
    def capacity(self) -> int:
        return 0 if self._device is None else self._device.numel()

    @property
    def device_buffer(self) -> torch.Tensor | None:
        return self._device

    def _ensure(self, nbytes: int) -> None:
        if nbytes <= self.capacity:
            return
        size = max(4096, 1 << (nbytes - 1).bit_length())
        pin = self.device.type == "cuda"
        self._host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        self._device = torch.empty(size, dtype=torch.uint8, device=self.device)
        self._copied = None
        self.num_grows += 1

    def upload(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Device views (same dtype and shape) of the host tensors ``tensors``, after one
        non-blocking copy. Each must be a contiguous-able CPU tensor."""
        for name, t in tensors.items():
            if t.device.type != "cpu":
                raise ValueError(f"staged tensor {name!r} must be on the CPU, got {t.device}")
        offsets, total = packed_offsets(
            {name: t.numel() * t.element_size() for name, t in tensors.items()}
        )
        self._ensure(max(total, 1))
        if self._copied is not None:
            self._copied.synchronize()
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            dst = self._host[offsets[name] : offsets[name] + nbytes].view(t.dtype)
            dst.copy_(t.reshape(-1))
        if total:
            self._device[:total].copy_(self._host[:total], non_blocking=True)
            self.num_uploads += 1
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return {
            name: self._device[offsets[name] : offsets[name] + t.numel() * t.element_size()]
            .view(t.dtype)
            .view(t.shape)
            for name, t in tensors.items()
        }
