"""The Falcon-H1 configuration, read from HF transformers' ``FalconH1Config`` fields.

Field names and defaults are ``FalconH1Config``'s (transformers 5.24), so
``FalconH1ModelConfig()`` is its default shape. Every layer is "hybrid": an attention
block and a Mamba2 mixer side by side on the same normed input, their outputs summed, then
a SwiGLU MLP. The mixer's inner width is ``mamba_d_ssm`` when given, else
``mamba_expand * hidden_size``; ``mamba_d_head`` "auto" is that width / ``mamba_n_heads``.

The muP multipliers (all 1 by default): ``embedding_multiplier`` scales the embeddings,
``lm_head_multiplier`` the logits; ``attention_in_multiplier`` the attention's input,
``key_multiplier`` its keys, ``attention_out_multiplier`` its output;
``ssm_in_multiplier`` the mixer's input, ``ssm_multipliers`` (five) its in_proj output
slices z | x | B | C | dt, ``ssm_out_multiplier`` its output; ``mlp_multipliers`` (two)
the MLP's gate projection and its down projection. ``mamba_rms_norm`` false: the mixer
gates y by silu(z) without a norm; true: a grouped RMS norm, before the gate
(``mamba_norm_before_gate`` true) or after it. ``projectors_bias`` is the mixer's
out_proj bias (its in_proj's is ``mamba_proj_bias``). RoPE rotates the whole head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.model_executor.models.config_utils import (
    AttentionShape,
    BambaMambaFields,
    as_float,
    as_limit,
    check_attention_heads,
    check_bools,
    check_mamba_shape,
    check_positive_ints,
    check_required,
    fields_from_dict,
    rope_settings,
)

_SCALARS = (
    "embedding_multiplier",
    "lm_head_multiplier",
    "key_multiplier",
    "attention_in_multiplier",
    "attention_out_multiplier",
    "ssm_in_multiplier",
    "ssm_out_multiplier",
)
_LISTS = {"mlp_multipliers": 2, "ssm_multipliers": 5}


@dataclass(frozen=True)
class FalconH1ModelConfig(BambaMambaFields):
    architecture: ClassVar[str] = "FalconH1ForCausalLM"
    model_type: ClassVar[str] = "falcon_h1"
    mamba_tp_fields: ClassVar[tuple[str, str]] = ("mamba_n_heads", "mamba_n_groups")

    vocab_size: int = 128000
    tie_word_embeddings: bool = False
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    mamba_d_ssm: int | None = 1024
    mamba_n_heads: int = 128
    mamba_d_head: int | str = "auto"
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_norm_before_gate: bool = True
    mamba_rms_norm: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    projectors_bias: bool = False
    rope_theta: float = 10000.0
    lm_head_multiplier: float = 1.0
    embedding_multiplier: float = 1.0
    mlp_multipliers: tuple[float, ...] = (1.0, 1.0)
    key_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    attention_bias: bool = False
    mlp_bias: bool = False
    dtype: str | None = None

    def __post_init__(self):
        # Normalised forms (the dataclass is frozen: set through object.__setattr__).
        def put(name, value):
            object.__setattr__(self, name, value)

        if self.num_key_value_heads is None:
            put("num_key_value_heads", self.num_attention_heads)  # as transformers
        check_positive_ints(self, ("hidden_size", "mamba_n_heads", "mamba_expand"))
        if self.mamba_d_ssm is not None:
            check_positive_ints(self, ("mamba_d_ssm",))
        if self.mamba_d_head == "auto":
            put("mamba_d_head", self.mamba_inner_size // self.mamba_n_heads)
        put("time_step_limit", as_limit("time_step_limit", self.time_step_limit))
        for name in _SCALARS:
            put(name, as_float(name, getattr(self, name)))
        for name, n in _LISTS.items():
            value = getattr(self, name)
            if not isinstance(value, list | tuple) or len(value) != n:
                raise ValueError(f"config field {name} must list {n} numbers, got {value!r}")
            put(name, tuple(as_float(name, v) for v in value))
        self.validate()

    # -- views ---------------------------------------------------------------------------

    @property
    def mamba_inner_size(self) -> int:
        """The mixer's inner width: ``mamba_d_ssm``, else ``mamba_expand * hidden_size``."""
        if self.mamba_d_ssm is None:
            return self.mamba_expand * self.hidden_size
        return self.mamba_d_ssm

    @property
    def attention_head_dim(self) -> int:
        """``head_dim`` when the config gives one (transformers reads it if present), else
        hidden_size / num_attention_heads."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """RoPE turns the whole head."""
        return self.attention_head_dim

    @property
    def rope_positions(self) -> int:
        """Positions the RoPE table covers (max_model_len may not exceed it)."""
        return self.max_position_embeddings

    @property
    def layer_types(self) -> tuple[str, ...]:
        return ("hybrid",) * self.num_hidden_layers

    def attention_shape(self) -> AttentionShape:
        return AttentionShape(
            self.num_attention_heads, self.num_key_value_heads, self.attention_head_dim
        )

    def mlp_size(self) -> int:
        return self.intermediate_size

    # -- checks --------------------------------------------------------------------------

    def validate(self) -> None:
        check_positive_ints(
            self,
            (
                "vocab_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "max_position_embeddings",
                "mamba_d_head",
                "mamba_n_groups",
                "mamba_d_state",
                "mamba_chunk_size",
            ),
        )
        if self.head_dim is not None:
            check_positive_ints(self, ("head_dim",))
        check_bools(
            self,
            (
                "tie_word_embeddings",
                "mamba_conv_bias",
                "mamba_proj_bias",
                "mamba_norm_before_gate",
                "mamba_rms_norm",
                "projectors_bias",
                "attention_bias",
                "mlp_bias",
            ),
        )
        check_mamba_shape(
            hidden=self.hidden_size,
            heads=self.mamba_n_heads,
            head_dim=self.mamba_d_head,
            groups=self.mamba_n_groups,
            conv=self.mamba_d_conv,
            inter=self.mamba_inner_size,
        )
        check_attention_heads(self.num_attention_heads, self.num_key_value_heads)
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(
                f"config field hidden_act={self.hidden_act!r} is not supported: Falcon-H1's conv "
                "and MLP activation is silu"
            )
        d = self.attention_head_dim
        if d < 2 or d % 2:
            raise ValueError(f"config: the rotary size {d} (the head size) must be even")

    # -- reading config.json -------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FalconH1ModelConfig:
        check_required(raw, ("hidden_size", "num_hidden_layers", "vocab_size"))
        kwargs = fields_from_dict(cls, raw, floats=("rms_norm_eps",))
        if "mamba_d_ssm" in raw and raw["mamba_d_ssm"] is None:
            kwargs["mamba_d_ssm"] = None  # null: expand * hidden (the default is 1024)
        if "num_key_value_heads" in raw and raw["num_key_value_heads"] is None:
            kwargs["num_key_value_heads"] = None  # as many as the query heads, as HF
        # transformers' Falcon-H1 RoPE rotates the whole head (it reads no partial factor)
        kwargs["rope_theta"] = rope_settings(raw)["rope_theta"]
        return cls(**kwargs)
