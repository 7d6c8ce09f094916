"""``FusedMoE`` against transformers 5.24's MoE blocks (Granite-4.0-H, Jamba, Nemotron-H),
its weight loaders (stacked and per-expert checkpoint tensors, through
``load_model_weights``), tensor-parallel shards and their errors.

The HF routers compute logits = hidden @ W^T; with W = [I_E | 0] and each token's first E
features set to tie-free logits, routing cannot tie. Weights are fp32 (the interpreter
runs the kernels on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GraniteMoeHybridConfig, JambaConfig, NemotronHConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMoE
from transformers.models.jamba.modeling_jamba import JambaSparseMoeBlock
from transformers.models.nemotron_h.modeling_nemotron_h import (
    NemotronHExperts,
    NemotronHTopkRouter,
)

from tests.kernels.moe.moe_utils import TOLERANCES, gen_for, grouped_scores, logit, tie_free_logits
from vllm.model_executor.layers.fused_moe import FusedMoE, expert_weight_target
from vllm.model_executor.model_loader.weight_utils import dummy_weights, load_model_weights

H, I, TOKENS = 32, 24, 11
TOL = TOLERANCES[torch.float32]


class Holder(nn.Module):
    """A model of one MoE layer, named ``moe``."""

    def __init__(self, moe: FusedMoE):
        super().__init__()
        self.moe = moe


def load(moe: FusedMoE, weights) -> None:
    """Checkpoint names -> the layer's parameters, as a model's name map does."""

    def to_param(name: str):
        if name.startswith("moe."):  # our own names (dummy weights)
            return name
        if name.endswith("e_score_correction_bias"):
            return "moe.e_score_correction_bias"
        target = expert_weight_target(name)
        return None if target is None else (f"moe.{target[0]}", target[1])

    load_model_weights(Holder(moe), weights, to_param)


def randomize(module: nn.Module, seed: str) -> None:
    gen = gen_for(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def routed_hidden(router_weight: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Hidden states whose logits under the (now identity) router are ``logits``."""
    num_experts = logits.shape[1]
    with torch.no_grad():
        router_weight.zero_()
        router_weight[:, :num_experts] = torch.eye(num_experts)
    hidden = torch.randn(logits.shape[0], H, generator=gen_for("hidden", num_experts))
    hidden[:, :num_experts] = logits
    return hidden


def per_expert(gate_up: torch.Tensor | None, up: torch.Tensor | None, down: torch.Tensor):
    """Per-expert checkpoint tensors (Jamba's and Nemotron-H's files) from stacked ones."""
    for e in range(down.shape[0]):
        if gate_up is not None:
            yield f"experts.{e}.gate_proj.weight", gate_up[e, :I]
            yield f"experts.{e}.up_proj.weight", gate_up[e, I:]
        else:
            yield f"experts.{e}.up_proj.weight", up[e]
        yield f"experts.{e}.down_proj.weight", down[e]


@pytest.mark.parametrize("names", ["hf", "granite-file"])
def test_granite_moe_block(names):
    experts, top_k = 6, 2
    config = GraniteMoeHybridConfig(
        hidden_size=H, intermediate_size=I, num_local_experts=experts,
        num_experts_per_tok=top_k, mamba_n_heads=4, mamba_d_head=16,
    )  # fmt: skip
    hf = GraniteMoeHybridMoE(config)
    randomize(hf, "granite")
    hidden = routed_hidden(hf.router.weight, tie_free_logits(TOKENS, experts, gen_for("g")))
    moe = FusedMoE(experts, top_k, H, I, scoring="softmax", renormalize=True)
    prefix = "experts." if names == "hf" else ""
    w13_name, w2_name = ("gate_up_proj", "down_proj") if names == "hf" else (
        "input_linear.weight", "output_linear.weight")  # fmt: skip
    sd = hf.state_dict()
    load(moe, [(prefix + w13_name, sd["experts.gate_up_proj"]),
               (prefix + w2_name, sd["experts.down_proj"]),
               ("router.weight", sd["router.weight"])])  # fmt: skip
    with torch.no_grad():
        expected = hf(hidden[None])[0]
        out = moe(hidden, F.linear(hidden, hf.router.weight))
    torch.testing.assert_close(out, expected, **TOL)


def test_jamba_moe_block_from_per_expert_tensors():
    experts, top_k = 5, 2
    config = JambaConfig(
        hidden_size=H, intermediate_size=I, num_experts=experts, num_experts_per_tok=top_k
    )
    hf = JambaSparseMoeBlock(config)
    randomize(hf, "jamba")
    hidden = routed_hidden(hf.router.weight, tie_free_logits(TOKENS, experts, gen_for("j")))
    moe = FusedMoE(experts, top_k, H, I, scoring="softmax", renormalize=False)
    load(moe, per_expert(hf.experts.gate_up_proj.detach(), None, hf.experts.down_proj.detach()))
    with torch.no_grad():
        expected = hf(hidden[None])[0]
        out = moe(hidden, F.linear(hidden, hf.router.weight))
    torch.testing.assert_close(out, expected, **TOL)


