"""Helpers of the Nemotron-H MoE tests: a tiny transformers ``NemotronHForCausalLM`` with
"moe" layers (seeded, every weight perturbed, the router's correction bias too) and the
routing margins that make ties impossible for the sequences a test feeds it.

Why margins: the router picks experts by comparing scores, so a near-tie between the
k-th and the (k+1)-th expert (or the last kept and the first dropped group) could flip
between HF and us on rounding alone (our fp32 hidden states differ from HF's by ~1e-6).
A test asserts that, for every token it routes, each such gap in HF's own router exceeds
``MIN_MARGIN``, a hundred times that rounding: a failing choice then means a bug.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.models.hf_builders import make_nemotron_h_hf
from tests.models.hybrid_utils import check_no_kv_leak, engine, hf_greedy, tokens
from tests.models.mamba2_utils import gen_for
from vllm import SamplingParams

MOE_PATTERN = "ME*M-E"  # Mamba2, MoE, attention, Mamba2, MLP, MoE
# 8 experts in 4 groups of 2, 2 groups kept, 3 experts per token; the shared expert wider
MOE_SHAPE = dict(
    n_routed_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=24,
    moe_shared_expert_intermediate_size=40,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)
MIN_MARGIN = 1e-4


@torch.no_grad()
def make_nemotron_h_moe_hf(seed: int = 0, pattern: str = MOE_PATTERN, **overrides):
    """transformers' NemotronH with MoE layers, every parameter perturbed
    (``hybrid_utils.perturb``) and each router's ``e_score_correction_bias`` (a buffer,
    which perturb does not reach) drawn at the scale of the scores' spread, so that it
    changes some choices."""
    hf = make_nemotron_h_hf(seed=seed, pattern=pattern, **{**MOE_SHAPE, **overrides})
    gen = gen_for("nemotron-moe-bias", seed)
    for _, gate in routers(hf):
        gate.e_score_correction_bias.copy_(0.1 * torch.randn(gate.num_experts, generator=gen))
    return hf


def routers(hf) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, ``NemotronHTopkRouter``) of every MoE layer of an HF model."""
    return [
        (i, layer.mixer.gate)
        for i, layer in enumerate(hf.model.layers)
        if layer.block_type == "moe"
    ]


def _gap(values: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the k-th largest value minus the (k+1)-th (inf when there is none)."""
    if k >= values.shape[-1]:
        return torch.full(values.shape[:-1], float("inf"))
    top = values.topk(k + 1, dim=-1).values
    return top[..., k - 1] - top[..., k]


def router_margins(gate, hidden: torch.Tensor) -> torch.Tensor:
    """Per token (rows of ``hidden``, the router's input), the smallest of its two gaps
    in HF's ``NemotronHTopkRouter`` arithmetic: kept vs dropped group (groups scored by
    the sum of their two best biased scores), then chosen vs next expert among the kept
    groups' experts (-inf elsewhere, so a gap to -inf is inf)."""
    scores = F.linear(hidden.reshape(-1, gate.hidden_dim).float(), gate.weight.float()).sigmoid()
    choice = scores + gate.e_score_correction_bias
    tokens, experts, groups = choice.shape[0], gate.num_experts, gate.num_group
    group_gap = torch.full((tokens,), float("inf"))
    if groups > 1:
        per_group = choice.view(tokens, groups, experts // groups)
        group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)
        group_gap = _gap(group_scores, gate.topk_group)
        keep = group_scores.topk(gate.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        mask = mask.unsqueeze(-1).expand_as(per_group).reshape(tokens, experts)
        choice = choice.masked_fill(~mask, float("-inf"))
    return torch.minimum(group_gap, _gap(choice, gate.top_k))


@torch.no_grad()
def min_routing_margin(hf, sequences: list[list[int]]) -> float:
    """The smallest router margin over every MoE layer and every token of ``sequences``,
    each run through HF's full forward."""
    seen: list[tuple] = []
    hooks = [
        gate.register_forward_pre_hook(lambda mod, args: seen.append((mod, args[0])))
        for _, gate in routers(hf)
    ]
    try:
        for seq in sequences:
            hf(torch.tensor([seq]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    assert seen, "the model has no MoE layer"
    return min(router_margins(gate, hidden).min().item() for gate, hidden in seen)


def check_routing_margins(hf, sequences: list[list[int]]) -> None:
    margin = min_routing_margin(hf, sequences)
    assert margin > MIN_MARGIN, (
        f"a router near-tie (margin {margin:.2e} <= {MIN_MARGIN:.0e}) in the test's own data: "
        "pick another seed, the comparison would hinge on rounding"
    )


def check_generate_matches_hf_tie_free(path, hf, device="cpu", max_tokens: int = 5) -> None:
    """``LLM.generate``'s greedy tokens for prompts of several lengths sent together
    (chunked prefill beside decodes under a 16-token budget) equal HF ``generate``'s, the
    routing of every prompt and HF continuation first checked tie-free; no KV block
    leaks."""
    prompts = [tokens(n, "moe-gen", n) for n in (3, 17, 1, 9)]
    expected = [hf_greedy(hf, p, max_tokens) for p in prompts]
    check_routing_margins(hf, [p + e for p, e in zip(prompts, expected, strict=True)])
    llm = engine(path, device)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, want, out in zip(prompts, expected, outs, strict=True):
        assert out.outputs[0].token_ids == want, f"prompt of {len(prompt)} tokens"
    check_no_kv_leak(llm)
