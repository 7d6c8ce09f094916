"""Tiny random Falcon-H1 checkpoints from transformers' own ``FalconH1ForCausalLM`` (seeded
and perturbed: no weight at its initial value, every muP multiplier away from 1 and the
five in_proj slice multipliers all different), and the check that our model holds HF's
weights with the multipliers folded in."""

from __future__ import annotations

import torch

from tests.models.hybrid_utils import VOCAB, hf_params_as_ours, perturb

# Every multiplier distinct and away from 1: a dropped or swapped one changes the logits.
MULTIPLIERS = dict(
    embedding_multiplier=1.7,
    lm_head_multiplier=0.6,
    key_multiplier=0.8,
    attention_in_multiplier=1.3,
    attention_out_multiplier=0.7,
    ssm_in_multiplier=1.2,
    ssm_out_multiplier=0.9,
    ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 2.0],
    mlp_multipliers=[1.1, 0.8],
)


def falcon_h1_hf_config(**overrides):
    from transformers import FalconH1Config

    shape = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        mamba_d_ssm=48,  # not expand * hidden (64)
        mamba_n_heads=4,
        mamba_d_head="auto",  # 12
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_chunk_size=8,
        mamba_rms_norm=True,
        mamba_norm_before_gate=True,
        mamba_proj_bias=True,
        projectors_bias=False,
        attention_bias=True,
        mlp_bias=True,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        **MULTIPLIERS,
    )
    return FalconH1Config(**{**shape, **overrides})


def make_falcon_h1_hf(seed: int = 0, **overrides):
    from transformers import FalconH1ForCausalLM as HFFalconH1

    torch.manual_seed(seed)
    return perturb(HFFalconH1(falcon_h1_hf_config(**overrides)), seed)


def _factors(cfg) -> dict[str, tuple[list[float], list[float]]]:
    """(weight factors, bias factors) per part of each layer's scaled linear layers."""
    s, a, k = cfg.ssm_multipliers, cfg.attention_in_multiplier, cfg.key_multiplier
    gate, down = cfg.mlp_multipliers
    out = cfg.ssm_out_multiplier
    return {
        "mamba.in_proj": ([m * cfg.ssm_in_multiplier for m in s], list(s)),
        "mamba.out_proj": ([out], [out]),
        "self_attn.qkv_proj": ([a, a * k, a], [1.0, k, 1.0]),
        "self_attn.o_proj": ([cfg.attention_out_multiplier],) * 2,
        "feed_forward.gate_up_proj": ([gate, 1.0], [gate, 1.0]),
        "feed_forward.down_proj": ([down], [down]),
    }


@torch.no_grad()
def assert_falcon_h1_loaded_as_hf(model, hf) -> None:
    """Every parameter of our one-rank ``model`` holds HF's weight, those of the scaled
    linear layers times their muP factors per part (the same fp32 products, so equal)."""
    ours = dict(model.named_parameters())
    theirs = hf_params_as_ours(model, hf)
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    factors = _factors(model.config)
    for name, expected in theirs.items():
        module, _, leaf = name.rpartition(".")
        key = module.split(".", 3)[-1]  # model.layers.{i}.<key>
        if key in factors and name.startswith("model.layers."):
            layer = model.get_submodule(module)
            sizes = getattr(layer, "local_sizes", [expected.shape[0]])
            fs = factors[key][0 if leaf == "weight" else 1]
            parts = expected.split(list(sizes))
            expected = torch.cat([p * f if f != 1.0 else p for p, f in zip(parts, fs, strict=True)])
        assert torch.equal(ours[name], expected), name
