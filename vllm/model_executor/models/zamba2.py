"""Zamba2ForCausalLM: Mamba2 layers, some of them fed by shared transformer blocks.

As transformers' ``modeling_zamba2`` defines it (5.17 and 5.24 compute the same)::

    e = embed_tokens(ids); h = e
    for layer i:
        if hybrid (j-th hybrid layer, shared block b = j % num_mem_blocks):
            x = block_b.input_layernorm(cat(h, e))                 # width 2 * hidden
            q, k, v = block_b.{q,k,v}_proj(x) + adapter_j(x)       # adapters: optional
            a = block_b.o_proj(attention_j(rope(q), rope(k), v))   # RoPE: use_mem_rope
            a = block_b.pre_ff_layernorm(a)
            g, u = (block_b.gate_up_proj(a) + gate_up_adapter_j(a)).chunk(2)
            t = linear_j(block_b.down_proj(act(g) * u))
            h = h + mamba_i(input_layernorm_i(h + t))
        else:
            h = h + mamba_i(input_layernorm_i(h))
    logits = lm_head(final_layernorm(h))                           # tied by default

The shared blocks' weights (norms, q/k/v/o, gate_up, down) exist once per block
(``model.blocks.{b}``); everything a use owns sits in its hybrid layer: the LoRA-like
adapters (``q_adapter``, ``k_adapter``, ``v_adapter`` with ``use_shared_attention_adapter``,
``gate_up_adapter`` always), the output ``linear``, and its own ``Attention`` (so every use
has its own KV cache, as transformers keeps one cache per hybrid layer). The attention scale
is (head_dim / 2) ** -0.5, as transformers' Zamba2 has it; the mixers' conv always has a
bias and their gated norm an epsilon of 1e-5 (both fixed in transformers); dt is floored at
``time_step_min`` (in the decode update too, where transformers applies no floor: they
differ only below it).

Checkpoint names are transformers' (``model.layers.{i}.shared_transformer.*`` for a
hybrid layer's block, with the adapters of use j under ``..._adapter_list.{j}``; a block's
q/k/v projections load into its fused ``qkv_proj``); every copy of a shared weight a
checkpoint holds must be equal. (transformers 5.17 and 5.24 tie the
shared blocks only when ``tie_word_embeddings`` is true, their one tying switch; with it
false their model keeps an independent block per use, which is not Zamba2's design: such a
checkpoint holds different copies and is refused with the names of the two that differ.)
The lm head is untied when ``tie_word_embeddings`` is false, as there.

Tensor parallelism (``tensor_parallel_size`` N) cuts each shared block once, and every use
of it runs on the same part: q/k/v one ``QKVParallelLinear`` over the 2 x hidden input (q
heads split, KV heads split, or replicated when fewer than ranks), o_proj and down_proj
row-parallel (one all-reduce each), gate_up column-parallel (this rank's block of gate and
of up). An adapter's down-projection (to ``adapter_rank``) is replicated and its
up-projection cut like the output it adds to: q/k/v adapters by heads (adapters need as
many KV heads as heads, so those never replicate), the gate_up adapter by the same gate
and up blocks. The norms and each use's ``linear`` (hidden to hidden, after the reduced
down_proj) are replicated; the mixers are cut in ``MambaMixer2``, the embeddings and head
by vocabulary. Each rank reads only its rows of every copy of a shared weight, and checks
its rows of the later copies against the first. At N = 1 every part is the whole layer.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from vllm.model_executor.layers.activation import get_act_fn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.hybrid_base import AttentionProjections, MambaHybridForCausalLM
from vllm.model_executor.models.zamba2_config import Zamba2ModelConfig

_ADAPTER = re.compile(
    r"(self_attn\.linear_(?P<qkv>[qkv])_adapter_list|feed_forward\.gate_up_proj_adapter_list)"
    r"\.(?P<use>\d+)\.(?P<rest>.+)"
)


def _adapter(width_in: int, rank: int, width_out: int, dtype, gate_up=False) -> nn.Sequential:
    """Down to ``rank`` (replicated), then up to ``width_out``, cut like the projection it
    adds to: by heads (q/k/v), or gate|up's two blocks."""
    if gate_up:
        half = width_out // 2
        up = MergedColumnParallelLinear(rank, [half, half], bias=False, dtype=dtype)
    else:
        up = ColumnParallelLinear(rank, width_out, bias=False, dtype=dtype)
    return nn.Sequential(ReplicatedLinear(width_in, rank, bias=False, dtype=dtype), up)


class Zamba2SharedAttention(AttentionProjections):
    """q/k/v over the 2 x hidden input, o_proj back to hidden (``AttentionProjections``)."""

    def __init__(self, config: Zamba2ModelConfig, dtype):
        super().__init__()
        self.local_heads = self._init_projections(
            config.attention_shape(),
            config.attention_hidden_size,
            False,
            dtype,
            out_size=config.hidden_size,
        )


class Zamba2SharedMLP(nn.Module):
    """gate_up (the checkpoint's one fused tensor) a ``MergedColumnParallelLinear`` (this
    rank's gate block, then its up block), down a ``RowParallelLinear``."""

    def __init__(self, config: Zamba2ModelConfig, dtype):
        super().__init__()
        h, i, bias = config.hidden_size, config.mlp_size(), config.add_bias_linear
        self.gate_up_proj = MergedColumnParallelLinear(h, [i, i], bias=bias, dtype=dtype)
        self.down_proj = RowParallelLinear(i, h, bias=bias, dtype=dtype)


