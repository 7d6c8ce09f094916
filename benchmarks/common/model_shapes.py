"""The model shapes the benchmarks run by name, with dummy weights.

Plain data until a config is asked for: ``named_config`` imports vllm (and so torch) only
when called, after a benchmark has set its Triton cache.

``NAMED_CONFIGS`` are Mamba2 shapes (``Mamba2ModelConfig`` fields), ``HYBRID_CONFIGS``
Bamba's; ``ARCH_CONFIGS`` the other architectures, each ``(architecture, preset)`` where
the preset is a dict of the config class's fields or ``"module:NAME"``, a preset dict the
model's config module defines. ``named_config`` builds any of them through the registry's
config class for the architecture. The ``*-cpu`` shapes are the tiny CPU stand-ins of the
full ones (a run on the interpreter in seconds).
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

# tiiuae/falcon-mamba-7b's shape (64 Mamba1 layers, hidden 4096, d_inner 8192, state 16,
# dt rank 256, vocab 65024, untied head), written from its published config.json without
# a download: check it against the hub's file before quoting figures measured on it.
FALCON_MAMBA_7B = dict(
    vocab_size=65024,
    hidden_size=4096,
    num_hidden_layers=64,
    state_size=16,
    expand=2,
    conv_kernel=4,
    time_step_rank=256,
    use_bias=False,
    use_conv_bias=True,
    layer_norm_epsilon=1e-5,
    mixer_rms_eps=1e-6,
    tie_word_embeddings=False,
)

# nvidia's Nemotron-3-Nano-30B-A3B shape (the published config that
# tests/models/test_nemotron_h_moe.py reads: 23 MoE, 23 Mamba2 and 6 attention layers,
# 128 experts of 1856, top-6, shared expert 3712), unchecked against the hub here too.
NEMOTRON_3_NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
NEMOTRON_3_NANO = dict(
    vocab_size=131072,
    hidden_size=2688,
    num_attention_heads=32,
    num_key_value_heads=2,
    head_dim=128,
    intermediate_size=1856,
    mamba_num_heads=64,
    mamba_head_dim=64,
    n_groups=8,
    ssm_state_size=128,
    conv_kernel=4,
    chunk_size=128,
    n_routed_experts=128,
    num_experts_per_tok=6,
    moe_intermediate_size=1856,
    moe_shared_expert_intermediate_size=3712,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)
_PATTERN_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def _nemotron(pattern: str, **fields) -> dict:
    return dict(fields, layer_types=tuple(_PATTERN_KINDS[c] for c in pattern))


ARCH_CONFIGS = {
    "falcon-mamba-7b": ("FalconMambaForCausalLM", FALCON_MAMBA_7B),
    "falcon-mamba-cpu": (
        "FalconMambaForCausalLM",
        dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, state_size=8),
    ),
    "mamba-cpu": (
        "MambaForCausalLM",
        dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, state_size=8),
    ),
    "lfm2-1.2b": ("Lfm2ForCausalLM", "lfm2_config:LFM2_1_2B"),
    "lfm2-cpu": (
        "Lfm2ForCausalLM",
        dict(
            vocab_size=512,
            hidden_size=32,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            full_attn_idxs=(1,),
            max_position_embeddings=256,
            block_multiple_of=16,
        ),
    ),
    "granite-4.0-h-tiny": (
        "GraniteMoeHybridForCausalLM",
        "granitemoehybrid_config:GRANITE_4_0_H_TINY",
    ),
    "granite-4.0-h-cpu": (
        "GraniteMoeHybridForCausalLM",
        dict(
            vocab_size=512,
            hidden_size=32,
            intermediate_size=16,
            shared_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=("mamba", "attention", "mamba"),
            num_local_experts=4,
            num_experts_per_tok=2,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_chunk_size=16,
            max_position_embeddings=256,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0625,
            logits_scaling=6.0,
            position_embedding_type="nope",
            tie_word_embeddings=True,
        ),
    ),
    "nemotron-3-nano": (
        "NemotronHForCausalLM",
        _nemotron(NEMOTRON_3_NANO_PATTERN, **NEMOTRON_3_NANO),
    ),
    "nemotron-3-nano-cpu": (
        "NemotronHForCausalLM",
        _nemotron(
            "ME*EM",
            vocab_size=512,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=48,
            mamba_num_heads=4,
            mamba_head_dim=16,
            n_groups=2,
            ssm_state_size=16,
            chunk_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=32,
            routed_scaling_factor=2.5,
            max_position_embeddings=256,
        ),
    ),
}


def shape_names() -> list[str]:
    """Every shape a benchmark's ``--model`` takes by name."""
    return [*NAMED_CONFIGS, *HYBRID_CONFIGS, *ARCH_CONFIGS]


def named_config(name: str):
    """The config of a named shape: an instance of the registry's config class for its
    architecture (``Mamba2ModelConfig``, ``BambaModelConfig``, ``FalconMambaModelConfig``,
    ``Lfm2ModelConfig``, ``GraniteMoeHybridModelConfig``, ``NemotronHModelConfig``, ...)."""
    import importlib

    from vllm.model_executor.models.registry import config_class

    if name in NAMED_CONFIGS:
        architecture, preset = "Mamba2ForCausalLM", NAMED_CONFIGS[name]
    elif name in HYBRID_CONFIGS:
        shape = HYBRID_CONFIGS[name]
        architecture = "BambaForCausalLM"
        preset = "bamba_config:BAMBA_9B" if shape == "BAMBA_9B" else shape
    elif name in ARCH_CONFIGS:
        architecture, preset = ARCH_CONFIGS[name]
    else:
        raise ValueError(f"unknown model shape {name!r}; the named shapes: {shape_names()}")
    if isinstance(preset, str):
        module, constant = preset.split(":")
        preset = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), constant)
    return config_class(architecture)(**preset)
