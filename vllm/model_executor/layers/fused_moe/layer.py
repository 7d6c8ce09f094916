"""``FusedMoE``: a layer of routed experts on the fused Triton op, sharded over the
tensor-parallel group by the experts' intermediate dimension.

Weights (this rank's part; I_r = intermediate_size / tp_size):

- ``w13_weight`` (E, 2 I_r, H): per expert, the rank's rows of W_gate then its rows of
  W_up (``is_act_and_mul``); (E, I_r, H), the rank's rows of W_up, for experts without a
  gate (Nemotron-H's relu^2 MLP);
- ``w2_weight`` (E, H, I_r): per expert, the rank's columns of W_down;
- ``e_score_correction_bias`` (E,) fp32 when the router uses one (replicated).

Each rank computes its partial sum of every expert's output (the down projection's
columns are split like the up rows) and ``forward`` all-reduces it (``reduce_results``),
as a row-parallel linear does. A shared expert is the model's own MLP beside this layer.
The router's logits come from the model's gate (a replicated linear): ``forward(hidden,
router_logits)``.

Checkpoints store experts in three ways; ``expert_weight_target`` maps each tail of a
checkpoint name to (parameter, shard id) for ``load_model_weights``:

- per-expert tensors (Jamba's and Nemotron-H's files): ``experts.<e>.gate_proj.weight``
  (I, H), ``experts.<e>.up_proj.weight`` (I, H), ``experts.<e>.down_proj.weight`` (H, I);
  shard ids ``(e, "gate")``, ``(e, "up")``, ``(e, "down")``;
- stacked, as transformers 5 names them in memory: ``experts.gate_up_proj`` (E, 2I, H),
  ``experts.up_proj`` (E, I, H) without a gate, ``experts.down_proj`` (E, H, I);
- stacked, as Granite-4.0-H's files hold them: ``input_linear.weight`` (E, 2I, H) and
  ``output_linear.weight`` (E, H, I).

Every loader reads only this rank's rows or columns of the full tensor (a lazy
``CheckpointSlice`` reads only those from the file).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from vllm.distributed.communication_op import tensor_model_parallel_all_reduce
from vllm.distributed.parallel_state import get_tp_group
from vllm.model_executor.layers.fused_moe.fused_moe import fused_moe
from vllm.model_executor.layers.fused_moe.fused_moe_kernels import ACTIVATIONS
from vllm.model_executor.layers.fused_moe.router import check_router_options
from vllm.model_executor.layers.linear import (
    check_full_shape,
    copy_into,
    read_range,
    replicated_weight_loader,
)

_PER_EXPERT = re.compile(r"(?:^|\.)experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = {
    "experts.gate_up_proj": "w13_weight",
    "experts.up_proj": "w13_weight",
    "experts.down_proj": "w2_weight",
    "input_linear.weight": "w13_weight",
    "output_linear.weight": "w2_weight",
}
_PART = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def expert_weight_target(name: str) -> tuple[str, tuple[int, str] | None] | None:
    """(our parameter's name relative to the ``FusedMoE``, shard id) for a checkpoint name
    ending in one of the module docstring's forms (the model strips or maps the prefix);
    None for any other name."""
    m = _PER_EXPERT.search(name)
    if m:
        part = _PART[m.group(2)]
        return ("w2_weight" if part == "down" else "w13_weight"), (int(m.group(1)), part)
    for tail, param in _STACKED.items():
        if name == tail or name.endswith("." + tail):
            return param, None
    return None


class FusedMoE(nn.Module):
    """``num_experts`` routed experts of ``hidden_size`` -> ``intermediate_size`` ->
    ``hidden_size``; the router options are ``router.select_experts``'s, the activation
    ``"silu"`` (gated, SiLU-and-mul) or ``"relu2"`` with ``is_act_and_mul=False``."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: str = "silu",
        is_act_and_mul: bool = True,
        scoring: str = "softmax",
        renormalize: bool = False,
        use_correction_bias: bool = False,
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        reduce_results: bool = True,
        dtype: torch.dtype | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ):
        super().__init__()
        check_router_options(num_experts, top_k, scoring, num_expert_group, topk_group)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
        tp = get_tp_group()
        self.tp_rank = tp.rank if tp_rank is None else tp_rank
        self.tp_size = tp.world_size if tp_size is None else tp_size
        if intermediate_size % self.tp_size:
            raise ValueError(
                f"intermediate_size={intermediate_size} (the experts' intermediate dimension, "
                f"which tensor parallelism shards) is not divisible by tp_size={self.tp_size}"
            )
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.local_intermediate = intermediate_size // self.tp_size
        self.activation, self.is_act_and_mul = activation, is_act_and_mul
        self.router_options = dict(
            scoring=scoring,
            renormalize=renormalize,
            num_expert_group=num_expert_group,
            topk_group=topk_group,
            routed_scaling_factor=routed_scaling_factor,
        )
        self.reduce_results = reduce_results
        self.parts = ("gate", "up") if is_act_and_mul else ("up",)
        n_parts, loc = len(self.parts), self.local_intermediate
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, n_parts * loc, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, loc, dtype=dtype), requires_grad=False
        )
        self.w13_weight.full_shape = (num_experts, n_parts * intermediate_size, hidden_size)
        self.w2_weight.full_shape = (num_experts, hidden_size, intermediate_size)
        one = (intermediate_size, hidden_size)
        self.w13_weight.shard_shapes = {(e, p): one for e in range(num_experts) for p in self.parts}
        self.w2_weight.shard_shapes = {
            (e, "down"): (hidden_size, intermediate_size) for e in range(num_experts)
        }
        self.w13_weight.weight_loader = self.load_w13
        self.w2_weight.weight_loader = self.load_w2
        if use_correction_bias:
            bias = torch.zeros(num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
            self.e_score_correction_bias.weight_loader = replicated_weight_loader
        else:
            self.e_score_correction_bias = None

    # -- weights ------------------------------------------------------------------------

    def _rows(self) -> tuple[int, int]:
        start = self.tp_rank * self.local_intermediate
        return start, start + self.local_intermediate

    def load_w13(self, param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        """``w13_weight``'s loader: the stacked (E, parts * I, H) tensor (``shard_id``
        None) or expert e's (I, H) ``(e, "gate")`` / ``(e, "up")``; this rank's rows."""
        start, stop = self._rows()
        loc, inter = self.local_intermediate, self.intermediate_size
        if shard_id is None:
            check_full_shape(loaded_weight, self.w13_weight.full_shape, "FusedMoE w13_weight")
            for i in range(len(self.parts)):
                rows = read_range(loaded_weight, 1, i * inter + start, i * inter + stop)
                copy_into(param[:, i * loc : (i + 1) * loc], rows)
            return
        expert, part = self._check_shard(shard_id, self.parts)
        check_full_shape(loaded_weight, (inter, self.hidden_size), f"expert {expert} {part}")
        i = self.parts.index(part)
        rows = read_range(loaded_weight, 0, start, stop)
        copy_into(param[expert, i * loc : (i + 1) * loc], rows)

    def load_w2(self, param: nn.Parameter, loaded_weight, shard_id=None) -> None:
        """``w2_weight``'s loader: the stacked (E, H, I) tensor (``shard_id`` None) or
        expert e's (H, I) ``(e, "down")``; this rank's columns."""
        start, stop = self._rows()
        if shard_id is None:
            check_full_shape(loaded_weight, self.w2_weight.full_shape, "FusedMoE w2_weight")
            copy_into(param, read_range(loaded_weight, 2, start, stop))
            return
        expert, _ = self._check_shard(shard_id, ("down",))
        check_full_shape(
            loaded_weight, (self.hidden_size, self.intermediate_size), f"expert {expert} down"
        )
        copy_into(param[expert], read_range(loaded_weight, 1, start, stop))

    def _check_shard(self, shard_id, parts: tuple[str, ...]) -> tuple[int, str]:
        ok = (
            isinstance(shard_id, tuple)
            and len(shard_id) == 2
            and isinstance(shard_id[0], int)
            and 0 <= shard_id[0] < self.num_experts
            and shard_id[1] in parts
        )
        if not ok:
            raise ValueError(
                f"shard_id must be (expert in [0, {self.num_experts}), one of {parts}) or "
                f"None, got {shard_id!r}"
            )
        return shard_id

    # -- forward ------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """(tokens, H) -> (tokens, H): the experts' routing-weighted sum (all-reduced over
        the ranks when ``reduce_results``)."""
        out = fused_moe(
            hidden_states,
            self.w13_weight,
            self.w2_weight,
            router_logits,
            self.top_k,
            self.activation,
            self.is_act_and_mul,
            correction_bias=self.e_score_correction_bias,
            **self.router_options,
        )
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size} (local {self.local_intermediate}), "
            f"activation={self.activation}, act_and_mul={self.is_act_and_mul}, "
            f"tp={self.tp_rank}/{self.tp_size}"
        )
