"""The Granite-4.0-H configuration, read from HF transformers' ``GraniteMoeHybridConfig``.

Field names and defaults are ``GraniteMoeHybridConfig``'s (transformers 5.17 and 5.24
agree), so ``GraniteMoeHybridModelConfig()`` is its default shape; ``GRANITE_4_0_H_TINY``
below is ibm-granite/granite-4.0-h-tiny's. Each layer is a Mamba2 mixer or an attention
block, as ``layer_types`` (older files: ``layers_block_type``) names it: ``"mamba"`` or
``"linear_attention"``, ``"attention"`` or ``"full_attention"`` (transformers maps the older
names to the newer ones); without it every layer is Mamba2. Every layer then has a SwiGLU
shared MLP of ``shared_intermediate_size`` and, when ``num_local_experts`` > 0, a block of
routed experts of ``intermediate_size`` beside it (``num_local_experts`` 0: the dense
H-Micro).

Granite's multipliers: ``embedding_multiplier`` scales the embeddings,
``residual_multiplier`` each block's output before its residual add,
``attention_multiplier`` is the attention's softmax scale (in place of head_dim^-0.5),
and the logits are divided by ``logits_scaling``. ``position_embedding_type`` "rope" gives
the attention layers RoPE (neox style, the whole head, ``rope_theta``); absent, null or
"nope" none at all (the released Granite-4.0-H checkpoints).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.model_executor.layers.linear import qkv_tp_problems
from vllm.model_executor.layers.mamba.mamba_tp import mamba2_tp_problems
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

# transformers' names of the layer kinds (the older and the newer) -> ours
_LAYER_KINDS = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "attention",
    "full_attention": "attention",
}
_POSITION_TYPES = (None, "nope", "rope")
_MULTIPLIERS = (
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
)


@dataclass(frozen=True)
class GraniteMoeHybridModelConfig(BambaMambaFields):
    architecture: ClassVar[str] = "GraniteMoeHybridForCausalLM"
    model_type: ClassVar[str] = "granitemoehybrid"
    mamba_tp_fields: ClassVar[tuple[str, str]] = ("mamba_n_heads", "mamba_n_groups")

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    shared_intermediate_size: int = 1024
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    position_embedding_type: str | None = None
    rope_theta: float = 10000.0
    layer_types: tuple[str, ...] | None = None
    mamba_n_heads: int = 128
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_head: int | str = "auto"
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    dtype: str | None = None

    def __post_init__(self):
        # Normalised forms (the dataclass is frozen: set through object.__setattr__).
        def put(name, value):
            object.__setattr__(self, name, value)

        if self.num_key_value_heads is None:
            put("num_key_value_heads", self.num_attention_heads)  # as transformers
        if self.mamba_d_head == "auto":
            put("mamba_d_head", self.mamba_expand * self.hidden_size // self.mamba_n_heads)
        kinds = (
            ("mamba",) * self.num_hidden_layers if self.layer_types is None else self.layer_types
        )
        if not isinstance(kinds, list | tuple) or any(k not in _LAYER_KINDS for k in kinds):
            raise ValueError(
                f"config field layer_types must list one of {sorted(_LAYER_KINDS)} per layer, "
                f"got {kinds!r}"
            )
        put("layer_types", tuple(_LAYER_KINDS[k] for k in kinds))
        put("time_step_limit", as_limit("time_step_limit", self.time_step_limit))
        for name in _MULTIPLIERS:
            put(name, as_float(name, getattr(self, name)))
        if self.position_embedding_type == "nope":
            put("position_embedding_type", None)
        self.validate()

    # -- views ---------------------------------------------------------------------------

    @property
    def attention_head_dim(self) -> int:
        """``head_dim`` when the config gives one (transformers reads it if present), else
        hidden_size / num_attention_heads."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def use_rope(self) -> bool:
        return self.position_embedding_type == "rope"

    @property
    def rope_positions(self) -> int | None:
        """Positions the RoPE table covers (max_model_len may not exceed it); None: no RoPE."""
        return self.max_position_embeddings if self.use_rope else None

    @property
    def has_experts(self) -> bool:
        return self.num_local_experts > 0

    def attention_shape(self) -> AttentionShape | None:
        if "attention" not in self.layer_types:
            return None
        return AttentionShape(
            self.num_attention_heads, self.num_key_value_heads, self.attention_head_dim
        )

    def mlp_size(self) -> int:
        """The shared MLP's width (the experts' is ``intermediate_size``)."""
        return self.shared_intermediate_size

    def tp_problems(self, tp_size: int) -> list[str]:
        mamba = self.mamba_shape()
        problems = mamba2_tp_problems(
            mamba.num_heads, mamba.n_groups, tp_size, self.mamba_tp_fields
        )
        attention = self.attention_shape()
        if attention is not None:
            problems += qkv_tp_problems(attention.num_heads, attention.num_kv_heads, tp_size)
        widths = ["shared_intermediate_size"] + (["intermediate_size"] if self.has_experts else [])
        for name in widths:
            if getattr(self, name) % tp_size:
                problems.append(
                    f"{name}={getattr(self, name)} is not divisible by tp_size={tp_size}"
                )
        return problems

    # -- checks --------------------------------------------------------------------------

    def validate(self) -> None:
        check_positive_ints(
            self,
            (
                "vocab_size",
                "hidden_size",
                "shared_intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "max_position_embeddings",
                "mamba_n_heads",
                "mamba_d_head",
                "mamba_n_groups",
                "mamba_d_state",
                "mamba_expand",
                "mamba_chunk_size",
            ),
        )
        if self.head_dim is not None:
            check_positive_ints(self, ("head_dim",))
        check_bools(
            self, ("tie_word_embeddings", "attention_bias", "mamba_conv_bias", "mamba_proj_bias")
        )
        self._check_layers()
        self._check_experts()
        check_mamba_shape(
            hidden=self.hidden_size,
            heads=self.mamba_n_heads,
            head_dim=self.mamba_d_head,
            groups=self.mamba_n_groups,
            conv=self.mamba_d_conv,
            inter=self.mamba_expand * self.hidden_size,
        )
        check_attention_heads(self.num_attention_heads, self.num_key_value_heads)
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(
                f"config field hidden_act={self.hidden_act!r} is not supported: Granite's conv, "
                "shared MLP and expert activation is silu"
            )
        if self.position_embedding_type not in _POSITION_TYPES:
            raise ValueError(
                f"config field position_embedding_type={self.position_embedding_type!r} is not "
                "supported: give 'rope', 'nope' or null (no positional encoding)"
            )
        if self.use_rope and (self.attention_head_dim < 2 or self.attention_head_dim % 2):
            raise ValueError(f"config: the rotary size {self.attention_head_dim} must be even")
        if self.logits_scaling == 0:
            raise ValueError("config field logits_scaling must not be 0 (the logits' divisor)")

    def _check_layers(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"config field layer_types lists {len(self.layer_types)} layers, but "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        if "mamba" not in self.layer_types:
            raise ValueError(
                "config: a GraniteMoeHybrid model needs at least one Mamba layer ('mamba' in "
                "layer_types); the all-attention Granite-4.0 models are not served"
            )

    def _check_experts(self) -> None:
        n = self.num_local_experts
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(
                f"config field num_local_experts must be an integer >= 0 (0: no experts), got {n!r}"
            )
        if n:
            check_positive_ints(self, ("intermediate_size", "num_experts_per_tok"))
            if self.num_experts_per_tok > n:
                raise ValueError(
                    f"config field num_experts_per_tok={self.num_experts_per_tok} exceeds "
                    f"num_local_experts={n}"
                )

    # -- reading config.json -------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GraniteMoeHybridModelConfig:
        check_required(raw, ("hidden_size", "num_hidden_layers", "vocab_size"))
        kwargs = fields_from_dict(
            cls,
            raw,
            aliases={"layer_types": ("layers_block_type",)},
            floats=("rms_norm_eps",),
        )
        if kwargs.get("position_embedding_type") == "rope":
            # transformers' Granite RoPE rotates the whole head (it reads no partial factor)
            kwargs["rope_theta"] = rope_settings(raw)["rope_theta"]
        return cls(**kwargs)


# The ibm-granite/granite-4.0-h-tiny shape (40 layers, attention at 5, 15, 25, 35; 64
# experts, 6 per token; no positional encoding), written from its published config.json
# without a download in this session: check it against the hub's file before quoting
# figures measured on it.
GRANITE_4_0_H_TINY = dict(
    vocab_size=100352,
    hidden_size=1536,
    intermediate_size=512,
    shared_intermediate_size=1024,
    num_hidden_layers=40,
    num_attention_heads=12,
    num_key_value_heads=4,
    layer_types=tuple("attention" if i % 10 == 5 else "mamba" for i in range(40)),
    num_local_experts=64,
    num_experts_per_tok=6,
    mamba_n_heads=48,
    mamba_d_head=64,
    mamba_n_groups=1,
    mamba_d_state=128,
    mamba_expand=2,
    mamba_chunk_size=256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    attention_multiplier=0.0078125,
    logits_scaling=6.0,
    position_embedding_type="nope",
    tie_word_embeddings=True,
)
