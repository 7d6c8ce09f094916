"""Helpers of the Mamba1 model tests (MambaForCausalLM, FalconMambaForCausalLM): tiny HF
models made with transformers' own classes, our tiny configs for dummy weights, a CUDA
conv stand-in that writes into ``out=``, and a multi-step run for the sharded tests."""

from __future__ import annotations

import types

import torch

from tests.models.hybrid_utils import VOCAB, perturb
from tests.models.mamba2_utils import fake_cuda_ops
from vllm.forward_context import ForwardContext, set_forward_context
from vllm.model_executor.models.mamba_config import FalconMambaModelConfig, MambaModelConfig

# Two shapes that between them take every switch the mixer has: Mamba1 with in/out
# projection biases, no conv bias and time_step_rank "auto" (hidden 32 -> 2), tied head;
# FalconMamba (norms on dt, B and C at a non-default epsilon) with an untied head.
HF_SHAPES = {
    "mamba": dict(use_bias=True, use_conv_bias=False, time_step_rank="auto"),
    "falcon_mamba": dict(time_step_rank=4, tie_word_embeddings=False, mixer_rms_eps=1e-3),
}
TINY = dict(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2)


def make_hf(kind: str, seed: int = 0, **overrides):
    """A tiny random HF MambaForCausalLM ("mamba") or FalconMambaForCausalLM
    ("falcon_mamba"), every weight perturbed off its initial value."""
    import transformers

    if kind == "mamba":
        config_cls, model_cls = transformers.MambaConfig, transformers.MambaForCausalLM
    else:
        config_cls = transformers.FalconMambaConfig
        model_cls = transformers.FalconMambaForCausalLM
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **HF_SHAPES[kind], **overrides})
    return perturb(model_cls(config), seed)


def dummy_config(kind: str = "falcon_mamba", **overrides) -> MambaModelConfig:
    """Our config of the same tiny shape, for dummy weights."""
    shape = {**TINY, **HF_SHAPES[kind], **overrides}
    if kind == "mamba":
        return MambaModelConfig(**shape)
    return FalconMambaModelConfig(**shape)


def fake_cuda_ops_with_out(calls: list[str]) -> types.ModuleType:
    """``mamba2_utils.fake_cuda_ops`` (the references behind the CUDA ops' signatures and
    layout checks) taking ``out=`` as the real ops do: the result is written there."""
    base = fake_cuda_ops(calls)
    mod = types.ModuleType("vllm._custom_ops")

    def with_out(fn):
        def op(*args, out=None):
            y = fn(*args)
            return y if out is None else out.copy_(y)

        return op

    mod.causal_conv1d_fwd_cuda = with_out(base.causal_conv1d_fwd_cuda)
    mod.causal_conv1d_update_cuda = with_out(base.causal_conv1d_update_cuda)
    mod.cuda_ops_available = lambda: True
    return mod


# (tokens, slot, continues its state) per row, one list per step: two prefills, then a
# decode beside a continued prefill and a fresh one.
STEPS = [
    [(5, 1, False), (3, 2, False)],
    [(1, 1, True), (4, 2, True), (6, 3, False)],
]


@torch.no_grad()
def run_steps(model) -> list[torch.Tensor | None]:
    """Logits of every row of ``STEPS`` (None off rank 0 of a tensor-parallel group)."""
    builder = model.metadata_builder("cpu")
    model.allocate_state_pool(4)  # bound to the layers
    gen = torch.Generator().manual_seed(7)
    out = []
    for rows in STEPS:
        lens = torch.tensor([n for n, _, _ in rows], dtype=torch.int32)
        qsl = torch.zeros(len(rows) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=qsl[1:])
        md = builder.build(
            qsl,
            torch.tensor([s for _, s, _ in rows], dtype=torch.int32),
            torch.tensor([init for _, _, init in rows]),
        )
        ids = torch.randint(0, model.config.vocab_size, (int(lens.sum()),), generator=gen)
        with set_forward_context(ForwardContext(mamba2_metadata=md)):
            out.append(model.compute_logits(model(ids, None)))
    return out
