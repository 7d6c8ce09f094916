"""The router options against transformers 5.24's routers (Granite-4.0-H, Jamba,
Nemotron-H) and against hand-checked cases, and its argument errors.

The HF routers compute logits = hidden @ W^T; with W = [I_E | 0] and the token's first E
features set to tie-free logits, both sides route exactly the logits we chose.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GraniteMoeHybridConfig, JambaConfig, NemotronHConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    GraniteMoeHybridTopKRouter,
)
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

from tests.kernels.moe.moe_utils import as_rows, gen_for, grouped_scores, logit, tie_free_logits
from vllm.model_executor.layers.fused_moe.router import select_experts

try:  # in transformers 5.24 (here); absent from 5.17 (the GPU box)
    from transformers.models.jamba.modeling_jamba import JambaTopKRouter
except ImportError:
    JambaTopKRouter = None

HIDDEN, TOKENS = 24, 9


def _hidden_for(logits: torch.Tensor) -> torch.Tensor:
    gen = gen_for("router-hidden", tuple(logits.shape))
    hidden = torch.randn(logits.shape[0], HIDDEN, generator=gen)
    hidden[:, : logits.shape[1]] = logits
    return hidden


def _set_identity(router: torch.nn.Module, num_experts: int) -> None:
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, :num_experts] = torch.eye(num_experts)


def _assert_same_routing(hf_ids, hf_weights, ids, weights) -> None:
    hf_ids, hf_weights = as_rows(hf_ids, hf_weights)
    ids, weights = as_rows(ids, weights)
    assert torch.equal(hf_ids, ids)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_granite_router_is_softmax_renormalized(top_k):
    num_experts = 8
    config = GraniteMoeHybridConfig(
        hidden_size=HIDDEN, num_local_experts=num_experts, num_experts_per_tok=top_k,
        mamba_n_heads=4, mamba_d_head=12,
    )  # fmt: skip
    router = GraniteMoeHybridTopKRouter(config)
    _set_identity(router, num_experts)
    logits = tie_free_logits(TOKENS, num_experts, gen_for("granite", top_k))
    _, hf_weights, hf_ids = router(_hidden_for(logits))
    weights, ids = select_experts(logits, top_k, scoring="softmax", renormalize=True)
    _assert_same_routing(hf_ids, hf_weights, ids, weights)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.skipif(
    JambaTopKRouter is None,
    reason="this transformers (5.17 on the GPU box) has no JambaTopKRouter; 5.24 here tests it",
)
def test_jamba_router_is_softmax_unnormalized(top_k):
    num_experts = 6
    config = JambaConfig(hidden_size=HIDDEN, num_experts=num_experts, num_experts_per_tok=top_k)
    router = JambaTopKRouter(config)
    _set_identity(router, num_experts)
    logits = tie_free_logits(TOKENS, num_experts, gen_for("jamba", top_k))
    _, hf_weights, hf_ids = router(_hidden_for(logits))
    weights, ids = select_experts(logits, top_k, scoring="softmax", renormalize=False)
    _assert_same_routing(hf_ids, hf_weights, ids, weights)
    assert weights.sum(-1).max() < 1  # not renormalised


@pytest.mark.parametrize(
    "n_group, topk_group, top_k, norm, scale",
    [(4, 2, 3, True, 2.5), (4, 1, 2, False, 1.0), (2, 1, 1, True, 1.0)],
)
def test_nemotron_router_grouped_sigmoid(n_group, topk_group, top_k, norm, scale):
    num_experts = 2 * n_group
    config = NemotronHConfig(
        hidden_size=HIDDEN,
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
    )
    router = NemotronHTopkRouter(config)
    _set_identity(router, num_experts)
    logits = logit(grouped_scores(TOKENS, n_group, gen_for("nemotron", n_group, top_k)))
    _, hf_weights, hf_ids = router(_hidden_for(logits))
    weights, ids = select_experts(
        logits, top_k, scoring="sigmoid", renormalize=norm, num_expert_group=n_group,
        topk_group=topk_group, routed_scaling_factor=scale,
    )  # fmt: skip
    _assert_same_routing(hf_ids, hf_weights, ids, weights)
    # The masking mattered: somewhere the best expert overall was not chosen.
    if topk_group == 1:
        best = logits.argmax(dim=-1, keepdim=True).to(torch.int32)
        assert not (ids == best).any()  # the best expert sits in the runner-up group


def test_nemotron_router_correction_bias_chooses_but_does_not_weigh():
    num_experts, top_k = 8, 2
    config = NemotronHConfig(
        hidden_size=HIDDEN, n_routed_experts=num_experts, num_experts_per_tok=top_k,
        n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.7,
    )  # fmt: skip
    router = NemotronHTopkRouter(config)
    _set_identity(router, num_experts)
    # Experts 1, 4 and 6 get +2: every token's choice is its best two of those three
    # (sigmoid scores < 1 apart, so the bias decides), ordered by their distinct scores.
    bias = torch.zeros(num_experts)
    bias[[1, 4, 6]] = 2.0
    router.e_score_correction_bias.copy_(bias)
    logits = tie_free_logits(TOKENS, num_experts, gen_for("bias"))
    _, hf_weights, hf_ids = router(_hidden_for(logits))
    weights, ids = select_experts(
        logits, top_k, scoring="sigmoid", renormalize=True, correction_bias=bias,
        num_expert_group=1, topk_group=1, routed_scaling_factor=1.7,
    )  # fmt: skip
    _assert_same_routing(hf_ids, hf_weights, ids, weights)
    assert set(ids.flatten().tolist()) <= {1, 4, 6}


def test_hand_checked_group_choice_uses_the_two_best_scores():
    # Groups {0,1,2} and {3,4,5}. Group A's max (0.9) beats B's (0.6), but B's two best
    # (0.6 + 0.5 = 1.1) beat A's (0.9 + 0.05 = 0.95): B is the group, experts 3 and 4.
    scores = torch.tensor([[0.9, 0.05, 0.04, 0.6, 0.5, 0.01]])
    weights, ids = select_experts(
        logit(scores), 2, scoring="sigmoid", renormalize=True, num_expert_group=2,
        topk_group=1, routed_scaling_factor=2.0,
    )  # fmt: skip
    ids, weights = as_rows(ids, weights)
    assert ids.tolist() == [[3, 4]]
    torch.testing.assert_close(weights, torch.tensor([[1.2 / 1.1, 1.0 / 1.1]]))
    # Without groups the best two overall: experts 0 and 3, weights unnormalised.
    weights, ids = select_experts(logit(scores), 2, scoring="sigmoid")
    ids, weights = as_rows(ids, weights)
    assert ids.tolist() == [[0, 3]]
    torch.testing.assert_close(weights, torch.tensor([[0.9, 0.6]]))


def test_hand_checked_softmax():
    logits = torch.tensor([[0.0, math.log(2.0), math.log(3.0), math.log(4.0)]])
    weights, ids = select_experts(logits, 2)  # softmax over 1 + 2 + 3 + 4 = 10
    ids, weights = as_rows(ids, weights)
    assert ids.tolist() == [[2, 3]] and ids.dtype == torch.long
    torch.testing.assert_close(weights, torch.tensor([[0.3, 0.4]]))
    weights, _ = select_experts(logits, 2, renormalize=True, routed_scaling_factor=0.5)
    torch.testing.assert_close(weights.sort().values, torch.tensor([[3 / 14, 4 / 14]]))
    assert select_experts(logits, 2)[1].dtype == torch.int32


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(top_k=5), "top_k"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=1, scoring="relu"), "scoring"),
        (dict(top_k=1, num_expert_group=3, topk_group=1), "num_expert_group=3"),
        (dict(top_k=1, num_expert_group=2), "topk_group"),
        (dict(top_k=1, num_expert_group=2, topk_group=3), "topk_group"),
        (dict(top_k=3, num_expert_group=2, topk_group=1), "top_k=3"),
        (dict(top_k=1, correction_bias=torch.zeros(3)), "correction_bias"),
    ],
)
def test_errors_name_the_argument(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        select_experts(torch.zeros(2, 4), **kwargs)
    with pytest.raises(ValueError, match="router_logits"):
        select_experts(torch.zeros(4), 1)
