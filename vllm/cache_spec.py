"""Per-layer cache specs: what a model asks the engine to allocate, and nothing more.

A model describes its caches (``get_cache_specs()`` -> one spec per layer that keeps
state); the engine sizes and allocates them and hands each layer its tensors. This module
imports neither the engine nor the layers, so both sides can use it.

- ``MambaStateSpec``: one slot per running sequence (the conv state and the SSM state of
  one Mamba layer); the slot count is ``max_num_seqs``.
- ``AttentionSpec``: paged KV blocks of ``block_size`` tokens; the block count is what the
  memory budget allows (``gpu_memory_utilization`` on CUDA) or an explicit override.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MambaStateSpec:
    conv_shape: tuple[int, ...]  # per slot
    conv_dtype: torch.dtype
    ssm_shape: tuple[int, ...]  # per slot
    ssm_dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        def nbytes(shape, dtype):
            n = 1
            for s in shape:
                n *= s
            return n * torch.empty((), dtype=dtype).element_size()

        return nbytes(self.conv_shape, self.conv_dtype) + nbytes(self.ssm_shape, self.ssm_dtype)


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
