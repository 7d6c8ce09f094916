"""The Mamba1 model configurations, read from HF transformers' ``MambaConfig`` and
``FalconMambaConfig`` fields.

Field names and defaults are transformers' (5.17 and 5.24 name and default them alike), so
``MambaModelConfig()`` is the state-spaces/mamba-130m-hf shape (hidden 768, 32 layers,
state 16, conv 4, expand 2). As in transformers, ``intermediate_size`` is always
``expand * hidden_size`` (a ``config.json`` also stores it; the stored value is not read)
and ``time_step_rank="auto"`` means ceil(hidden_size / 16). Fields that do not change
inference (initialisation ranges and schemes, ``use_mambapy``, ``use_cache``, ...) are
accepted and ignored.

``FalconMambaModelConfig`` adds ``mixer_rms_eps``, the epsilon of the weightless RMS norms
FalconMamba puts on dt, B and C in every mixer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.model_executor.layers.mamba.mamba_mixer import Mamba1Shape, mamba1_tp_problems
from vllm.model_executor.models.config_utils import (
    ModelShapes,
    check_bools,
    check_positive_ints,
    check_required,
    fields_from_dict,
)


@dataclass(frozen=True)
class MambaModelConfig(ModelShapes):
    architecture: ClassVar[str] = "MambaForCausalLM"
    model_type: ClassVar[str] = "mamba"
    # Fields read as floats (save_pretrained may write them as ints or as JSON inf).
    float_fields: ClassVar[tuple[str, ...]] = ("layer_norm_epsilon",)

    vocab_size: int = 50280
    hidden_size: int = 768
    state_size: int = 16
    num_hidden_layers: int = 32
    layer_norm_epsilon: float = 1e-5
    expand: int = 2
    conv_kernel: int = 4
    use_bias: bool = False
    use_conv_bias: bool = True
    hidden_act: str = "silu"
    residual_in_fp32: bool = True
    time_step_rank: int | str = "auto"
    tie_word_embeddings: bool = True
    dtype: str | None = None
    # Not a MambaConfig field (the model has no positions); read where a config.json has
    # it, as vLLM reads the context length.
    max_position_embeddings: int | None = None

    def __post_init__(self):
        if self.time_step_rank == "auto" and isinstance(self.hidden_size, int):
            # frozen: the normalised form, as transformers stores it
            object.__setattr__(self, "time_step_rank", math.ceil(self.hidden_size / 16))
        self.validate()

    @property
    def intermediate_size(self) -> int:
        return self.expand * self.hidden_size

    def mixer_rms_eps_or_none(self) -> float | None:
        """The epsilon of the norms on dt, B and C (None: Mamba1 has none)."""
        return None

    def mamba1_shape(self) -> Mamba1Shape:
        return Mamba1Shape(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            state_size=self.state_size,
            conv_kernel=self.conv_kernel,
            time_step_rank=self.time_step_rank,
            use_bias=self.use_bias,
            use_conv_bias=self.use_conv_bias,
            bcdt_rms_eps=self.mixer_rms_eps_or_none(),
        )

    def tp_problems(self, tp_size: int) -> list[str]:
        """d_inner is what shards (the vocabulary is padded per rank)."""
        return mamba1_tp_problems(
            self.intermediate_size, tp_size, "intermediate_size (expand * hidden_size)"
        )

    def validate(self) -> None:
        check_positive_ints(
            self,
            (
                "vocab_size",
                "hidden_size",
                "state_size",
                "num_hidden_layers",
                "expand",
                "time_step_rank",
            ),
        )
        check_bools(self, ("use_bias", "use_conv_bias", "residual_in_fp32", "tie_word_embeddings"))
        if not 2 <= self.conv_kernel <= 8:
            raise ValueError(
                f"config field conv_kernel={self.conv_kernel} is not supported (the conv "
                "kernels take widths 2..8)"
            )
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(
                f"config field hidden_act={self.hidden_act!r} is not supported: the Mamba "
                "conv activation is silu"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> MambaModelConfig:
        """From the fields of an HF ``config.json`` (``model_type`` the class's)."""
        model_type = raw.get("model_type")
        architectures = raw.get("architectures") or []
        if model_type != cls.model_type and cls.architecture not in architectures:
            raise ValueError(
                f"unsupported model: model_type={model_type!r}, architectures={architectures}; "
                f"this loader serves model_type {cls.model_type!r} ({cls.architecture})"
            )
        check_required(raw, ("hidden_size", "num_hidden_layers", "vocab_size"))
        return cls(**fields_from_dict(cls, raw, floats=cls.float_fields))


@dataclass(frozen=True)
class FalconMambaModelConfig(MambaModelConfig):
    architecture: ClassVar[str] = "FalconMambaForCausalLM"
    model_type: ClassVar[str] = "falcon_mamba"
    float_fields: ClassVar[tuple[str, ...]] = ("layer_norm_epsilon", "mixer_rms_eps")

    mixer_rms_eps: float = 1e-6

    def mixer_rms_eps_or_none(self) -> float | None:
        return self.mixer_rms_eps

    def validate(self) -> None:
        super().validate()
        if not self.mixer_rms_eps > 0:
            raise ValueError(f"config field mixer_rms_eps must be > 0, got {self.mixer_rms_eps}")
