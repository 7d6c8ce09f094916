"""Tiny random Granite-4.0-H checkpoints from transformers' own
``GraniteMoeHybridForCausalLM`` (seeded and perturbed: no weight at its initial value, the
multipliers away from 1), a guard that the tests' routing has no near-ties, and the check
that our model holds HF's weights.

Routing ties: the router picks each token's top-k logits. Our logits and HF's differ by
float rounding (~1e-5 here), so a token whose k-th and (k+1)-th logits were closer than
that could pick other experts in the two models, and the comparison would fail for no
bug. The router weights are scaled up (logits spread over a few units: the smallest
top-k gap the tests meet is ~3e-3, while a token's second expert still weighs ~0.13) and
``RoutingMargins`` records the smallest k-th vs (k+1)-th gap of every routing call it
watches; a test asserts it stayed above ``MIN_MARGIN``, so a pass cannot rest on a lucky
tie and a failure cannot come from one.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from tests.models.hybrid_utils import VOCAB, assert_loaded_as_hf, hf_norms_per_group, perturb

GRANITE_LAYERS = ["mamba", "attention", "mamba", "attention"]
ROUTER_SCALE = 4.0  # router logits spread over a few units: top-k gaps far above rounding
MIN_MARGIN = 1e-3  # smallest k-th vs (k+1)-th router logit gap a test may meet


def granite_hf_config(**overrides):
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        GraniteMoeHybridRMSNormGated,
    )

    shape = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=24,
        shared_intermediate_size=40,
        num_hidden_layers=len(GRANITE_LAYERS),
        layer_types=GRANITE_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        mamba_n_heads=4,
        mamba_d_head=16,
        # two groups where this transformers normalises per group, as we do (5.24); one
        # where it normalises the whole inner width (5.17)
        mamba_n_groups=2 if hf_norms_per_group(GraniteMoeHybridRMSNormGated) else 1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_chunk_size=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        embedding_multiplier=3.0,
        residual_multiplier=0.6,
        attention_multiplier=0.3,  # not head_dim^-0.5 (0.354)
        logits_scaling=2.5,
        position_embedding_type="rope",
        max_position_embeddings=128,
    )
    return GraniteMoeHybridConfig(**{**shape, **overrides})


def make_granite_hf(seed: int = 0, **overrides):
    from transformers import GraniteMoeHybridForCausalLM as HFGranite

    torch.manual_seed(seed)
    model = perturb(HFGranite(granite_hf_config(**overrides)), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.mul_(ROUTER_SCALE)
    return model


class RoutingMargins:
    """Forward hooks on routers that record the smallest gap between a token's k-th and
    (k+1)-th router logits; ``check()`` asserts it stayed above ``MIN_MARGIN``."""

    def __init__(self):
        self.smallest = float("inf")
        self.calls = 0
        self._handles = []

    def _record(self, logits: torch.Tensor, top_k: int) -> None:
        if logits.numel() == 0:
            return
        ranked = logits.detach().float().reshape(-1, logits.shape[-1]).sort(-1, True).values
        gap = (ranked[:, top_k - 1] - ranked[:, top_k]).min().item()
        self.smallest = min(self.smallest, gap)
        self.calls += 1

    def watch_hf(self, hf) -> RoutingMargins:
        """HF's routers: their logits recomputed from the hook's input (the return order
        differs between transformers releases)."""
        from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
            GraniteMoeHybridTopKRouter,
        )

        for m in hf.modules():
            if isinstance(m, GraniteMoeHybridTopKRouter):
                hook = m.register_forward_hook(
                    lambda mod, args, out: self._record(F.linear(args[0], mod.weight), mod.top_k)
                )
                self._handles.append(hook)
        return self

    def watch_ours(self, model) -> RoutingMargins:
        """Our routers (``block_sparse_moe.router``: its output is the logits)."""
        for name, m in model.named_modules():
            if name.endswith("block_sparse_moe"):
                k = m.experts.top_k
                hook = m.router.register_forward_hook(
                    lambda mod, args, out, k=k: self._record(out, k)
                )
                self._handles.append(hook)
        return self

    def check(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        assert self.calls > 0, "no routing call was watched"
        assert self.smallest >= MIN_MARGIN, (
            f"a token's k-th and (k+1)-th router logits are {self.smallest:.2e} apart, under "
            f"{MIN_MARGIN}: rounding may route it differently; change the test's seed"
        )


def assert_granite_loaded_as_hf(model, hf) -> None:
    """Every parameter of our one-rank ``model`` holds exactly HF's weights: q/k/v fused,
    conv weights without the middle dim of 1, the experts' stacked tensors as they are
    (our ``w13_weight`` is HF's ``gate_up_proj``, gate rows then up rows; ``w2_weight``
    its ``down_proj``)."""

    def name_only(hf_name: str):
        mapped = model.hf_to_param_name(hf_name)
        return mapped[0] if isinstance(mapped, tuple) else mapped

    view = SimpleNamespace(
        named_parameters=model.named_parameters,
        stacked_params_mapping=model.stacked_params_mapping,
        hf_to_param_name=name_only,
    )
    assert_loaded_as_hf(view, hf)
