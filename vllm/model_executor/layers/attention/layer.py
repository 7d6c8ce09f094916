"""Attention: the attention layer of hybrid models, over the engine's paged KV cache.

Per step: the layer writes this step's keys and values into its cache at the metadata's
``slot_mapping`` (``reshape_and_cache``), then computes every query token's attention
over its sequence's cached and new tokens in one ``unified_attention`` launch. The step's
``AttentionMetadata`` comes from the forward context the model runner sets; the cache
tensor is the engine's, bound to ``kv_cache`` after allocation (the layer only describes
it, through ``get_kv_cache_spec``).

Backends: CUDA tensors run the Triton kernels; CPU tensors run the fp32 PyTorch
references, or the Triton kernels under ``TRITON_INTERPRET=1`` (the ops decide, as the
causal-conv1d ops do).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.cache_spec import AttentionSpec
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention.metadata import AttentionMetadata
from vllm.model_executor.layers.attention.ops.reshape_and_cache import reshape_and_cache
from vllm.model_executor.layers.attention.ops.unified_attention import unified_attention


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads (``num_kv_heads`` divides ``num_heads``;
    None: as many as query heads). Projections, rotary embedding and the output
    projection belong to the model; this layer takes projected q, k, v."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        prefix: str = "",
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (
            ("num_heads", num_heads),
            ("head_size", head_size),
            ("num_kv_heads", num_kv_heads),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Attention {prefix!r}: {name} must be an int >= 1, got {value!r}")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"Attention {prefix!r}: num_heads={num_heads} must be a multiple of "
                f"num_kv_heads={num_kv_heads}"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = float(scale)
        self.prefix = prefix
        # (2, num_blocks, block_size, num_kv_heads, head_size), bound by the engine.
        self.kv_cache: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, scale={self.scale:g}"
        )

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> AttentionSpec:
        """What the engine allocates for this layer: blocks of ``block_size`` tokens of K
        and V, shaped (2, num_blocks, block_size, num_kv_heads, head_size)."""
        return AttentionSpec(
            block_size=block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=dtype,
        )

    def _metadata(self) -> AttentionMetadata:
        md = get_forward_context().attn_metadata
        if not isinstance(md, AttentionMetadata):
            raise RuntimeError(
                f"Attention {self.prefix!r}: the forward context carries no AttentionMetadata "
                f"(got {type(md).__name__}); the model runner must build one per step"
            )
        return md

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (T, num_heads * head_size), k and v (T, num_kv_heads * head_size), T the
        step's (padded) token count -> (T, num_heads * head_size) in q's dtype."""
        if self.kv_cache is None:
            raise RuntimeError(
                f"Attention {self.prefix!r}: kv_cache is not bound; the engine assigns the "
                "layer's (2, num_blocks, block_size, num_kv_heads, head_size) tensor after "
                "allocating it"
            )
        md = self._metadata()
        num_tokens = q.shape[0]
        shapes = (
            ("q", q, self.num_heads),
            ("k", k, self.num_kv_heads),
            ("v", v, self.num_kv_heads),
        )
        for name, t, heads in shapes:
            if t.dim() != 2 or t.shape != (num_tokens, heads * self.head_size):
                raise ValueError(
                    f"Attention {self.prefix!r}: {name} must be (num_tokens={num_tokens}, "
                    f"{heads} * {self.head_size}), got {tuple(t.shape)}"
                )
        if md.slot_mapping.shape[0] != num_tokens:
            raise ValueError(
                f"Attention {self.prefix!r}: the step has {md.slot_mapping.shape[0]} (padded) "
                f"tokens in its metadata but q has {num_tokens}"
            )
        q3 = q.unflatten(1, (self.num_heads, self.head_size))
        k3 = k.unflatten(1, (self.num_kv_heads, self.head_size))
        v3 = v.unflatten(1, (self.num_kv_heads, self.head_size))
        reshape_and_cache(k3, v3, self.kv_cache, md.slot_mapping)
        out = torch.empty(
            num_tokens, self.num_heads, self.head_size, dtype=q.dtype, device=q.device
        )
        unified_attention(
            q3,
            self.kv_cache,
            out,
            query_start_loc=md.query_start_loc,
            seq_lens=md.seq_lens,
            block_table=md.block_table,
            scale=self.scale,
            num_decodes=md.num_decodes,
            max_query_len=md.max_query_len,
            max_seq_len=md.max_seq_len,
        )
        return out.flatten(1)
