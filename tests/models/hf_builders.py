"""Tiny random Hugging Face hybrids (transformers' own Bamba, NemotronH and Zamba2), seeded
and perturbed (``hybrid_utils.perturb``) so that no weight is at its initial value: the
oracles of the model tests, and the checkpoints of the tensor-parallel tests."""

from __future__ import annotations

import torch

from tests.models.hybrid_utils import VOCAB, hf_norms_per_group, perturb

NEMOTRON_H_PATTERN = "M*-M-*"  # Mamba2, attention, MLP, Mamba2, MLP, attention
ZAMBA2_LAYERS = ["mamba", "hybrid", "mamba", "hybrid", "hybrid"]  # 3 uses of 2 shared blocks


def bamba_hf_config(**overrides):
    from transformers import BambaConfig
    from transformers.models.bamba.modeling_bamba import BambaRMSNormGated

    shape = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        attn_layer_indices=[1, 3],
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        mamba_n_heads=4,
        mamba_d_head=16,
        # two groups where this transformers normalises per group, as we do (5.24); one
        # where it normalises the whole inner width (5.17): no oracle for more
        mamba_n_groups=2 if hf_norms_per_group(BambaRMSNormGated) else 1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_chunk_size=8,
        max_position_embeddings=128,
    )
    return BambaConfig(**{**shape, **overrides})


def make_bamba_hf(seed: int = 0, **overrides):
    from transformers import BambaForCausalLM as HFBamba

    torch.manual_seed(seed)
    return perturb(HFBamba(bamba_hf_config(**overrides)), seed)


def make_nemotron_h_hf(seed: int = 0, pattern: str = NEMOTRON_H_PATTERN, **overrides):
    from transformers import NemotronHConfig
    from transformers import NemotronHForCausalLM as HFNemotronH

    shape = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        hybrid_override_pattern=pattern,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        head_dim=8,
        intermediate_size=48,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    return perturb(HFNemotronH(NemotronHConfig(**{**shape, **overrides})), seed)


def make_zamba2_hf(seed: int = 0, **overrides):
    from transformers import Zamba2Config
    from transformers import Zamba2ForCausalLM as HFZamba2

    shape = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=len(ZAMBA2_LAYERS),
        layers_block_type=ZAMBA2_LAYERS,
        num_attention_heads=4,
        n_mamba_heads=4,
        mamba_d_state=8,
        mamba_ngroups=2,
        num_mem_blocks=2,
        use_shared_attention_adapter=True,
        adapter_rank=4,
        use_mem_rope=True,
        chunk_size=8,
        intermediate_size=48,
        max_position_embeddings=128,
    )
    torch.manual_seed(seed)
    return perturb(HFZamba2(Zamba2Config(**{**shape, **overrides})), seed)
