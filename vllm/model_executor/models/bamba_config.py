"""The Bamba configuration, read from HF transformers' ``BambaConfig`` fields.

Field names and defaults are ``BambaConfig``'s (transformers 5.17 and 5.24 agree), so
``BambaModelConfig()`` is its default shape; ``BAMBA_9B`` below is the ibm-fms/Bamba-9B
shape. Layers listed in ``attn_layer_indices`` are attention layers, the others Mamba2
mixers; every layer then has a SwiGLU MLP. RoPE rotates the first
``partial_rotary_factor`` (0.5: transformers hard-codes it for Bamba) of each head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.model_executor.models.config_utils import (
    AttentionShape,
    BambaMambaFields,
    as_limit,
    check_attention_heads,
    check_bools,
    check_mamba_shape,
    check_positive_ints,
    check_required,
    fields_from_dict,
    rope_settings,
)


@dataclass(frozen=True)
class BambaModelConfig(BambaMambaFields):
    architecture: ClassVar[str] = "BambaForCausalLM"
    model_type: ClassVar[str] = "bamba"
    mamba_tp_fields: ClassVar[tuple[str, str]] = ("mamba_n_heads", "mamba_n_groups")

    vocab_size: int = 128000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 262144
    attn_layer_indices: tuple[int, ...] = ()
    mamba_n_heads: int = 128
    mamba_d_head: int | str = "auto"
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    dtype: str | None = None
    layer_types: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        # Normalised forms (the dataclass is frozen: set through object.__setattr__).
        if self.mamba_d_head == "auto":
            object.__setattr__(
                self, "mamba_d_head", self.mamba_expand * self.hidden_size // self.mamba_n_heads
            )
        object.__setattr__(self, "attn_layer_indices", tuple(self.attn_layer_indices))
        limit = as_limit("time_step_limit", self.time_step_limit)
        object.__setattr__(self, "time_step_limit", limit)
        object.__setattr__(
            self,
            "layer_types",
            tuple(
                "attention" if i in self.attn_layer_indices else "mamba"
                for i in range(self.num_hidden_layers)
            ),
        )
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_positions(self) -> int:
        """Positions the RoPE table covers (max_model_len may not exceed it)."""
        return self.max_position_embeddings

    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.num_attention_heads, self.num_key_value_heads, self.head_dim)

    def mlp_size(self) -> int:
        return self.intermediate_size

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
                "mamba_n_heads",
                "mamba_d_head",
                "mamba_n_groups",
                "mamba_d_state",
                "mamba_expand",
                "mamba_chunk_size",
            ),
        )
        check_bools(
            self,
            (
                "mamba_conv_bias",
                "mamba_proj_bias",
                "attention_bias",
                "mlp_bias",
                "tie_word_embeddings",
            ),
        )
        check_mamba_shape(
            hidden=self.hidden_size,
            heads=self.mamba_n_heads,
            head_dim=self.mamba_d_head,
            groups=self.mamba_n_groups,
            conv=self.mamba_d_conv,
            inter=self.mamba_expand * self.hidden_size,
        )
        check_attention_heads(self.num_attention_heads, self.num_key_value_heads)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"config: hidden_size={self.hidden_size} must be a multiple of "
                f"num_attention_heads={self.num_attention_heads} (Bamba's head size)"
            )
        bad = [i for i in self.attn_layer_indices if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(
                f"config field attn_layer_indices has layers {bad} outside 0.."
                f"{self.num_hidden_layers - 1}"
            )
        if "mamba" not in self.layer_types:
            raise ValueError("config: a Bamba model needs at least one Mamba layer")
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(
                f"config field hidden_act={self.hidden_act!r} is not supported: Bamba's conv "
                "and MLP activation is silu"
            )
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"config: the rotary size {self.rotary_dim} must be even and >= 2")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BambaModelConfig:
        check_required(raw, ("hidden_size", "num_hidden_layers", "vocab_size"))
        kwargs = fields_from_dict(cls, raw, floats=("rms_norm_eps",))
        kwargs.update(rope_settings(raw, default_factor=0.5))
        if "num_key_value_heads" in raw and raw["num_key_value_heads"] is None:
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 32)  # as HF
        return cls(**kwargs)


# ibm-fms/Bamba-9B's config.json (hf-format release): 32 layers, attention at 9, 18, 27.
BAMBA_9B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    attn_layer_indices=(9, 18, 27),
    mamba_n_heads=128,
    mamba_d_head=64,
    mamba_n_groups=1,
    mamba_d_state=128,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=256,
    max_position_embeddings=262144,
    rope_theta=10000.0,
)
