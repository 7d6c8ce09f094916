"""GraniteMoeHybridForCausalLM (IBM Granite-4.0-H): Mamba2 and attention layers, each
followed by routed experts beside a shared SwiGLU MLP (the shared MLP alone in the dense
H-Micro).

As transformers' ``modeling_granitemoehybrid`` defines it (5.17 and 5.24 compute the same,
but for the gated norm, below)::

    h = embed_tokens(ids) * embedding_multiplier
    for each layer:  r = h; h = r + residual_multiplier * mixer(input_layernorm(h))
                     r = h; x = post_attention_layernorm(h)
                     h = r + residual_multiplier * (experts(x) + shared_mlp(x))
    logits = lm_head(norm(h)) / logits_scaling

- Mamba2 layers are ``MambaMixer2`` (any conv backend), as Bamba's: in_proj/out_proj
  biases ``mamba_proj_bias``, conv bias ``mamba_conv_bias``, gated-norm epsilon
  ``rms_norm_eps``. The gated norm normalises each of the ``mamba_n_groups`` groups
  separately, as transformers 5.24 does; 5.17 normalises the whole inner width at once.
  The two agree for ``mamba_n_groups == 1`` (every released Granite-4.0-H checkpoint).
  ``time_step_limit`` clamps dt in the decode update too (transformers only in the scan).
- Attention layers: q/k/v/o (``attention_bias``), GQA, softmax scale
  ``attention_multiplier``, RoPE (neox style, the whole head) only when
  ``position_embedding_type`` is "rope"; the paged KV cache through ``Attention``.
- Experts: ``FusedMoE`` (the router's top-k logits, softmax over those k; SiLU-gated
  experts of ``intermediate_size``); the router is a replicated linear without bias. The
  shared MLP (``shared_intermediate_size``) is column- then row-parallel.
- The residual stream is in the model dtype (transformers adds in it too); each block's
  scaled output is added in the next norm (the fused add-norm).

Parameter names are transformers' where they can be: ``model.layers.{i}.mamba.*``,
``shared_mlp.input_linear`` (gate | up, one tensor), ``block_sparse_moe.router.weight``;
the attention's ``self_attn.qkv_proj`` holds the checkpoint's q/k/v projections and
``block_sparse_moe.experts.w13_weight`` / ``w2_weight`` the experts (``FusedMoE``). Both
checkpoint forms load: Granite's files (``block_sparse_moe.input_linear.weight``,
``output_linear.weight``, ``router.layer.weight``) and transformers 5's in-memory names
(``block_sparse_moe.experts.gate_up_proj``, ``experts.down_proj``, ``router.weight``).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.distributed.communication_op import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.activation import get_act_fn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe import FusedMoE, expert_weight_target
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.granitemoehybrid_config import GraniteMoeHybridModelConfig
from vllm.model_executor.models.hybrid_base import (
    AttentionProjections,
    MambaHybridForCausalLM,
    residual_norm,
)

_MOE = "block_sparse_moe."


class GraniteMoeHybridMLP(nn.Module):
    """The shared expert: ``input_linear`` (gate | up, each cut by the ranks), SiLU-and-mul,
    ``output_linear`` (row-parallel). ``reduce_results`` False leaves the all-reduce to
    the caller (the layer sums it with the experts' partial sums first)."""

    def __init__(self, config: GraniteMoeHybridModelConfig, dtype, reduce_results: bool):
        super().__init__()
        h, i = config.hidden_size, config.shared_intermediate_size
        self.input_linear = MergedColumnParallelLinear(h, [i, i], bias=False, dtype=dtype)
        self.output_linear = RowParallelLinear(
            i, h, bias=False, dtype=dtype, reduce_results=reduce_results
        )
        self.act_fn = get_act_fn(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(self.act_fn(gate) * up)


class GraniteMoeHybridMoE(nn.Module):
    """The routed experts: a replicated router (``router.weight``, (E, H)) and a
    ``FusedMoE`` (``experts``)."""

    def __init__(self, config: GraniteMoeHybridModelConfig, dtype, reduce_results: bool):
        super().__init__()
        e, h = config.num_local_experts, config.hidden_size
        self.router = ReplicatedLinear(h, e, bias=False, dtype=dtype)
        self.experts = FusedMoE(
            e,
            config.num_experts_per_tok,
            h,
            config.intermediate_size,
            activation="silu",
            is_act_and_mul=True,
            scoring="softmax",
            renormalize=True,
            reduce_results=reduce_results,
            dtype=dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GraniteMoeHybridAttention(AttentionProjections):
    def __init__(self, config: GraniteMoeHybridModelConfig, dtype, prefix: str):
        super().__init__()
        shape = config.attention_shape()
        d = shape.head_dim
        heads, kv_heads = self._init_projections(
            shape, config.hidden_size, config.attention_bias, dtype
        )
        self.rotary_emb = None
        if config.use_rope:
            self.rotary_emb = RotaryEmbedding(
                d, d, config.rope_positions, config.rope_theta, is_neox_style=True
            )
        self.attn = Attention(
            heads,
            d,
            config.attention_multiplier,
            num_kv_heads=kv_heads,
            prefix=f"{prefix}.attn",
        )

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self._qkv(x)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class GraniteMoeHybridDecoderLayer(nn.Module):
    def __init__(self, config: GraniteMoeHybridModelConfig, layer_idx: int, dtype, prefix: str):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.residual_multiplier = config.residual_multiplier
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps=eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(h, eps=eps, dtype=dtype)
        if self.layer_type == "mamba":
            self.mamba = MambaMixer2(config.mamba_shape(), dtype=dtype, layer_idx=layer_idx)
        else:
            self.self_attn = GraniteMoeHybridAttention(config, dtype, f"{prefix}.self_attn")
        # With experts, the experts' and the shared MLP's partial sums are added on each
        # rank and all-reduced once (below); the dense model's MLP reduces its own.
        self.block_sparse_moe = None
        if config.has_experts:
            self.block_sparse_moe = GraniteMoeHybridMoE(config, dtype, reduce_results=False)
        self.shared_mlp = GraniteMoeHybridMLP(config, dtype, reduce_results=not config.has_experts)

    def forward(self, hidden, residual, positions):
        normed, residual = residual_norm(self.input_layernorm, hidden, residual)
        if self.layer_type == "mamba":
            out = self.mamba(normed)
        else:
            out = self.self_attn(normed, positions)
        normed, residual = self.post_attention_layernorm(out * self.residual_multiplier, residual)
        out = self.shared_mlp(normed)
        if self.block_sparse_moe is not None:
            # one all-reduce of the sum (neither part reduces; a no-op on one rank)
            out = tensor_model_parallel_all_reduce(out + self.block_sparse_moe(normed))
        return out * self.residual_multiplier, residual


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, config: GraniteMoeHybridModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embedding_multiplier = config.embedding_multiplier
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            GraniteMoeHybridDecoderLayer(config, i, dtype, prefix=f"model.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids, positions):
        hidden, residual = self.embed_tokens(input_ids) * self.embedding_multiplier, None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions)
        return self.norm(hidden, residual)[0]


class GraniteMoeHybridForCausalLM(MambaHybridForCausalLM):
    def __init__(self, config: GraniteMoeHybridModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)
        self._set_model(GraniteMoeHybridModel(config, dtype))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits divided by ``logits_scaling`` (rank 0's; None on the others)."""
        logits = super().compute_logits(hidden_states)
        if logits is None or self.config.logits_scaling == 1.0:
            return logits
        return logits / self.config.logits_scaling

    def hf_to_param_name(self, name: str):
        name = super().hf_to_param_name(name)
        if name is None or _MOE not in name:
            return name
        layer, _, tail = name.partition(_MOE)
        if tail in ("router.layer.weight", "router.weight"):
            return f"{layer}{_MOE}router.weight"
        target = expert_weight_target(tail)
        if target is None:
            return name  # our own names (dummy weights), or unknown: the loader says so
        param, shard_id = target
        return f"{layer}{_MOE}experts.{param}", shard_id
