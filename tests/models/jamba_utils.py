"""Helpers of the Jamba tests: tiny random checkpoints from transformers' own
``JambaForCausalLM`` (seeded, perturbed, the routers scaled), our matching dummy-weight
config, HF's parameters under our names, and the routing-margin guard that makes
tie-free routing a checked fact of every HF comparison rather than luck."""

from __future__ import annotations

import contextlib

import torch

from tests.models.hybrid_utils import VOCAB, perturb
from vllm.model_executor.models.jamba_config import JambaModelConfig

# Four layers: Mamba, attention+experts, Mamba, attention+experts (periods 2, offsets 1):
# each mixer kind meets both feed-forward kinds across the two configs of the tests.
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    num_experts=4,
    num_experts_per_tok=2,
    expert_layer_period=2,
    expert_layer_offset=1,
    attn_layer_period=2,
    attn_layer_offset=1,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_dt_rank=4,
    max_position_embeddings=128,
)
# The expert layers move onto the Mamba layers (offset 0: layers 0 and 2), with
# projection biases and dt rank "auto" (hidden 32 -> 2).
MOE_ON_MAMBA = dict(
    expert_layer_offset=0, mamba_proj_bias=True, mamba_conv_bias=False, mamba_dt_rank="auto"
)

# The routers' weights are doubled (logits of std ~2) so that each token's k-th and
# (k+1)-th logits lie apart while the second expert keeps ~20% of the routing weight;
# ``routing_margins`` checks every routed token against ROUTING_MARGIN, a hundred times
# the fp32 difference of the router's input between HF and us (~1e-5). The tests' seeds
# were picked for their margins (4e-3 and more on every token they route).
ROUTER_SCALE = 2.0
ROUTING_MARGIN = 1e-3


def make_jamba_hf(seed: int = 0, **overrides):
    """A tiny random HF JambaForCausalLM, every weight perturbed off its initial value."""
    from transformers import JambaConfig, JambaForCausalLM

    torch.manual_seed(seed)
    model = perturb(JambaForCausalLM(JambaConfig(**{**TINY, **overrides})), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("feed_forward.router.weight"):
                p.mul_(ROUTER_SCALE)
    return model


def dummy_config(**overrides) -> JambaModelConfig:
    """Our config of the tiny shape, for dummy weights."""
    return JambaModelConfig(**{**TINY, **overrides})


@contextlib.contextmanager
def routing_margins(hf, top_k: int, margin: float = ROUTING_MARGIN):
    """Record, for every token HF routes inside the block, the gap between its k-th and
    (k+1)-th router logits; on exit, AssertionError unless every gap exceeds ``margin``
    (a near-tie could route us and HF differently). Yields the list of per-call minima."""
    gaps: list[float] = []

    def hook(module, args, output):
        logits = output[0] if isinstance(output, tuple) else output  # 5.24 | 5.17 router
        top = logits.detach().float().reshape(-1, logits.shape[-1]).topk(top_k + 1).values
        gaps.append(float((top[:, top_k - 1] - top[:, top_k]).min()))

    handles = [
        m.register_forward_hook(hook)
        for name, m in hf.named_modules()
        if name.endswith("feed_forward.router")
    ]
    try:
        yield gaps
    finally:
        for h in handles:
            h.remove()
    assert gaps, "HF routed no token: the block ran no expert layer"
    assert min(gaps) > margin, (
        f"HF's router logits come within {min(gaps):.2e} of a tie (margin {margin}): "
        "these weights cannot tell routing errors from near-ties; change the seed or scale"
    )


@torch.no_grad()
def hf_params_as_ours(model, hf) -> dict[str, torch.Tensor]:
    """HF's parameters as our one-rank ``model`` holds them: q/k/v and gate/up stacked,
    the experts' stacked tensors as ``w13_weight`` / ``w2_weight``, conv weights without
    HF's middle dim of 1, the vocabulary padded with zero rows to our table's."""
    ours = dict(model.named_parameters())
    fused = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, p in hf.named_parameters():
        mapped = model.hf_to_param_name(name)
        if mapped is None:
            continue
        if isinstance(mapped, tuple):  # an expert tensor: stacked in memory (shard id None)
            assert mapped[1] is None, mapped
            out[mapped[0]] = p.detach()
            continue
        p = p.detach().squeeze(1) if mapped.endswith("conv1d.weight") else p.detach()
        head, _, leaf = mapped.rpartition(".")
        owner, _, module = head.rpartition(".")
        if module in fused:
            target, i = fused[module]
            parts.setdefault(f"{owner}.{target}.{leaf}", {})[i] = p
        else:
            out[mapped] = p
    out.update({n: torch.cat([d[i] for i in sorted(d)]) for n, d in parts.items()})
    table = ours["model.embed_tokens.weight"].shape[0]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        t = out.get(name)
        if t is not None and t.shape[0] < table:
            out[name] = torch.cat([t, t.new_zeros(table - t.shape[0], *t.shape[1:])])
    return out
