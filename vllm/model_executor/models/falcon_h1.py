"""FalconH1ForCausalLM (TII's Falcon-H1): every layer runs attention and a Mamba2 mixer
side by side on the same normed input (a parallel hybrid), then a SwiGLU MLP.

As transformers 5.24's ``modeling_falcon_h1`` defines it (m: the muP multipliers of
``FalconH1ModelConfig``)::

    h = embed_tokens(ids) * m.embedding
    for each layer:  r = h; x = input_layernorm(h)
                     h = r + m.ssm_out * mixer(x) + m.attn_out * attention(m.attn_in * x)
                     r = h; h = r + feed_forward(pre_ff_layernorm(h))
    logits = lm_head(final_layernorm(h)) * m.lm_head

- The mixer is ``MambaMixer2`` (any conv backend). Its input is scaled by
  ``ssm_in_multiplier`` and its in_proj output slices z | x | B | C | dt by the five
  ``ssm_multipliers``: both are folded into the in_proj rows once the weights are loaded
  (``load_weights``; the bias rows take the slice multipliers only). The gate: without
  ``mamba_rms_norm`` y * silu(z) (``GateOnly`` in the mixer's ``norm`` place); with it a
  grouped RMS norm of y * silu(z) (the mixer's own) or, with ``mamba_norm_before_gate``,
  norm(y) * silu(z) (``NormThenGate``). The out_proj bias is ``projectors_bias``.
  ``time_step_limit`` clamps dt in the decode update too (transformers only in the scan).
- Attention: q/k/v/o (``attention_bias``), GQA, RoPE (neox style, the whole head), scale
  head_dim^-0.5, the paged KV cache through ``Attention``. ``attention_in_multiplier``
  (q, k, v weights), ``key_multiplier`` (k rows and bias) and ``attention_out_multiplier``
  (o_proj) are folded into the weights as well, and so are ``mlp_multipliers`` (gate rows,
  down_proj) and ``ssm_out_multiplier`` (the mixer's out_proj); the embedding and head
  multipliers are applied to activations (the two tables may be one tied tensor).
- The residual stream is in the model dtype; the adds are fused into the next norm.

Parameter names are transformers' (``model.layers.{i}.mamba.in_proj.weight``, ...), but
for two fused layers: ``self_attn.qkv_proj`` holds q/k/v and ``feed_forward.gate_up_proj``
gate and up (``stacked_params_mapping``); the conv weight is stored as (dim, width).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed.communication_op import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    RowParallelLinear,
    RowShards,
)
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_tp import Mixer2RMSNormGated, mamba2_layout
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.falcon_h1_config import FalconH1ModelConfig
from vllm.model_executor.models.hybrid_base import (
    GatedMLP,
    MambaHybridForCausalLM,
    RotaryAttention,
    residual_norm,
)


class GateOnly(nn.Module):
    """The mixer's output gate without a norm (``mamba_rms_norm`` false): y * silu(z)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return x * F.silu(gate)