def test_nemotron_routed_experts_grouped_relu2():
    groups, top_k = 4, 3
    config = NemotronHConfig(
        hidden_size=H, moe_intermediate_size=I, n_routed_experts=2 * groups,
        num_experts_per_tok=top_k, n_group=groups, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )  # fmt: skip
    router, experts = NemotronHTopkRouter(config), NemotronHExperts(config)
    randomize(experts, "nemotron")
    logits = logit(grouped_scores(TOKENS, groups, gen_for("n")))
    hidden = routed_hidden(router.weight, logits)
    moe = FusedMoE(
        2 * groups, top_k, H, I, activation="relu2", is_act_and_mul=False, scoring="sigmoid",
        renormalize=True, use_correction_bias=True, num_expert_group=groups, topk_group=2,
        routed_scaling_factor=2.5,
    )  # fmt: skip
    load(moe, [*per_expert(None, experts.up_proj.detach(), experts.down_proj.detach()),
               ("gate.e_score_correction_bias", router.e_score_correction_bias)])  # fmt: skip
    with torch.no_grad():
        _, weights, ids = router(hidden)
        expected = experts(hidden, ids, weights)
        out = moe(hidden, F.linear(hidden, router.weight))
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("act_and_mul", [True, False])
def test_tensor_parallel_shards_sum_to_the_whole(act_and_mul):
    experts, top_k = 4, 2
    gen = gen_for("tp", act_and_mul)
    w13 = torch.randn(experts, (2 if act_and_mul else 1) * I, H, generator=gen) / H**0.5
    w2 = torch.randn(experts, H, I, generator=gen) / I**0.5
    hidden = torch.randn(TOKENS, H, generator=gen)
    logits = tie_free_logits(TOKENS, experts, gen)
    kw = dict(activation="silu" if act_and_mul else "relu2", is_act_and_mul=act_and_mul)
    whole = FusedMoE(experts, top_k, H, I, **kw)
    load(whole, [("experts.gate_up_proj" if act_and_mul else "experts.up_proj", w13),
                 ("experts.down_proj", w2)])  # fmt: skip
    parts = []
    for rank in range(2):
        moe = FusedMoE(experts, top_k, H, I, tp_rank=rank, tp_size=2, reduce_results=False, **kw)
        gate_up = w13 if act_and_mul else None
        load(moe, per_expert(gate_up, None if act_and_mul else w13, w2))
        assert moe.w13_weight.shape[1] == w13.shape[1] // 2 and moe.w2_weight.shape[2] == I // 2
        parts.append(moe(hidden, logits))
    torch.testing.assert_close(parts[0] + parts[1], whole(hidden, logits), **TOL)


def test_tp_that_does_not_divide_names_the_field():
    with pytest.raises(ValueError, match="intermediate_size=24 .* tp_size=5"):
        FusedMoE(4, 2, H, I, tp_rank=0, tp_size=5)


def test_loader_errors():
    moe = FusedMoE(4, 2, H, I)
    with pytest.raises(ValueError, match="experts.1.gate_proj.weight"):
        load(moe, [("experts.1.gate_proj.weight", torch.zeros(I, H + 1))])
    with pytest.raises(ValueError, match="shard_id"):
        moe.w13_weight.weight_loader(moe.w13_weight, torch.zeros(I, H), (4, "gate"))
    with pytest.raises(ValueError, match="shard_id"):
        moe.w2_weight.weight_loader(moe.w2_weight, torch.zeros(H, I), (0, "up"))
    # Every expert's every part must arrive: expert 3's up is missing.
    names = [(n, t) for n, t in per_expert(torch.zeros(4, 2 * I, H), None, torch.zeros(4, H, I))]
    names = [(n, t) for n, t in names if n != "experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks .*w13_weight\[\(3, 'up'\)\]"):
        load(FusedMoE(4, 2, H, I), names)
    with pytest.raises(ValueError, match="activation"):
        FusedMoE(4, 2, H, I, activation="gelu")
    with pytest.raises(ValueError, match="top_k"):
        FusedMoE(4, 5, H, I)


def test_dummy_weights_load_and_run():
    moe = FusedMoE(4, 2, H, I, scoring="sigmoid", use_correction_bias=True)
    load(moe, dummy_weights(Holder(moe)))
    out = moe(torch.randn(3, H, generator=gen_for("dummy")), torch.zeros(3, 4))
    assert out.shape == (3, H) and bool(out.isfinite().all())


def test_expert_weight_target():
    assert expert_weight_target("model.layers.0.mixer.experts.7.up_proj.weight") == (
        "w13_weight", (7, "up"))  # fmt: skip
    assert expert_weight_target("feed_forward.experts.2.down_proj.weight") == (
        "w2_weight", (2, "down"))  # fmt: skip
    assert expert_weight_target("block_sparse_moe.input_linear.weight") == ("w13_weight", None)
    assert expert_weight_target("mixer.experts.down_proj") == ("w2_weight", None)
    assert expert_weight_target("mixer.shared_experts.up_proj.weight") is None
    assert expert_weight_target("feed_forward.router.weight") is None
