"""Small helpers of the worker's step path."""

from __future__ import annotations

import torch


def async_tensor_h2d(values: list, device: torch.device, dtype=None) -> torch.Tensor:
    """A small host list on ``device`` without a host sync (``torch.tensor(..., device=cuda)``
    waits for the stream's queued work, which would stall async scheduling)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
