"""Per-layer cache specs: what a model asks the engine to allocate, and nothing more.

A model describes its caches (``get_cache_specs()`` -> one spec per layer that keeps
state); the engine sizes and allocates them and hands each layer its tensors. This module
imports neither the engine nor the layers, so both sides can use it.

- ``MambaStateSpec``: one slot per running sequence (the conv state and the SSM state of
  one Mamba layer, and with replayed decode its ring of buffered steps); the slot count is
  ``max_num_seqs``.
- ``AttentionSpec``: paged KV blocks of ``block_size`` tokens; the block count is what the
  memory budget allows (``gpu_memory_utilization`` on CUDA) or an explicit override.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class MambaStateSpec:
    """A Mamba layer's slot: conv state ``conv_shape`` (conv_dim, W-1) and SSM state
    ``ssm_shape``, whose shape is the layer's: (nheads, headdim, dstate) for Mamba2,
    (d_inner, dstate) for Mamba1. With ``replay_len`` L > 0 (replayed decode,
    ``use_replayssm``, Mamba2 only) it also holds the ring of L-1 buffered steps (x and B in
    ``replay_dtype``, dt in fp32) and its int8 counters, ``ops/mamba_ssm_replay``'s layout;
    there the conv runs over x | B | C, so the group count follows from the two shapes."""

    conv_shape: tuple[int, ...]  # per slot
    conv_dtype: torch.dtype
    ssm_shape: tuple[int, ...]  # per slot
    ssm_dtype: torch.dtype
    replay_len: int = 0
    replay_dtype: torch.dtype | None = None

    @property
    def replayable(self) -> bool:
        """Whether replayed decode can serve this state: a Mamba2 one (3-D ``ssm_shape``) or
        none at all (a conv-only layer); not Mamba1's (d_inner, dstate)."""
        return 0 in self.ssm_shape or len(self.ssm_shape) == 3

    @property
    def n_groups(self) -> int:
        """The Mamba2 layer's group count (a 3-D ``ssm_shape`` only)."""
        nheads, headdim, dstate = self._mamba2_ssm_shape()
        return (self.conv_shape[0] - nheads * headdim) // (2 * dstate)

    @property
    def ring_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per slot: name -> (shape, dtype) of the replay buffers (none without replay, nor
        for a conv-only state: an SSM shape with no elements)."""
        if not self.replay_len or 0 in self.ssm_shape:
            return {}
        nheads, headdim, dstate = self._mamba2_ssm_shape()
        ring, act = self.replay_len - 1, self.replay_dtype or self.conv_dtype
        return {
            "ring_x": ((nheads, ring, headdim), act),
            "ring_B": ((self.n_groups, ring, dstate), act),
            "ring_dt": ((nheads, ring), torch.float32),
            "count": ((nheads, headdim), torch.int8),
        }

    def _mamba2_ssm_shape(self) -> tuple[int, int, int]:
        if len(self.ssm_shape) != 3:
            raise ValueError(
                f"use_replayssm (replayssm_buffer_len={self.replay_len}) serves Mamba2 layers "
                f"only, whose SSM state is (nheads, headdim, dstate); this layer's is "
                f"{tuple(self.ssm_shape)}: run it with use_replayssm off"
            )
        return self.ssm_shape

    @property
    def ring_bytes_per_slot(self) -> int:
        return sum(_nbytes(shape, dtype) for shape, dtype in self.ring_shapes.values())

    @property
    def bytes_per_slot(self) -> int:
        return (
            _nbytes(self.conv_shape, self.conv_dtype)
            + _nbytes(self.ssm_shape, self.ssm_dtype)
            + self.ring_bytes_per_slot
        )


@dataclass(frozen=True)
class AttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block of this layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * elem
