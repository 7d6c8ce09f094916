"""NemotronHForCausalLM: Mamba2, attention, MLP and MoE blocks in the pattern the config
names (the dense Nemotron-H models and the MoE ones, Nemotron-3 Nano).

As transformers' ``modeling_nemotron_h`` defines it (5.17 and 5.24 compute the same)::

    h = embeddings(ids)
    for each layer:  h = h + mixer(norm(h))
        # mixer: Mamba2 ("M") | attention ("*") | MLP ("-") | MoE ("E")
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
- MoE blocks: ``NemotronHMoE`` (routed relu2 experts on the fused op, sigmoid router with
  correction bias, groups, renormalisation and scaling; one shared expert; optional
  latent projections).
- The lm head is never tied to the embeddings (transformers ties none for NemotronH).
- The residual stream is in the model dtype (``residual_in_fp32`` is unused, as in
  transformers); the adds are fused into the next norm.

Parameter names are transformers' (``model.layers.{i}.mixer.in_proj.weight``, ...), but
for the attention's ``qkv_proj``, which holds the checkpoint's q/k/v projections, and the
MoE's stacked experts: ``mixer.experts.w13_weight`` (E, I, H) holds each
``experts.{e}.up_proj.weight`` (the files) or transformers' stacked ``experts.up_proj``,
``mixer.experts.w2_weight`` (E, H, I) the down projections, and
``mixer.experts.e_score_correction_bias`` the router's ``gate.e_score_correction_bias``.
The original NVIDIA checkpoints' ``backbone.`` prefix is read as ``model.``, and their
multi-token-prediction weights (``mtp.*``) are skipped, as transformers skips them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed.communication_op import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.activation import get_act_fn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.fused_moe import FusedMoE, expert_weight_target
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
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
    down a ``RowParallelLinear`` (one all-reduce, or none: ``reduce_results``).
    ``intermediate_size`` defaults to the MLP blocks' (the shared expert gives its own)."""

    def __init__(
        self,
        config: NemotronHModelConfig,
        dtype: torch.dtype,
        intermediate_size: int | None = None,
        reduce_results: bool = True,
    ):
        super().__init__()
        h, bias = config.hidden_size, config.mlp_bias
        i = config.intermediate_size if intermediate_size is None else intermediate_size
        self.up_proj = ColumnParallelLinear(h, i, bias=bias, dtype=dtype)
        self.down_proj = RowParallelLinear(
            i, h, bias=bias, reduce_results=reduce_results, dtype=dtype
        )
        self.act_fn = get_act_fn(config.mlp_hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class NemotronHRouter(ReplicatedLinear):
    """The MoE gate: router logits in fp32 from an fp32 weight (E, H) on every rank, as
    transformers keeps it (``_keep_in_fp32_modules_strict``) and computes it."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__(hidden_size, num_experts, bias=False, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class NemotronHMoE(nn.Module):
    """Routed experts (``FusedMoE``: sigmoid router with correction bias and groups,
    relu2 experts without a gate) plus one shared expert (a ``NemotronHMLP``) on the same
    input. With ``moe_latent_size`` the routed experts work on ``fc1_latent_proj(x)`` and
    their sum goes back through ``fc2_latent_proj`` (both replicated); the router and the
    shared expert read x itself.

    Tensor parallelism: experts and shared expert shard their intermediate dimension;
    without latent projections their partial sums are added and all-reduced once, with
    them the experts reduce before ``fc2_latent_proj`` and the shared expert by itself.
    """

    def __init__(self, config: NemotronHModelConfig, dtype: torch.dtype):
        super().__init__()
        moe, h = config.moe_shape(), config.hidden_size
        self.latent = moe.latent_size is not None
        inner = moe.latent_size if self.latent else h
        self.gate = NemotronHRouter(h, moe.num_experts)
        self.experts = FusedMoE(
            moe.num_experts,
            moe.top_k,
            inner,
            moe.intermediate_size,
            activation="relu2",
            is_act_and_mul=False,
            scoring="sigmoid",
            renormalize=moe.renormalize,
            use_correction_bias=True,
            num_expert_group=moe.num_expert_group,
            topk_group=moe.topk_group,
            routed_scaling_factor=moe.routed_scaling_factor,
            reduce_results=self.latent,
            dtype=dtype,
        )
        self.shared_experts = NemotronHMLP(
            config, dtype, moe.shared_intermediate_size, reduce_results=self.latent
        )
        if self.latent:
            bias = config.mlp_bias
            self.fc1_latent_proj = ReplicatedLinear(h, inner, bias=bias, dtype=dtype)
            self.fc2_latent_proj = ReplicatedLinear(inner, h, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        if self.latent:
            routed = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), logits))
            return routed + self.shared_experts(x)
        out = self.experts(x, logits) + self.shared_experts(x)
        return tensor_model_parallel_all_reduce(out)  # a no-op on one rank


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
        elif self.layer_type == "moe":
            self.mixer = NemotronHMoE(config, dtype)
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

    def hf_to_param_name(self, name: str) -> str | tuple[str, tuple[int, str]] | None:
        if name.startswith("mtp."):
            return None
        if name.startswith("backbone."):
            name = "model." + name.removeprefix("backbone.")
        head, sep, tail = name.partition(".mixer.")
        if tail == "gate.e_score_correction_bias":
            return f"{head}{sep}experts.e_score_correction_bias"
        if sep and tail.startswith("experts."):
            target = expert_weight_target(tail)
            if target is not None:
                param, shard_id = target
                mapped = f"{head}{sep}experts.{param}"
                return mapped if shard_id is None else (mapped, shard_id)
        return name
