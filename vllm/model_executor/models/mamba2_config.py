"""The Mamba2 model configuration, read from HF transformers' ``Mamba2Config`` fields.

Field names and defaults are those of transformers' ``Mamba2Config``, so
``Mamba2ModelConfig()`` is the Mamba-Codestral-7B shape (hidden 4096, 64 layers, 128 heads
of 64, state 128, 8 groups, conv 4). ``from_dict`` reads a ``config.json`` written by
``save_pretrained``; fields that do not change inference (initialisation ranges,
``time_step_rank`` and so on) are accepted and ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.model_executor.layers.mamba.mamba_utils import Mamba2Shape
from vllm.model_executor.models.config_utils import (
    ModelShapes,
    as_limit,
    check_bools,
    check_positive_ints,
    check_required,
    fields_from_dict,
)

_ARCHITECTURE = "Mamba2ForCausalLM"
_MODEL_TYPE = "mamba2"


@dataclass(frozen=True)
class Mamba2ModelConfig(ModelShapes):
    architecture: ClassVar[str] = _ARCHITECTURE
    model_type: ClassVar[str] = _MODEL_TYPE

    vocab_size: int = 32768
    hidden_size: int = 4096
    num_hidden_layers: int = 64
    num_heads: int = 128
    head_dim: int = 64
    state_size: int = 128
    n_groups: int = 8
    expand: int = 2
    conv_kernel: int = 4
    chunk_size: int = 256
    use_bias: bool = False
    use_conv_bias: bool = True
    layer_norm_epsilon: float = 1e-5
    residual_in_fp32: bool = True
    tie_word_embeddings: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    hidden_act: str = "silu"
    dtype: str | None = None
    # Not a Mamba2Config field (the model has no positions); read where a config.json has
    # it, as vLLM reads the context length.
    max_position_embeddings: int | None = None

    def __post_init__(self):
        limit = as_limit("time_step_limit", self.time_step_limit)
        object.__setattr__(self, "time_step_limit", limit)  # frozen: a normalised form
        self.validate()

    @property
    def intermediate_size(self) -> int:
        return self.expand * self.hidden_size

    def mamba_shape(self) -> Mamba2Shape:
        return Mamba2Shape(
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            n_groups=self.n_groups,
            state_size=self.state_size,
            conv_kernel=self.conv_kernel,
            chunk_size=self.chunk_size,
            use_bias=self.use_bias,
            use_conv_bias=self.use_conv_bias,
            norm_eps=self.layer_norm_epsilon,
            time_step_limit=self.time_step_limit,
        )

    def validate(self) -> None:
        check_positive_ints(
            self,
            (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_heads",
                "head_dim",
                "state_size",
                "n_groups",
                "expand",
                "chunk_size",
            ),
        )
        check_bools(self, ("use_bias", "use_conv_bias", "residual_in_fp32", "tie_word_embeddings"))
        if self.intermediate_size != self.num_heads * self.head_dim:
            raise ValueError(
                f"config: expand * hidden_size = {self.intermediate_size} must equal "
                f"num_heads * head_dim = {self.num_heads * self.head_dim}"
            )
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"config: num_heads={self.num_heads} must be a multiple of n_groups={self.n_groups}"
            )
        if not 2 <= self.conv_kernel <= 8:
            raise ValueError(
                f"config field conv_kernel={self.conv_kernel} is not supported (the conv "
                "kernels take widths 2..8)"
            )
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(
                f"config field hidden_act={self.hidden_act!r} is not supported: Mamba2's conv "
                "activation is silu"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Mamba2ModelConfig:
        """From the fields of an HF ``config.json`` (model_type ``mamba2``)."""
        model_type = raw.get("model_type")
        architectures = raw.get("architectures") or []
        if model_type != _MODEL_TYPE and _ARCHITECTURE not in architectures:
            raise ValueError(
                f"unsupported model: model_type={model_type!r}, architectures={architectures}; "
                f"this loader serves model_type {_MODEL_TYPE!r} ({_ARCHITECTURE})"
            )
        check_required(raw, ("hidden_size", "num_hidden_layers", "vocab_size"))
        return cls(**fields_from_dict(cls, raw, floats=("layer_norm_epsilon",)))
