"""The LFM2 configuration, read from HF transformers' ``Lfm2Config`` fields.

Field names and defaults are ``Lfm2Config``'s (transformers 5.24), so ``Lfm2ModelConfig()``
is its default shape; ``LFM2_1_2B`` below is LiquidAI/LFM2-1.2B's. Each layer is a gated
short conv (``"conv"``) or GQA attention (``"full_attention"``) from ``layer_types``; a
config without it lists its attention layers in ``full_attn_idxs`` (absent too: every
layer is attention, as transformers reads it). Older checkpoints' keys are read as
transformers reads them: ``block_ff_dim`` and ``tie_embedding`` take precedence over
``intermediate_size`` and ``tie_word_embeddings``.

The MLP's width is ``intermediate_size`` adjusted as transformers' ``Lfm2MLP`` does when
``block_auto_adjust_ff_dim``: 2/3 of it, times ``block_ffn_dim_multiplier`` (when set),
rounded up to a multiple of ``block_multiple_of`` (``mlp_size()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.model_executor.layers.linear import qkv_tp_problems
from vllm.model_executor.layers.mamba.short_conv import short_conv_tp_problems
from vllm.model_executor.models.config_utils import (
    AttentionShape,
    ModelShapes,
    as_float,
    check_attention_heads,
    check_bools,
    check_positive_ints,
    check_required,
    fields_from_dict,
    rope_settings,
)

LAYER_KINDS = ("conv", "full_attention")


@dataclass(frozen=True)
class Lfm2ModelConfig(ModelShapes):
    architecture: ClassVar[str] = "Lfm2ForCausalLM"
    model_type: ClassVar[str] = "lfm2"
    # The step metadata's scan chunk: LFM2 has no SSM scan, so any size serves.
    chunk_size: ClassVar[int] = 256

    vocab_size: int = 65536
    hidden_size: int = 2560
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    max_position_embeddings: int = 128000
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    rope_theta: float = 1000000.0
    conv_bias: bool = False
    conv_L_cache: int = 3
    block_multiple_of: int = 256
    block_ffn_dim_multiplier: float | None = 1.0
    block_auto_adjust_ff_dim: bool = True
    full_attn_idxs: tuple[int, ...] | None = None
    layer_types: tuple[str, ...] | None = None
    dtype: str | None = None

    def __post_init__(self):
        # Normalised forms (the dataclass is frozen: set through object.__setattr__).
        if self.full_attn_idxs is not None:
            object.__setattr__(self, "full_attn_idxs", tuple(self.full_attn_idxs))
        if self.layer_types is None:
            attn = self.full_attn_idxs
            attn = range(self.num_hidden_layers) if attn is None else attn
            kinds = tuple(
                "full_attention" if i in attn else "conv" for i in range(self.num_hidden_layers)
            )
            object.__setattr__(self, "layer_types", kinds)
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rope_positions(self) -> int:
        """Positions the RoPE table covers (max_model_len may not exceed it)."""
        return self.max_position_embeddings

    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.num_attention_heads, self.num_key_value_heads, self.head_dim)

    def mlp_size(self) -> int:
        """The SwiGLU width, as ``Lfm2MLP`` computes it from ``intermediate_size``."""
        size = self.intermediate_size
        if self.block_auto_adjust_ff_dim:
            size = int(2 * size / 3)
            if self.block_ffn_dim_multiplier is not None:
                size = int(self.block_ffn_dim_multiplier * size)
                m = self.block_multiple_of
                size = m * ((size + m - 1) // m)
        return size

    def tp_problems(self, tp_size: int) -> list[str]:
        problems = short_conv_tp_problems(self.hidden_size, tp_size)
        if "full_attention" in self.layer_types:
            problems += qkv_tp_problems(self.num_attention_heads, self.num_key_value_heads, tp_size)
        mlp = self.mlp_size()
        if mlp % tp_size:
            problems.append(
                f"the MLP width {mlp} (from intermediate_size={self.intermediate_size}) is not "
                f"divisible by tp_size={tp_size}"
            )
        return problems

    def validate(self) -> None:
        check_positive_ints(
            self,
            (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "max_position_embeddings",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "conv_L_cache",
                "block_multiple_of",
            ),
        )
        check_bools(self, ("conv_bias", "block_auto_adjust_ff_dim", "tie_word_embeddings"))
        check_attention_heads(self.num_attention_heads, self.num_key_value_heads)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"config: hidden_size={self.hidden_size} must be a multiple of "
                f"num_attention_heads={self.num_attention_heads} (LFM2's head size)"
            )
        if len(self.layer_types) != self.num_hidden_layers or any(
            t not in LAYER_KINDS for t in self.layer_types
        ):
            raise ValueError(
                f"config field layer_types must list one of {list(LAYER_KINDS)} per layer "
                f"(num_hidden_layers={self.num_hidden_layers}), got {list(self.layer_types)}"
            )
        bad = [i for i in self.full_attn_idxs or () if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(
                f"config field full_attn_idxs has layers {bad} outside 0.."
                f"{self.num_hidden_layers - 1}"
            )
        if not 2 <= self.conv_L_cache <= 8:
            raise ValueError(
                f"config field conv_L_cache={self.conv_L_cache} is not supported (the conv "
                "kernels take widths 2..8)"
            )
        if self.mlp_size() < 1:
            raise ValueError(
                f"config: the MLP width from intermediate_size={self.intermediate_size} and "
                f"block_ffn_dim_multiplier={self.block_ffn_dim_multiplier} is {self.mlp_size()}"
            )
        if self.head_dim % 2:
            raise ValueError(f"config: the head size {self.head_dim} must be even (RoPE)")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Lfm2ModelConfig:
        check_required(raw, ("hidden_size", "num_hidden_layers", "vocab_size"))
        kwargs = fields_from_dict(cls, raw, floats=("norm_eps",))
        # transformers pops these older keys over the new ones.
        for old, new in (
            ("block_ff_dim", "intermediate_size"),
            ("tie_embedding", "tie_word_embeddings"),
        ):
            if raw.get(old) is not None:
                kwargs[new] = raw[old]
        if kwargs.get("block_ffn_dim_multiplier") is not None:
            value = as_float("block_ffn_dim_multiplier", kwargs["block_ffn_dim_multiplier"])
            kwargs["block_ffn_dim_multiplier"] = value
        params = raw.get("rope_parameters") or {}
        if "rope_theta" not in raw and not (isinstance(params, dict) and "rope_theta" in params):
            raw = {**raw, "rope_theta": cls.rope_theta}  # LFM2's default, not RoPE's 10000
        rope = rope_settings(raw)
        if rope["partial_rotary_factor"] != 1.0:
            raise ValueError(
                "config: LFM2 rotates whole heads; partial_rotary_factor="
                f"{rope['partial_rotary_factor']} is not supported"
            )
        kwargs["rope_theta"] = rope["rope_theta"]
        if "num_key_value_heads" in raw and raw["num_key_value_heads"] is None:
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 32)
        config = cls(**kwargs)
        # transformers takes a head_dim key where a config has one (LFM2-1.2B's says 64,
        # hidden_size / num_attention_heads); we serve that size only.
        if raw.get("head_dim") is not None and raw["head_dim"] != config.head_dim:
            raise ValueError(
                f"config field head_dim={raw['head_dim']} differs from hidden_size / "
                f"num_attention_heads = {config.head_dim}, the only head size served"
            )
        return config


# LiquidAI/LFM2-1.2B's config.json (as public copies quote it: block_ff_dim 12288, which
# wins over its intermediate_size 8192; MLP width 8192): 16 layers, attention at 2, 5, 8,
# 10, 12, 14.
LFM2_1_2B = dict(
    vocab_size=65536,
    hidden_size=2048,
    intermediate_size=12288,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    full_attn_idxs=(2, 5, 8, 10, 12, 14),
    max_position_embeddings=128000,
    norm_eps=1e-5,
    rope_theta=1000000.0,
    conv_L_cache=3,
    block_multiple_of=256,
    block_ffn_dim_multiplier=1.0,
    block_auto_adjust_ff_dim=True,
)