class NormThenGate(Mixer2RMSNormGated):
    """The grouped RMS norm before the gate (``mamba_norm_before_gate``): w * norm(y) *
    silu(z), groups of I / G channels; a group that spans ranks sums its squares across
    them (the parent's scheme). PyTorch only."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = x.float()
        if self.shared_group is None:
            groups = y.view(*y.shape[:-1], -1, self.group_size)
            inv_rms = torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
            y = (groups * inv_rms).view(y.shape)
        else:
            sums = torch.zeros(*y.shape[:-1], self.n_groups, dtype=torch.float32, device=y.device)
            group = self.shared_group
            sums[..., group] = y.pow(2).sum(-1)
            sums = tensor_model_parallel_all_reduce(sums)
            y = y * torch.rsqrt(sums[..., group : group + 1] / self.group_size + self.eps)
        return (self.weight.float() * y * F.silu(gate.float())).to(x.dtype)


def falcon_h1_mixer(config: FalconH1ModelConfig, layer_idx: int, dtype) -> MambaMixer2:
    """A ``MambaMixer2`` with Falcon-H1's gate (``mamba_rms_norm``,
    ``mamba_norm_before_gate``) and out_proj bias (``projectors_bias``)."""
    shape = config.mamba_shape()
    mixer = MambaMixer2(shape, dtype=dtype, layer_idx=layer_idx)
    if not config.mamba_rms_norm:
        mixer.norm = GateOnly()
    elif config.mamba_norm_before_gate:
        channels = RowShards(*mamba2_layout(shape)["channels"])
        mixer.norm = NormThenGate(channels, shape.n_groups, shape.norm_eps, dtype)
    if config.projectors_bias != shape.use_bias:
        mixer.out_proj = RowParallelLinear(
            shape.intermediate_size, shape.hidden_size, bias=config.projectors_bias, dtype=dtype
        )
    return mixer


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, config: FalconH1ModelConfig, layer_idx: int, dtype, prefix: str):
        super().__init__()
        eps = config.rms_norm_eps
        self.mamba = falcon_h1_mixer(config, layer_idx, dtype)
        self.self_attn = RotaryAttention(config, dtype, prefix=f"{prefix}.self_attn")
        self.feed_forward = GatedMLP(
            config.hidden_size, config.mlp_size(), config.mlp_bias, config.hidden_act, dtype
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)

    def forward(self, hidden, residual, positions):
        normed, residual = residual_norm(self.input_layernorm, hidden, residual)
        out = self.mamba(normed) + self.self_attn(normed, positions)
        normed, residual = self.pre_ff_layernorm(out, residual)
        return self.feed_forward(normed), residual

    @torch.no_grad()
    def fold_multipliers(self, config: FalconH1ModelConfig) -> None:
        """Scale the loaded weights by the layer's muP multipliers (this rank's rows)."""
        s = config.ssm_multipliers
        in_proj = self.mamba.in_proj
        _scale_rows(in_proj, [m * config.ssm_in_multiplier for m in s], list(s))
        _scale_all(self.mamba.out_proj, config.ssm_out_multiplier)
        a, k = config.attention_in_multiplier, config.key_multiplier
        _scale_rows(self.self_attn.qkv_proj, [a, a * k, a], [1.0, k, 1.0])
        _scale_all(self.self_attn.o_proj, config.attention_out_multiplier)
        gate, down = config.mlp_multipliers
        _scale_rows(self.feed_forward.gate_up_proj, [gate, 1.0], [gate, 1.0])
        _scale_all(self.feed_forward.down_proj, down)


def _scale_rows(layer, weight_factors: list[float], bias_factors: list[float]) -> None:
    """Multiply each part of a merged column-parallel layer (its local rows) by a factor."""
    for tensor, factors in ((layer.weight, weight_factors), (layer.bias, bias_factors)):
        if tensor is None:
            continue
        for rows, f in zip(tensor.split(list(layer.local_sizes)), factors, strict=True):
            if f != 1.0:
                rows.mul_(f)


def _scale_all(layer, factor: float) -> None:
    if factor != 1.0:
        layer.weight.mul_(factor)
        if layer.bias is not None:
            layer.bias.mul_(factor)


class FalconH1Model(nn.Module):
    def __init__(self, config: FalconH1ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embedding_multiplier = config.embedding_multiplier
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            FalconH1DecoderLayer(config, i, dtype, prefix=f"model.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids, positions):
        hidden, residual = self.embed_tokens(input_ids), None
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions)
        return self.final_layernorm(hidden, residual)[0]


class FalconH1ForCausalLM(MambaHybridForCausalLM):
    stacked_params_mapping = (
        *MambaHybridForCausalLM.stacked_params_mapping,
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: FalconH1ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)
        self._set_model(FalconH1Model(config, dtype))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits times ``lm_head_multiplier`` (rank 0's; None on the others)."""
        logits = super().compute_logits(hidden_states)
        if logits is None or self.config.lm_head_multiplier == 1.0:
            return logits
        return logits * self.config.lm_head_multiplier

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the checkpoint (every parameter, as the base does), then fold the muP
        multipliers into the linear layers' weights; each call loads every parameter
        afresh, so a second call folds them once again into fresh weights."""
        super().load_weights(weights)
        for layer in self.model.layers:
            layer.fold_multipliers(self.config)
