"""NemotronHForCausalLM: Mamba2, attention and MLP blocks in the pattern the config names.

As transformers' ``modeling_nemotron_h`` defines it (5.17 and 5.24 compute the same for the
dense models served here)::

    h = embeddings(ids)
    for each layer:  h = h + mixer(norm(h))    # mixer: Mamba2 ("M") | attention ("*") | MLP ("-")
    logits = lm_head(norm_f(h))

- Mamba2 blocks are ``MambaMixer2`` (any conv backend): heads ``mamba_num_heads`` of
  ``mamba_head_dim``, ``n_groups`` groups normalised separately in the gated norm (both
  releases), projection biases ``use_bias``, epsilon ``layer_norm_epsilon``. dt is floored
  at ``time_step_min`` (transformers' mixer takes (time_step_min, inf) whatever
  ``time_step_limit`` says); here the floor also applies in the decode update, where
  transformers' recurrent step applies none: the two differ only for dt below the floor.
- Attention blocks: q/k/v/o without bias (transformers ignores ``attention_bias``), no
  positional encoding at all (NemotronH's attention has no RoPE), GQA, scale
  head_dim^-0.5, the paged KV cache through ``Attention``.
- MLP blocks: up_proj, relu2 (squared ReLU), down_proj.
- MoE blocks ("E") are refused by the config.
- The lm head is never tied to the embeddings (transformers ties none for NemotronH).
- The residual stream is in the model dtype (``residual_in_fp32`` is unused, as in
  transformers); the adds are fused into the next norm.

Parameter names are transformers' (``model.layers.{i}.mixer.in_proj.weight``, ...), but
for the attention's ``qkv_proj``, which holds the checkpoint's q/k/v projections; the
original NVIDIA checkpoints' ``backbone.`` prefix is read as ``model.``, and their
multi-token-prediction weights (``mtp.*``) are skipped, as transformers skips them.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.activation import get_act_fn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.hybrid_base import (
    AttentionProjections,
    MambaHybridForCausalLM,
    residual_norm,
)
from vllm.model_executor.models.nemotron_h_config import NemotronHModelConfig


class NemotronHMLP(nn.Module):
    """up, relu2, down: up a ``ColumnParallelLinear`` (this rank's intermediate block),
    down a ``RowParallelLinear`` (one all-reduce)."""

    def __init__(self, config: NemotronHModelConfig, dtype: torch.dtype):
        super().__init__()
        h, i, bias = config.hidden_size, config.mlp_size(), config.mlp_bias
        self.up_proj = ColumnParallelLinear(h, i, bias=bias, dtype=dtype)
        self.down_proj = RowParallelLinear(i, h, bias=bias, dtype=dtype)
        self.act_fn = get_act_fn(config.mlp_hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class NemotronHAttention(AttentionProjections):
    def __init__(self, config: NemotronHModelConfig, dtype: torch.dtype, prefix: str):
        super().__init__()
        shape = config.attention_shape()
        d = shape.head_dim
        heads, kv_heads = self._init_projections(shape, config.hidden_size, False, dtype)
        self.attn = Attention(heads, d, d**-0.5, num_kv_heads=kv_heads, prefix=f"{prefix}.attn")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn(*self._qkv(x)))


class NemotronHBlock(nn.Module):
    def __init__(
        self, config: NemotronHModelConfig, layer_idx: int, dtype: torch.dtype, prefix: str
    ):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon, dtype=dtype)
        if self.layer_type == "mamba":
            self.mixer = MambaMixer2(config.mamba_shape(), dtype=dtype, layer_idx=layer_idx)
        elif self.layer_type == "attention":
            self.mixer = NemotronHAttention(config, dtype, prefix=f"{prefix}.mixer")
        else:
            self.mixer = NemotronHMLP(config, dtype)

    def forward(self, hidden, residual):
        normed, residual = residual_norm(self.norm, hidden, residual)
        return self.mixer(normed), residual


class NemotronHModel(nn.Module):
    def __init__(self, config: NemotronHModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            NemotronHBlock(config, i, dtype, prefix=f"model.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon, dtype=dtype)

    def forward(self, input_ids):
        hidden, residual = self.embeddings(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        return self.norm_f(hidden, residual)[0]


class NemotronHForCausalLM(MambaHybridForCausalLM):
    def __init__(self, config: NemotronHModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)
        self.model = NemotronHModel(config, dtype)
        self.lm_head = self._lm_head()  # never tied

    def _run(self, input_ids, positions):
        return self.model(input_ids)

    def hf_to_param_name(self, name: str) -> str | None:
        if name.startswith("mtp."):
            return None
        if name.startswith("backbone."):
            return "model." + name.removeprefix("backbone.")
        return name
