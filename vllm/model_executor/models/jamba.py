"""JambaForCausalLM: Mamba1 and attention layers, each followed by a dense SwiGLU MLP or a
mixture of experts.

As transformers' ``modeling_jamba`` defines it (5.17 and 5.24 compute the same; 5.24 makes
the router a module of its own, ``JambaTopKRouter``, with the same ``router.weight``)::

    h = embed_tokens(ids)
    for each layer:  r = h; h = r + mixer(input_layernorm(h))           # Mamba1 | attention
                     r = h; h = r + feed_forward(pre_ff_layernorm(h))   # MLP | experts
    logits = lm_head(final_layernorm(h))

- Mamba layers are ``MambaMixer`` (Mamba1, any conv backend) with Jamba's RMS norms on dt,
  B and C: weighted (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``), epsilon
  ``rms_norm_eps``; d_inner ``mamba_expand * hidden_size``, state ``mamba_d_state``, dt
  rank ``mamba_dt_rank``, projection biases ``mamba_proj_bias``, conv bias
  ``mamba_conv_bias``.
- Attention layers: q/k/v/o without bias, no positional encoding (Jamba's attention has no
  RoPE), GQA, scale head_dim^-0.5, the paged KV cache through ``Attention``.
- Feed-forward: a SwiGLU MLP (gate, up, down), or, on the expert layers, a router
  (``router.weight``, logits in the model dtype) and ``FusedMoE``: softmax over all
  experts in fp32, top ``num_experts_per_tok``, the chosen weights not renormalised.
- The residual stream is in the model dtype (transformers adds in it too); the adds are
  fused into the next norm.

Parameter names are transformers' (``model.layers.{i}.mamba.in_proj.weight``, ...), but
for the fused layers: ``self_attn.qkv_proj`` holds q/k/v, ``feed_forward.gate_up_proj``
the MLP's gate and up (``stacked_params_mapping``), and ``feed_forward.experts`` holds the
experts stacked (``w13_weight``, ``w2_weight``), loaded from the files' per-expert
tensors (``experts.<e>.gate_proj.weight``, ...) or transformers' stacked ones
(``experts.gate_up_proj``, ``experts.down_proj``); the conv weight is stored as
(dim, width).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe import FusedMoE, expert_weight_target
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ReplicatedLinear,
)
from vllm.model_executor.layers.mamba.mamba2_metadata import Mamba2MetadataBuilder
from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.hybrid_base import (
    AttentionProjections,
    GatedMLP,
    MambaHybridForCausalLM,
    residual_norm,
)
from vllm.model_executor.models.jamba_config import JambaModelConfig

_EXPERTS = ".feed_forward.experts."


class JambaMoE(nn.Module):
    """The router (replicated) and the experts (``FusedMoE``, sharded by intermediate
    features, all-reduced)."""

    def __init__(self, config: JambaModelConfig, dtype: torch.dtype):
        super().__init__()
        h = config.hidden_size
        self.router = ReplicatedLinear(h, config.num_experts, bias=False, dtype=dtype)
        self.experts = FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            h,
            config.mlp_size(),
            scoring="softmax",
            renormalize=False,
            dtype=dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class JambaAttention(AttentionProjections):
    def __init__(self, config: JambaModelConfig, dtype: torch.dtype, prefix: str):
        super().__init__()
        shape = config.attention_shape()
        d = shape.head_dim
        heads, kv_heads = self._init_projections(shape, config.hidden_size, False, dtype)
        self.attn = Attention(heads, d, d**-0.5, num_kv_heads=kv_heads, prefix=f"{prefix}.attn")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attn(*self._qkv(x)))


class JambaDecoderLayer(nn.Module):
    def __init__(self, config: JambaModelConfig, layer_idx: int, dtype: torch.dtype, prefix: str):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "mamba":
            self.mamba = MambaMixer(config.mamba1_shape(), dtype=dtype, layer_idx=layer_idx)
        else:
            self.self_attn = JambaAttention(config, dtype, prefix=f"{prefix}.self_attn")
        moe = config.moe_layers[layer_idx]
        self.feed_forward = (
            JambaMoE(config, dtype)
            if moe
            else GatedMLP(config.hidden_size, config.mlp_size(), False, config.hidden_act, dtype)
        )
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)

    def forward(self, hidden, residual):
        normed, residual = residual_norm(self.input_layernorm, hidden, residual)
        if self.layer_type == "mamba":
            out = self.mamba(normed)
        else:
            out = self.self_attn(normed)
        normed, residual = self.pre_ff_layernorm(out, residual)
        return self.feed_forward(normed), residual


class JambaModel(nn.Module):
    def __init__(self, config: JambaModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            JambaDecoderLayer(config, i, dtype, prefix=f"model.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        return self.final_layernorm(hidden, residual)[0]


class JambaForCausalLM(MambaHybridForCausalLM):
    stacked_params_mapping = (
        *MambaHybridForCausalLM.stacked_params_mapping,
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: JambaModelConfig, dtype: torch.dtype = torch.float32):
        if not isinstance(config, JambaModelConfig):
            raise TypeError(
                f"JambaForCausalLM needs a JambaModelConfig, got {type(config).__name__}"
            )
        super().__init__(config, dtype)
        self._set_model(JambaModel(config, dtype))

    def _run(self, input_ids, positions):
        return self.model(input_ids)  # no RoPE: positions only place the KV (metadata)

    def mixers(self) -> list[MambaMixer]:
        """The Mamba1 mixers in layer order (pool layer i is ``mixers()[i]``'s)."""
        if "_mixers" not in self.__dict__:  # a plain list: not registered as submodules
            self.__dict__["_mixers"] = [m for m in self.modules() if isinstance(m, MambaMixer)]
        return self.__dict__["_mixers"]

    def metadata_builder(self, device: torch.device | str | None = None) -> Mamba2MetadataBuilder:
        """The step metadata's builder, without chunk layout (Mamba1 scans unchunked)."""
        if device is None:
            device = self.head_weight().device
        return Mamba2MetadataBuilder(None, device)

    def hf_to_param_name(self, name: str) -> str | tuple[str, object] | None:
        """Our parameter (and shard id, for an expert's tensor) for a checkpoint name."""
        if _EXPERTS in name:
            target = expert_weight_target(name)
            if target is not None:  # per-expert or stacked expert tensors
                param, shard_id = target
                head = name[: name.index(_EXPERTS) + len(_EXPERTS)]
                return head + param, shard_id
        return super().hf_to_param_name(name)
