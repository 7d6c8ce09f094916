"""Routing: which ``top_k`` experts each token goes to, and with what weight.

``select_experts(router_logits, top_k, ...)`` covers the routers of the hybrid MoE models
(transformers 5.24 as the oracle):

- Granite-4.0-H (``GraniteMoeHybridTopKRouter``): top-k of the logits, then a softmax over
  those k logits. That is ``scoring="softmax", renormalize=True`` (the softmax over all
  experts, renormalised over the chosen ones, is the same distribution).
- Jamba (``JambaTopKRouter``): softmax over all experts, top-k, weights left as they are:
  ``scoring="softmax", renormalize=False``.
- Nemotron-H MoE (``NemotronHTopkRouter``, DeepSeek-V3's routing): sigmoid scores; the
  experts are chosen on ``scores + correction_bias`` (the bias is used for the choice only,
  the weights are the unbiased scores); with ``num_expert_group``/``topk_group`` the
  experts are cut into groups, each group scored by the sum of its two best biased
  scores, and only the ``topk_group`` best groups may be chosen from; the chosen scores
  are renormalised (``renormalize``, HF's ``norm_topk_prob``) and multiplied by
  ``routed_scaling_factor``.
- Falcon-H1 has no experts (a dense MLP per layer): nothing to route.

Everything runs on the logits' device with torch ops whose output sizes depend on shapes
only (no host sync, CUDA-graph safe). Weights come back in fp32, ids in int32.
"""

from __future__ import annotations

import torch

SCORINGS = ("softmax", "sigmoid")


def check_router_options(
    num_experts: int,
    top_k: int,
    scoring: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
) -> None:
    """ValueError naming the option that does not fit ``num_experts`` experts."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    if (num_expert_group is None) != (topk_group is None):
        raise ValueError(
            "num_expert_group and topk_group go together: got "
            f"num_expert_group={num_expert_group}, topk_group={topk_group}"
        )
    if num_expert_group is None:
        return
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(
            f"num_expert_group={num_expert_group} must divide num_experts={num_experts}"
        )
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(
            f"topk_group must be in [1, num_expert_group={num_expert_group}], got {topk_group}"
        )
    allowed = topk_group * (num_experts // num_expert_group)
    if top_k > allowed:
        raise ValueError(
            f"top_k={top_k} exceeds the {allowed} experts of topk_group={topk_group} groups"
        )


def _group_mask(choice: torch.Tensor, num_groups: int, topk_group: int) -> torch.Tensor:
    """True for the experts of each token's ``topk_group`` best groups, a group scored by
    the sum of its two best choice scores (its only one for groups of one expert)."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, num_groups, experts // num_groups)
    best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    keep = best.topk(topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros_like(best, dtype=torch.bool).scatter_(1, keep, True)
    return mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = False,
    correction_bias: torch.Tensor | None = None,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights fp32 (tokens, top_k), topk_ids int32 (tokens, top_k)) for
    ``router_logits`` (tokens, num_experts); the options as in the module docstring. The
    order of a token's k experts is unspecified (compare them as sets)."""
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2:
        shape = getattr(router_logits, "shape", None)
        raise ValueError(f"router_logits must be (num_tokens, num_experts), got {shape}")
    num_experts = router_logits.shape[1]
    check_router_options(num_experts, top_k, scoring, num_expert_group, topk_group)
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores
    if correction_bias is not None:
        if tuple(correction_bias.shape) != (num_experts,):
            raise ValueError(
                f"correction_bias must be (num_experts={num_experts},), "
                f"got {tuple(correction_bias.shape)}"
            )
        choice = scores + correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        mask = _group_mask(choice, num_expert_group, topk_group)
        choice = choice.masked_fill(~mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)
