"""Mixture-of-experts: the router, the fused Triton op and the ``FusedMoE`` layer
(``docs/fused_moe.md``). The op with its router is ``fused_moe.fused_moe``, not exported
here, where its name would hide its module."""

from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
from vllm.model_executor.layers.fused_moe.layer import FusedMoE, expert_weight_target
from vllm.model_executor.layers.fused_moe.router import select_experts

__all__ = ["FusedMoE", "expert_weight_target", "fused_experts", "select_experts"]