class Zamba2SharedBlock(nn.Module):
    """The weights one shared transformer block holds (its uses run it: ``Zamba2HybridLayer``)."""

    def __init__(self, config: Zamba2ModelConfig, dtype):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.attention_hidden_size, eps=eps, dtype=dtype)
        self.self_attn = Zamba2SharedAttention(config, dtype)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=eps, dtype=dtype)
        self.feed_forward = Zamba2SharedMLP(config, dtype)


class Zamba2MambaLayer(nn.Module):
    def __init__(self, config: Zamba2ModelConfig, layer_idx: int, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.mamba = MambaMixer2(config.mamba_shape(), dtype=dtype, layer_idx=layer_idx)

    def forward(self, hidden, transformer_out=None):
        x = hidden if transformer_out is None else hidden + transformer_out
        return hidden + self.mamba(self.input_layernorm(x))


class Zamba2HybridLayer(nn.Module):
    """One use of shared block ``block_id``, then this layer's Mamba layer. ``local_heads``:
    the (q, KV) heads of this rank's shard of the block's attention."""

    def __init__(
        self,
        config: Zamba2ModelConfig,
        layer_idx: int,
        dtype,
        prefix: str,
        local_heads: tuple[int, int],
    ):
        super().__init__()
        self.use = config.hybrid_layer_ids.index(layer_idx)
        self.block_id = self.use % config.num_mem_blocks
        width, rank = config.attention_hidden_size, config.adapter_rank
        heads, kv_heads = local_heads
        head_dim = config.attention_head_dim
        if config.use_shared_attention_adapter:
            self.q_adapter = _adapter(width, rank, width, dtype)
            self.k_adapter = _adapter(width, rank, width, dtype)
            self.v_adapter = _adapter(width, rank, width, dtype)
        self.gate_up_adapter = _adapter(
            config.hidden_size, rank, 2 * config.intermediate_size, dtype, gate_up=True
        )
        self.attn = Attention(
            heads, head_dim, (head_dim / 2) ** -0.5, num_kv_heads=kv_heads, prefix=f"{prefix}.attn"
        )
        self.linear = ReplicatedLinear(
            config.hidden_size, config.hidden_size, bias=False, dtype=dtype
        )
        self.mamba_decoder = Zamba2MambaLayer(config, layer_idx, dtype)
        self.adapters = config.use_shared_attention_adapter

    def transformer(self, block: Zamba2SharedBlock, hidden, embeds, positions, rope, act_fn):
        x = block.input_layernorm(torch.cat((hidden, embeds), dim=-1))
        sa = block.self_attn
        q, k, v = sa._qkv(x)
        if self.adapters:
            q, k, v = q + self.q_adapter(x), k + self.k_adapter(x), v + self.v_adapter(x)
        if rope is not None:
            q, k = rope(positions, q, k)
        a = block.pre_ff_layernorm(sa.o_proj(self.attn(q, k, v)))
        ff = block.feed_forward
        gate, up = (ff.gate_up_proj(a) + self.gate_up_adapter(a)).chunk(2, dim=-1)
        return self.linear(ff.down_proj(act_fn(gate) * up))


class Zamba2Model(nn.Module):
    def __init__(self, config: Zamba2ModelConfig, dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.blocks = nn.ModuleList(
            Zamba2SharedBlock(config, dtype) for _ in range(config.num_mem_blocks)
        )
        local_heads = self.blocks[0].self_attn.local_heads
        self.layers = nn.ModuleList(
            Zamba2HybridLayer(config, i, dtype, f"model.layers.{i}", local_heads)
            if kind == "hybrid"
            else Zamba2MambaLayer(config, i, dtype)
            for i, kind in enumerate(config.layer_types)
        )
        self.final_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.rotary_emb = None
        if config.use_mem_rope:
            d = config.attention_head_dim
            self.rotary_emb = RotaryEmbedding(d, d, config.rope_positions, config.rope_theta)
        self.act_fn = get_act_fn(config.hidden_act)

    def forward(self, input_ids, positions):
        embeds = self.embed_tokens(input_ids)
        hidden = embeds
        for layer in self.layers:
            if isinstance(layer, Zamba2HybridLayer):
                block = self.blocks[layer.block_id]
                t = layer.transformer(
                    block, hidden, embeds, positions, self.rotary_emb, self.act_fn
                )
                hidden = layer.mamba_decoder(hidden, t)
            else:
                hidden = layer(hidden)
        return self.final_layernorm(hidden)


class Zamba2ForCausalLM(MambaHybridForCausalLM):
    def __init__(self, config: Zamba2ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)
        self._set_model(Zamba2Model(config, dtype))

    def hf_to_param_name(self, name: str) -> str | None:
        if super().hf_to_param_name(name) is None:
            return None
        m = re.fullmatch(r"model\.layers\.(\d+)\.shared_transformer\.(.+)", name)
        if m is None:
            return name
        layer_idx, rest = int(m.group(1)), m.group(2)
        ids = self.config.hybrid_layer_ids
        if layer_idx not in ids:
            return name  # not a hybrid layer: reported as unknown
        block = ids.index(layer_idx) % self.config.num_mem_blocks
        a = _ADAPTER.fullmatch(rest)
        if a is None:
            return f"model.blocks.{block}.{rest}"
        use = int(a.group("use"))
        if use >= len(ids) or use % self.config.num_mem_blocks != block:
            return name  # an adapter slot this block does not own: reported as unknown
        kind = f"{a.group('qkv')}_adapter" if a.group("qkv") else "gate_up_adapter"
        return f"model.layers.{ids[use]}.{kind}.{a.group('rest')}"
