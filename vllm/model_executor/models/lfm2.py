"""Lfm2ForCausalLM: LiquidAI's hybrid of gated short-conv and GQA attention layers, each
followed by a SwiGLU MLP.

As transformers' ``modeling_lfm2`` defines it (5.24)::

    h = embed_tokens(ids)
    for each layer:  r = h; h = r + mixer(operator_norm(h))      # mixer: short conv | attention
                     r = h; h = r + feed_forward(ffn_norm(h))
    logits = lm_head(embedding_norm(h))                           # the final norm's HF name

- Short-conv layers are ``ShortConv`` (``layers/mamba/short_conv.py``): in_proj to B | C |
  x, B * x through the causal depthwise conv of width ``conv_L_cache`` without
  activation (the pool keeps its L-1 columns per sequence), times C, out_proj; biases
  ``conv_bias``.
- Attention layers: q/k/v (fused in ``qkv_proj``), an RMSNorm over each head of q and of k
  (``q_layernorm``, ``k_layernorm``), RoPE (neox style, whole head, ``rope_theta``), GQA,
  scale head_dim^-0.5, the paged KV cache through ``Attention``; ``out_proj`` (our
  ``o_proj``). No biases.
- MLP: ``w1`` and ``w3`` fused in ``gate_up_proj``, ``w2`` (our ``down_proj``), width
  ``config.mlp_size()`` (HF's feed-forward adjustment); all norms RMSNorm of ``norm_eps``.
- ``lm_head`` is tied to the embeddings when ``tie_word_embeddings`` (LFM2's default).

Under tensor parallelism the short conv splits its channels, attention its heads (KV
heads replicated when fewer than ranks), the MLP its width; the per-head norms need no
collective (a rank holds whole heads).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.mamba.mamba_utils import ConvBackend
from vllm.model_executor.layers.mamba.short_conv import ShortConv
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.hybrid_base import (
    AttentionProjections,
    GatedMLP,
    MambaHybridForCausalLM,
    residual_norm,
)
from vllm.model_executor.models.lfm2_config import Lfm2ModelConfig

# HF module names that ours rename (checkpoint -> ours), matched as whole name parts.
_RENAMES = (
    (".feed_forward.w2.", ".feed_forward.down_proj."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".conv.conv.", ".conv.conv1d."),
)


class Lfm2Attention(AttentionProjections):
    def __init__(self, config: Lfm2ModelConfig, dtype: torch.dtype, prefix: str):
        super().__init__()
        d = self.head_dim = config.head_dim
        heads, kv_heads = self._init_projections(
            config.attention_shape(), config.hidden_size, False, dtype
        )
        self.q_layernorm = RMSNorm(d, eps=config.norm_eps, dtype=dtype)
        self.k_layernorm = RMSNorm(d, eps=config.norm_eps, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(
            d, d, config.rope_positions, config.rope_theta, is_neox_style=True
        )
        self.attn = Attention(heads, d, d**-0.5, num_kv_heads=kv_heads, prefix=f"{prefix}.attn")

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x)
        # The per-head norms over (tokens * heads, head_dim) rows.
        q = self.q_layernorm(q.reshape(-1, self.head_dim)).view(x.shape[0], -1)
        k = self.k_layernorm(k.reshape(-1, self.head_dim)).view(x.shape[0], -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, config: Lfm2ModelConfig, layer_idx: int, dtype: torch.dtype, prefix: str):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "conv":
            self.conv = ShortConv(
                config.hidden_size, config.conv_L_cache, config.conv_bias, dtype, layer_idx
            )
        else:
            self.self_attn = Lfm2Attention(config, dtype, prefix=f"{prefix}.self_attn")
        self.feed_forward = GatedMLP(config.hidden_size, config.mlp_size(), False, "silu", dtype)
        self.operator_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, dtype=dtype)
        self.ffn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, dtype=dtype)

    def forward(self, hidden, residual, positions):
        normed, residual = residual_norm(self.operator_norm, hidden, residual)
        if self.layer_type == "conv":
            out = self.conv(normed)
        else:
            out = self.self_attn(normed, positions)
        normed, residual = self.ffn_norm(out, residual)
        return self.feed_forward(normed), residual


class Lfm2Model(nn.Module):
    def __init__(self, config: Lfm2ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            Lfm2DecoderLayer(config, i, dtype, prefix=f"model.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.embedding_norm = RMSNorm(config.hidden_size, eps=config.norm_eps, dtype=dtype)

    def forward(self, input_ids, positions):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions)
        return self.embedding_norm(hidden, residual)[0]


class Lfm2ForCausalLM(MambaHybridForCausalLM):
    stacked_params_mapping = (
        *MambaHybridForCausalLM.stacked_params_mapping,
        ("gate_up_proj", "w1", 0),
        ("gate_up_proj", "w3", 1),
    )

    def __init__(self, config: Lfm2ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)
        self._set_model(Lfm2Model(config, dtype))

    def hf_to_param_name(self, name: str) -> str | None:
        name = super().hf_to_param_name(name)
        if name is None:
            return None
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours)
        return name

    def mixers(self) -> list[ShortConv]:
        """The short-conv layers in layer order (pool layer i is ``mixers()[i]``'s)."""
        if "_mixers" not in self.__dict__:  # a plain list: not registered as submodules
            self.__dict__["_mixers"] = [m for m in self.modules() if isinstance(m, ShortConv)]
        return self.__dict__["_mixers"]

    @property
    def conv_backend(self) -> ConvBackend:
        return ConvBackend.TRITON  # the short conv's only backend
