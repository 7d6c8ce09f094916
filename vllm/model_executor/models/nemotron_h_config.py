"""The NemotronH configuration, read from HF transformers' ``NemotronHConfig`` fields.

Field names and defaults are ``NemotronHConfig``'s. The layer kinds come from
``layers_block_type`` (transformers 5: "linear_attention", "full_attention", "mlp",
"moe"; the older "mamba" and "attention" are read as transformers remaps them) or, where
that is absent, from ``hybrid_override_pattern`` (one character per layer: ``M`` Mamba2,
``*`` attention, ``-`` MLP, ``E`` MoE). The MoE fields (``n_routed_experts``,
``num_experts_per_tok``, ``moe_intermediate_size``, ``moe_shared_expert_intermediate_size``,
``moe_latent_size``, ``n_group``, ``topk_group``, ``norm_topk_prob``,
``routed_scaling_factor``) are checked only when a layer is "moe": a dense checkpoint's
unused defaults never refuse it. ``moe_shape()`` is their normalised view. The older key
names transformers still accepts (``mamba_n_groups``,
``mamba_d_conv``, ``mamba_dt_min``, ``mamba_conv_bias``, ``mamba_chunk_size``) win over the
new ones, as in ``NemotronHConfig.__post_init__``.
"""

from __future__ import annotations

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
class NemotronHMoEShape:
    """What a "moe" layer is built from: ``num_experts`` routed relu2 experts of
    ``intermediate_size`` (on ``latent_size`` features when set, else the hidden size),
    ``top_k`` per token by the sigmoid router (groups ``n_group``/``topk_group``, None for
    one group), one shared relu2 expert of ``shared_intermediate_size``."""

    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    latent_size: int | None
    num_expert_group: int | None
    topk_group: int | None
    renormalize: bool
    routed_scaling_factor: float


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
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    n_shared_experts: int = 1
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
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

    def mlp_size(self) -> int | None:
        return self.intermediate_size if "mlp" in self.layer_types else None

    def moe_shape(self) -> NemotronHMoEShape | None:
        """The MoE layers' shape (None: the model has none)."""
        if "moe" not in self.layer_types:
            return None
        grouped = self.n_group > 1
        return NemotronHMoEShape(
            num_experts=self.n_routed_experts,
            top_k=self.num_experts_per_tok,
            intermediate_size=self.moe_intermediate_size,
            shared_intermediate_size=self.moe_shared_expert_intermediate_size,
            latent_size=self.moe_latent_size,
            num_expert_group=self.n_group if grouped else None,
            topk_group=self.topk_group if grouped else None,
            renormalize=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def tp_problems(self, tp_size: int) -> list[str]:
        problems = super().tp_problems(tp_size)
        moe = self.moe_shape()
        if moe is not None:
            for name in ("moe_intermediate_size", "moe_shared_expert_intermediate_size"):
                if getattr(self, name) % tp_size:
                    problems.append(
                        f"{name}={getattr(self, name)} is not divisible by tp_size={tp_size}"
                    )
        return problems

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
            self._validate_moe()
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
                "(NemotronH's MLPs and experts are relu2: squared ReLU)"
            )
        if self.mamba_hidden_act not in ("silu", "swish"):
            raise ValueError(
                f"config field mamba_hidden_act={self.mamba_hidden_act!r} is not supported: "
                "the Mamba2 conv activation is silu"
            )
        if not self.time_step_min >= 0:
            raise ValueError(f"config field time_step_min={self.time_step_min} must be >= 0")

    def _validate_moe(self) -> None:
        check_positive_ints(
            self,
            (
                "n_routed_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
                "moe_shared_expert_intermediate_size",
                "n_group",
                "topk_group",
            ),
        )
        check_bools(self, ("norm_topk_prob",))
        if self.moe_latent_size is not None:
            check_positive_ints(self, ("moe_latent_size",))
        if self.n_shared_experts != 1:
            # transformers builds one shared expert of moe_shared_expert_intermediate_size
            # whatever this says, upstream vLLM one of n times that size: no agreed meaning.
            raise ValueError(
                f"config field n_shared_experts={self.n_shared_experts!r} is not supported "
                "(NemotronH MoE has one shared expert of moe_shared_expert_intermediate_size)"
            )
        experts, groups = self.n_routed_experts, self.n_group
        if experts % groups:
            raise ValueError(
                f"config field n_group={groups} must divide n_routed_experts={experts}"
            )
        if self.topk_group > groups:
            raise ValueError(
                f"config field topk_group={self.topk_group} must be at most n_group={groups}"
            )
        allowed = self.topk_group * (experts // groups) if groups > 1 else experts
        if self.num_experts_per_tok > allowed:
            raise ValueError(
                f"config field num_experts_per_tok={self.num_experts_per_tok} exceeds the "
                f"{allowed} experts a token may choose from (n_routed_experts={experts}, "
                f"n_group={groups}, topk_group={self.topk_group})"
            )
        scale = self.routed_scaling_factor
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ValueError(
                f"config field routed_scaling_factor must be a positive number, got {scale!r}"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> NemotronHModelConfig:
        check_required(raw, ("hidden_size", "vocab_size"))
        raw = dict(raw)
        for old, new in _LEGACY_KEYS.items():
            if raw.get(old) is not None:
                raw[new] = raw[old]
        kwargs = fields_from_dict(
            cls, raw, floats=("layer_norm_epsilon", "time_step_min", "routed_scaling_factor")
        )
        kwargs["layer_types"] = layer_types_from(raw)
        return cls(**kwargs)
