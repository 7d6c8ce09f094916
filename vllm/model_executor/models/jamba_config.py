"""The Jamba configuration, read from HF transformers' ``JambaConfig`` fields.

Field names and defaults are ``JambaConfig``'s (transformers 5.17 and 5.24 name and default
them alike), so ``JambaModelConfig()`` is its default shape, that of ai21labs/Jamba-v0.1
(``JAMBA_V0_1`` below spells it out). The layer plan is the config's two periodic
patterns, as transformers derives them:

- layer i is an attention layer when ``i % attn_layer_period == attn_layer_offset``, else a
  Mamba1 layer (``layer_types``);
- layer i's feed-forward is a mixture of ``num_experts`` experts when ``num_experts > 1``
  and ``i % expert_layer_period == expert_layer_offset``, else a dense SwiGLU MLP
  (``moe_layers``); both are ``intermediate_size`` wide.

``mamba_dt_rank="auto"`` means ceil(hidden_size / 16); ``num_local_experts`` is read as
``num_experts`` (transformers' attribute map), the remote-code configs' ``n_ctx`` as
``max_position_embeddings``, and their ``mamba_inner_layernorms`` must not be false (the
norms on dt, B and C are always there, as in transformers). Fields that do not change
inference (``use_mamba_kernels``, ``router_aux_loss_coef``, initialisation, token ids,
``calc_logits_for_entire_prompt``, ...) are accepted and ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.model_executor.layers.linear import qkv_tp_problems
from vllm.model_executor.layers.mamba.mamba_mixer import Mamba1Shape, mamba1_tp_problems
from vllm.model_executor.models.config_utils import (
    AttentionShape,
    ModelShapes,
    check_attention_heads,
    check_bools,
    check_positive_ints,
    check_required,
    fields_from_dict,
)


@dataclass(frozen=True)
class JambaModelConfig(ModelShapes):
    architecture: ClassVar[str] = "JambaForCausalLM"
    model_type: ClassVar[str] = "jamba"

    vocab_size: int = 65536
    tie_word_embeddings: bool = False
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    num_experts_per_tok: int = 2
    num_experts: int = 16
    expert_layer_period: int = 2
    expert_layer_offset: int = 1
    attn_layer_period: int = 8
    attn_layer_offset: int = 4
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_dt_rank: int | str = "auto"
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    dtype: str | None = None
    layer_types: tuple[str, ...] = field(init=False)
    moe_layers: tuple[bool, ...] = field(init=False)

    def __post_init__(self):
        # Normalised forms (the dataclass is frozen: set through object.__setattr__).
        if self.mamba_dt_rank == "auto" and isinstance(self.hidden_size, int):
            object.__setattr__(self, "mamba_dt_rank", math.ceil(self.hidden_size / 16))
        check_positive_ints(
            self,
            ("num_hidden_layers", "attn_layer_period", "expert_layer_period", "num_experts"),
        )
        for name in ("attn_layer_offset", "expert_layer_offset"):
            offset, period = getattr(self, name), getattr(self, name.replace("offset", "period"))
            if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
                raise ValueError(
                    f"config field {name}={offset!r} must be an integer in [0, "
                    f"{name.replace('offset', 'period')}={period})"
                )
        n, attn_p, attn_o = self.num_hidden_layers, self.attn_layer_period, self.attn_layer_offset
        types = tuple("attention" if i % attn_p == attn_o else "mamba" for i in range(n))
        object.__setattr__(self, "layer_types", types)
        moe = tuple(
            self.num_experts > 1 and i % self.expert_layer_period == self.expert_layer_offset
            for i in range(n)
        )
        object.__setattr__(self, "moe_layers", moe)
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_expand * self.hidden_size

    @property
    def chunk_size(self) -> None:
        """No chunked scan: the Mamba1 layers scan whole (the metadata builder's None)."""
        return None

    def mamba1_shape(self) -> Mamba1Shape:
        return Mamba1Shape(
            hidden_size=self.hidden_size,
            intermediate_size=self.mamba_intermediate_size,
            state_size=self.mamba_d_state,
            conv_kernel=self.mamba_d_conv,
            time_step_rank=self.mamba_dt_rank,
            use_bias=self.mamba_proj_bias,
            use_conv_bias=self.mamba_conv_bias,
            bcdt_rms_eps=self.rms_norm_eps,
            bcdt_norm_weights=True,
        )

    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.num_attention_heads, self.num_key_value_heads, self.head_dim)

    def mlp_size(self) -> int:
        """The dense MLPs' and every expert's intermediate size."""
        return self.intermediate_size

    def tp_problems(self, tp_size: int) -> list[str]:
        """The Mamba1 channels, the attention heads and the MLPs' (and experts')
        intermediate features shard; the vocabulary is padded per rank."""
        problems = mamba1_tp_problems(
            self.mamba_intermediate_size, tp_size, "mamba_expand * hidden_size"
        )
        problems += qkv_tp_problems(self.num_attention_heads, self.num_key_value_heads, tp_size)
        if self.intermediate_size % tp_size:
            problems.append(
                f"intermediate_size={self.intermediate_size} is not divisible by tp_size={tp_size}"
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
                "num_attention_heads",
                "num_key_value_heads",
                "num_experts_per_tok",
                "mamba_d_state",
                "mamba_expand",
                "mamba_dt_rank",
            ),
        )
        check_bools(self, ("mamba_conv_bias", "mamba_proj_bias", "tie_word_embeddings"))
        if not self.rms_norm_eps > 0:
            raise ValueError(f"config field rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        check_attention_heads(self.num_attention_heads, self.num_key_value_heads)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"config: hidden_size={self.hidden_size} must be a multiple of "
                f"num_attention_heads={self.num_attention_heads} (Jamba's head size)"
            )
        if any(self.moe_layers) and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"config field num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"num_experts={self.num_experts}"
            )
        if not 2 <= self.mamba_d_conv <= 8:
            raise ValueError(
                f"config field mamba_d_conv={self.mamba_d_conv} is not supported (the conv "
                "kernels take widths 2..8)"
            )
        if "mamba" not in self.layer_types:
            raise ValueError(
                "config: attn_layer_period / attn_layer_offset leave no Mamba layer; a Jamba "
                "model needs at least one"
            )
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(
                f"config field hidden_act={self.hidden_act!r} is not supported: Jamba's conv "
                "and MLP activation is silu"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> JambaModelConfig:
        """From the fields of an HF ``config.json``."""
        check_required(raw, ("hidden_size", "num_hidden_layers", "vocab_size"))
        if raw.get("mamba_inner_layernorms") is False:
            raise ValueError(
                "config field mamba_inner_layernorms=false is not supported: transformers' "
                "Jamba (and every released checkpoint) has the norms on dt, B and C"
            )
        aliases = {"num_experts": ("num_local_experts",), "max_position_embeddings": ("n_ctx",)}
        kwargs = fields_from_dict(cls, raw, aliases=aliases, floats=("rms_norm_eps",))
        if "num_key_value_heads" in raw and raw["num_key_value_heads"] is None:
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 32)  # as HF
        return cls(**kwargs)


# ai21labs/Jamba-v0.1 (transformers' defaults, spelled out): 32 layers, attention at 4, 12,
# 20, 28; 16 experts, top 2, on every odd layer; dt rank 256 = ceil(4096 / 16).
JAMBA_V0_1 = dict(
    vocab_size=65536,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_experts=16,
    num_experts_per_tok=2,
    expert_layer_period=2,
    expert_layer_offset=1,
    attn_layer_period=8,
    attn_layer_offset=4,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_dt_rank=256,
    max_position_embeddings=262144,
)
