"""BambaForCausalLM: Mamba2 and attention layers, each followed by a SwiGLU MLP.

As transformers' ``modeling_bamba`` defines it (5.17 and 5.24 compute the same, but for
the gated norm, below)::

    h = embed_tokens(ids)
    for each layer:  r = h; h = r + mixer(input_layernorm(h))       # mixer: Mamba2 | attention
                     r = h; h = r + feed_forward(pre_ff_layernorm(h))
    logits = lm_head(final_layernorm(h))

- Mamba2 layers are ``MambaMixer2`` (any conv backend); in_proj/out_proj biases are
  ``mamba_proj_bias``, the conv bias ``mamba_conv_bias``, the gated norm's epsilon
  ``rms_norm_eps``. The gated norm normalises each of the ``mamba_n_groups`` groups
  separately, as transformers 5.24 does (``BambaRMSNormGated(group_size=...)``) and as the
  Mamba2 reference does; transformers 5.17 normalises the whole inner width at once. The
  two agree for ``mamba_n_groups == 1`` (every released Bamba checkpoint).
- ``time_step_limit`` clamps dt in the decode update as in the chunked scan; transformers
  clamps in the chunked scan only. They differ only outside the limit (never with the
  default (0, inf)).
- Attention layers: q/k/v/o projections (``attention_bias``), RoPE (neox style) on the
  first ``partial_rotary_factor`` of each head, GQA, scale head_dim^-0.5, the paged KV
  cache through ``Attention``.
- The residual stream is in the model dtype (transformers adds in it too); the adds are
  fused into the next norm.

Parameter names are transformers' (``model.layers.{i}.mamba.in_proj.weight``, ...), but
for two fused layers: ``self_attn.qkv_proj`` holds the checkpoint's q/k/v projections and
``feed_forward.gate_up_proj`` its gate and up (``stacked_params_mapping``); the conv
weight is stored as (dim, width).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.bamba_config import BambaModelConfig
from vllm.model_executor.models.hybrid_base import (
    GatedMLP,
    MambaHybridForCausalLM,
    RotaryAttention,
    residual_norm,
)


class BambaDecoderLayer(nn.Module):
    def __init__(self, config: BambaModelConfig, layer_idx: int, dtype: torch.dtype, prefix: str):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        eps = config.rms_norm_eps
        if self.layer_type == "mamba":
            self.mamba = MambaMixer2(config.mamba_shape(), dtype=dtype, layer_idx=layer_idx)
        else:
            self.self_attn = RotaryAttention(config, dtype, prefix=f"{prefix}.self_attn")
        self.feed_forward = GatedMLP(
            config.hidden_size, config.mlp_size(), config.mlp_bias, config.hidden_act, dtype
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)

    def forward(self, hidden, residual, positions):
        normed, residual = residual_norm(self.input_layernorm, hidden, residual)
        if self.layer_type == "mamba":
            out = self.mamba(normed)
        else:
            out = self.self_attn(normed, positions)
        normed, residual = self.pre_ff_layernorm(out, residual)
        return self.feed_forward(normed), residual


class BambaModel(nn.Module):
    def __init__(self, config: BambaModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            BambaDecoderLayer(config, i, dtype, prefix=f"model.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids, positions):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions)
        return self.final_layernorm(hidden, residual)[0]


class BambaForCausalLM(MambaHybridForCausalLM):
    stacked_params_mapping = (
        *MambaHybridForCausalLM.stacked_params_mapping,
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: BambaModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)
        self._set_model(BambaModel(config, dtype))
