"""The Zamba2 configuration, read from HF transformers' ``Zamba2Config`` fields.

Field names and defaults are ``Zamba2Config``'s (transformers 5.17 and 5.24 agree), with
its derived sizes as properties: the shared transformer works on the concatenation of the
hidden state and the embeddings (``attention_hidden_size = 2 * hidden_size``), its heads
are ``attention_head_dim = 2 * hidden_size / num_attention_heads`` wide, and the Mamba
heads ``mamba_headdim = mamba_expand * hidden_size / n_mamba_heads``. ``layers_block_type``
names each layer "mamba" ("linear_attention" in transformers 5) or "hybrid" (a shared
transformer block, then a Mamba layer); without it transformers' default 54-layer pattern
applies. ``use_long_context`` sets ``max_position_embeddings`` to 16384, as transformers
does (its RoPE stays unscaled there too).
"""

from __future__ import annotations

from dataclasses import dataclass
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
    rope_settings,
)

_BLOCK_TYPES = {"linear_attention": "mamba", "mamba": "mamba", "hybrid": "hybrid"}
# transformers' Zamba2Config default: 54 layers, 9 of them hybrid.
_DEFAULT_LAYERS = (
    ("mamba",) + (("mamba",) * 5 + ("hybrid",)) * 7 + ("mamba",) * 4 + ("hybrid",)
    + ("mamba",) * 3 + ("hybrid",) + ("mamba",) * 2
)  # fmt: skip


@dataclass(frozen=True)
class Zamba2ModelConfig(ModelShapes):
    architecture: ClassVar[str] = "Zamba2ForCausalLM"
    model_type: ClassVar[str] = "zamba2"
    mamba_tp_fields: ClassVar[tuple[str, str]] = ("n_mamba_heads", "mamba_ngroups")

    vocab_size: int = 32000
    max_position_embeddings: int = 4096
    hidden_size: int = 2560
    layer_types: tuple[str, ...] = _DEFAULT_LAYERS
    mamba_d_state: int = 64
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_ngroups: int = 1
    time_step_min: float = 0.001
    n_mamba_heads: int = 8
    chunk_size: int = 256
    add_bias_linear: bool = False
    intermediate_size: int | None = None
    hidden_act: str = "gelu"
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    num_mem_blocks: int = 1
    use_shared_attention_adapter: bool = False
    adapter_rank: int = 128
    use_mem_rope: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    use_long_context: bool = False
    tie_word_embeddings: bool = True
    dtype: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.intermediate_size is None:
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.use_long_context:
            object.__setattr__(self, "max_position_embeddings", 16384)
        self.validate()

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def hybrid_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "hybrid")

    @property
    def attention_hidden_size(self) -> int:
        return 2 * self.hidden_size

    @property
    def attention_head_dim(self) -> int:
        return 2 * self.hidden_size // self.num_attention_heads

    @property
    def mamba_headdim(self) -> int:
        return self.mamba_expand * self.hidden_size // self.n_mamba_heads

    @property
    def rope_positions(self) -> int | None:
        """Positions the RoPE table covers (max_model_len may not exceed it); None: no RoPE."""
        return self.max_position_embeddings if self.use_mem_rope else None

    @property
    def time_step_limit(self) -> tuple[float, float]:
        # transformers' Zamba2 mixer: a floor of time_step_min, no upper limit.
        return (self.time_step_min, float("inf"))

    def mamba_shape(self) -> Mamba2Shape:
        # transformers' Zamba2 mixer: a conv bias always, a gated-norm epsilon of 1e-5.
        return Mamba2Shape(
            hidden_size=self.hidden_size,
            num_heads=self.n_mamba_heads,
            head_dim=self.mamba_headdim,
            n_groups=self.mamba_ngroups,
            state_size=self.mamba_d_state,
            conv_kernel=self.mamba_d_conv,
            chunk_size=self.chunk_size,
            use_bias=self.add_bias_linear,
            use_conv_bias=True,
            norm_eps=1e-5,
            time_step_limit=self.time_step_limit,
        )

    def attention_shape(self) -> AttentionShape:
        """The shared blocks' attention, over the 2 x hidden input (adapters need as many
        KV heads as heads: their widths shard with these heads)."""
        return AttentionShape(
            self.num_attention_heads, self.num_key_value_heads, self.attention_head_dim
        )

    def mlp_size(self) -> int:
        return self.intermediate_size

    def validate(self) -> None:
        check_positive_ints(
            self,
            (
                "vocab_size",
                "max_position_embeddings",
                "hidden_size",
                "mamba_d_state",
                "mamba_expand",
                "mamba_ngroups",
                "n_mamba_heads",
                "chunk_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "num_mem_blocks",
                "adapter_rank",
            ),
        )
        check_bools(
            self,
            (
                "add_bias_linear",
                "use_shared_attention_adapter",
                "use_mem_rope",
                "use_long_context",
                "tie_word_embeddings",
            ),
        )
        if not self.layer_types or set(self.layer_types) - {"mamba", "hybrid"}:
            raise ValueError(f"config: invalid Zamba2 layer kinds {self.layer_types}")
        inner = self.mamba_expand * self.hidden_size
        if inner % self.n_mamba_heads:
            raise ValueError(
                f"config: mamba_expand * hidden_size = {inner} must be a multiple of "
                f"n_mamba_heads={self.n_mamba_heads}"
            )
        check_mamba_shape(
            hidden=self.hidden_size,
            heads=self.n_mamba_heads,
            head_dim=self.mamba_headdim,
            groups=self.mamba_ngroups,
            conv=self.mamba_d_conv,
            inter=inner,
        )
        if self.attention_hidden_size % self.num_attention_heads:
            raise ValueError(
                f"config: 2 * hidden_size = {self.attention_hidden_size} must be a multiple "
                f"of num_attention_heads={self.num_attention_heads}"
            )
        check_attention_heads(self.num_attention_heads, self.num_key_value_heads)
        if (
            self.use_shared_attention_adapter
            and self.num_key_value_heads != self.num_attention_heads
        ):
            raise ValueError(
                "config: use_shared_attention_adapter needs num_key_value_heads == "
                "num_attention_heads (the k and v adapters are as wide as the queries)"
            )
        if self.hidden_act not in ("gelu", "gelu_pytorch_tanh", "gelu_new", "silu", "swish"):
            raise ValueError(f"config field hidden_act={self.hidden_act!r} is not supported")
        if self.use_mem_rope and self.attention_head_dim % 2:
            raise ValueError(f"config: RoPE needs an even head size, got {self.attention_head_dim}")
        if not self.time_step_min >= 0:
            raise ValueError(f"config field time_step_min={self.time_step_min} must be >= 0")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Zamba2ModelConfig:
        check_required(raw, ("hidden_size", "vocab_size"))
        kwargs = fields_from_dict(cls, raw, floats=("rms_norm_eps", "time_step_min"))
        kwargs.pop("layer_types", None)
        listed = raw.get("layers_block_type")
        if listed is not None:
            kwargs["layer_types"] = block_types(listed, _BLOCK_TYPES)
        if raw.get("use_mem_rope"):
            kwargs["rope_theta"] = rope_settings(raw)["rope_theta"]
        return cls(**kwargs)
