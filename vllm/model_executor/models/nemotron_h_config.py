"""The NemotronH configuration, read from HF transformers' ``NemotronHConfig`` fields.

Field names and defaults are ``NemotronHConfig``'s. The layer kinds come from
``layers_block_type`` (transformers 5: "linear_attention", "full_attention", "mlp",
"moe"; the older "mamba" and "attention" are read as transformers remaps them) or, where
that is absent, from ``hybrid_override_pattern`` (one character per layer: ``M`` Mamba2,
``*`` attention, ``-`` MLP, ``E`` MoE). MoE layers are refused: this engine serves the
dense NemotronH models. The older key names transformers still accepts (``mamba_n_groups``,
``mamba_d_conv``, ``mamba_dt_min``, ``mamba_conv_bias``, ``mamba_chunk_size``) win over the
new ones, as in ``NemotronHConfig.__post_init__``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.model_executor.layers.mamba.mamba_utils import Mamba2Shape
from vllm.model_executor.models.config_utils import (
    AttentionShape,
    ModelShapes,
    block_types,
    check_attention_heads,
    check_bools,
    check_mamba_shape,
    check_positive_ints,
    check_required,
    fields_from_dict,
    read_config_json,
)

_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_BLOCK_TYPES = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "full_attention": "attention",
    "attention": "attention",
    "mlp": "mlp",
    "moe": "moe",
}
_LEGACY_KEYS = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_dt_min": "time_step_min",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}


def layer_types_from(raw: dict[str, Any]) -> tuple[str, ...]:
    """Our layer kinds ("mamba", "attention", "mlp", "moe") from a NemotronH config.json."""
    listed = raw.get("layers_block_type")
    if listed is not None:
        return block_types(listed, _BLOCK_TYPES)
    pattern = raw.get("hybrid_override_pattern")
    if pattern is None:
        raise ValueError(
            "config names no layers: give layers_block_type or hybrid_override_pattern"
        )
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(_PATTERN):
        raise ValueError(
            f"config field hybrid_override_pattern must be a string of M, *, - and E (one per "
            f"layer), got {pattern!r}"
        )
    return tuple(_PATTERN[c] for c in pattern)


@dataclass(frozen=True)
class NemotronHModelConfig(ModelShapes):
    architecture: ClassVar[str] = "NemotronHForCausalLM"
    model_type: ClassVar[str] = "nemotron_h"
    mamba_tp_fields: ClassVar[tuple[str, str]] = ("mamba_num_heads", "n_groups")

    layer_types: tuple[str, ...] = ("mamba", "attention", "mlp")
    vocab_size: int = 131072
    hidden_size: int = 4096
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    max_position_embeddings: int | None = 4096
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    ssm_state_size: int = 128
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    mamba_hidden_act: str = "silu"
    n_groups: int = 8
    conv_kernel: int = 4
    time_step_min: float = 0.001
    use_conv_bias: bool = True
    chunk_size: int = 128
    use_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    dtype: str | None = None
    num_hidden_layers: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "num_hidden_layers", len(self.layer_types))
        self.validate()

    @property
    def time_step_limit(self) -> tuple[float, float]:
        # transformers' NemotronH mixer: a floor of time_step_min, no upper limit.
        return (self.time_step_min, float("inf"))

    def mamba_shape(self) -> Mamba2Shape:
        return Mamba2Shape(
            hidden_size=self.hidden_size,
            num_heads=self.mamba_num_heads,
            head_dim=self.mamba_head_dim,
            n_groups=self.n_groups,
            state_size=self.ssm_state_size,
            conv_kernel=self.conv_kernel,
            chunk_size=self.chunk_size,
            use_bias=self.use_bias,
            use_conv_bias=self.use_conv_bias,
            norm_eps=self.layer_norm_epsilon,
            time_step_limit=self.time_step_limit,
        )

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
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "intermediate_size",
                "ssm_state_size",
                "mamba_num_heads",
                "mamba_head_dim",
                "n_groups",
                "chunk_size",
            ),
        )
        check_bools(self, ("mlp_bias", "use_conv_bias", "use_bias", "tie_word_embeddings"))
        bad = set(self.layer_types) - {"mamba", "attention", "mlp", "moe"}
        if bad or not self.layer_types:
            raise ValueError(f"config: invalid NemotronH layer kinds {self.layer_types}")
        if "moe" in self.layer_types:
            raise ValueError(
                "config: NemotronH MoE layers ('E' in hybrid_override_pattern, 'moe' in "
                "layers_block_type) are not supported; this engine serves dense NemotronH models"
            )
        if "mamba" not in self.layer_types:
            raise ValueError("config: a NemotronH model needs at least one Mamba ('M') layer")
        check_mamba_shape(
            hidden=self.hidden_size,
            heads=self.mamba_num_heads,
            head_dim=self.mamba_head_dim,
            groups=self.n_groups,
            conv=self.conv_kernel,
            inter=None,
        )
        check_attention_heads(self.num_attention_heads, self.num_key_value_heads)
        if self.mlp_hidden_act != "relu2":
            raise ValueError(
                f"config field mlp_hidden_act={self.mlp_hidden_act!r} is not supported "
                "(NemotronH's MLP is relu2: squared ReLU)"
            )
        if self.mamba_hidden_act not in ("silu", "swish"):
            raise ValueError(
                f"config field mamba_hidden_act={self.mamba_hidden_act!r} is not supported: "
                "the Mamba2 conv activation is silu"
            )
        if not self.time_step_min >= 0:
            raise ValueError(f"config field time_step_min={self.time_step_min} must be >= 0")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> NemotronHModelConfig:
        check_required(raw, ("hidden_size", "vocab_size"))
        raw = dict(raw)
        for old, new in _LEGACY_KEYS.items():
            if raw.get(old) is not None:
                raw[new] = raw[old]
        kwargs = fields_from_dict(cls, raw, floats=("layer_norm_epsilon", "time_step_min"))
        kwargs["layer_types"] = layer_types_from(raw)
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> NemotronHModelConfig:
        return cls.from_dict(read_config_json(model_dir))
