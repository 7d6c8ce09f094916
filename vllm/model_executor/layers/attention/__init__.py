"""Attention for hybrid models: the layer, its per-step metadata, and (in ``ops``) the
Triton unified-attention and KV-cache-write kernels with their PyTorch references."""

from vllm.model_executor.layers.attention.layer import Attention
from vllm.model_executor.layers.attention.metadata import (
    AttentionMetadata,
    AttentionMetadataBuilder,
)

__all__ = ["Attention", "AttentionMetadata", "AttentionMetadataBuilder"]
