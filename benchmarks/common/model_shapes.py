"""The model shapes the benchmarks run by name, with dummy weights.

Plain data until a config is asked for: ``named_config`` imports vllm (and so torch) only
when called, after a benchmark has set its Triton cache.
"""

from __future__ import annotations

NAMED_CONFIGS = {
    # Mamba-Codestral-7B's shape: Mamba2ModelConfig's defaults.
    "codestral-7b": {},
    # Small enough for a CPU run in seconds.
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_heads=8,
        head_dim=16,
        state_size=16,
        n_groups=1,
        chunk_size=16,
    ),
}


# Hybrid shapes (Bamba: Mamba2 + attention layers with a paged KV cache), by name. The
# string names the preset in vllm's bamba_config, read when the run starts (importing vllm
# loads torch, which must come after the Triton cache is set).
HYBRID_CONFIGS = {
    "bamba-9b": "BAMBA_9B",
    "bamba-tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        attn_layer_indices=(1,),
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_chunk_size=16,
        max_position_embeddings=4096,
    ),
}


def named_config(name: str):
    """The config of a named shape (a ``Mamba2ModelConfig`` or ``BambaModelConfig``)."""
    if name in NAMED_CONFIGS:
        from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

        return Mamba2ModelConfig(**NAMED_CONFIGS[name])
    from vllm.model_executor.models.bamba_config import BAMBA_9B, BambaModelConfig

    shape = HYBRID_CONFIGS[name]
    return BambaModelConfig(**(BAMBA_9B if shape == "BAMBA_9B" else shape))
