"""Arithmetic of sharding: exact division and even splits along the last dimension."""

from __future__ import annotations

import torch


def divide(numerator: int, denominator: int, what: str | None = None) -> int:
    """``numerator // denominator``, or ValueError when it does not divide exactly.

    ``what`` names the quantity in the message (e.g. ``"num_heads"``), so a user sees which
    size does not shard over ``denominator`` ranks.
    """
    if denominator < 1:
        raise ValueError(f"cannot divide by {denominator}: the rank count must be >= 1")
    if numerator % denominator:
        name = f"{what}={numerator}" if what else str(numerator)
        raise ValueError(f"{name} is not divisible by {denominator}")
    return numerator // denominator


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """``num_partitions`` equal views of ``tensor`` along its last dimension (copies when
    ``contiguous_split_chunks``); ValueError when the dimension does not split evenly."""
    last = tensor.shape[-1]
    size = divide(last, num_partitions, "last dimension")
    chunks = torch.split(tensor, size, dim=-1)
    if contiguous_split_chunks:
        return tuple(c.contiguous() for c in chunks)
    return chunks
