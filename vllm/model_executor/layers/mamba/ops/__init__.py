"""The Mamba ops. The padded-row markers live in ``causal_conv1d_ref`` (one place) and are
exported here too, as upstream exports them beside its attention backends."""

from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import NULL_BLOCK_ID, PAD_SLOT_ID

__all__ = ["NULL_BLOCK_ID", "PAD_SLOT_ID"]
