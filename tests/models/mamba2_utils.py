"""Helpers shared by the Mamba2 layer and model tests: the tolerance table, tiny HF models,
a one-step driver of our model, and an independent fp32 reference of the whole model.
"""

from __future__ import annotations

import inspect
import sys
import types
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import vllm
from vllm.forward_context import ForwardContext, set_forward_context
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    causal_conv1d_ref,
    causal_conv1d_update_ref,
)
from vllm.model_executor.layers.mamba.ops.mamba_ssm_ref import ssm_scan_ref
from vllm.model_executor.models.utils import bind_state_pool

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16

# The ONE tolerance table of the Mamba2 layer/model tests: (what is compared) -> dtype -> bounds.
#   scan:     the chunked / recurrent scan vs the per-token reference, and the decode kernel
#             vs the PyTorch path (fp32 math both sides; the budget covers reassociation
#             over chunks of up to 16 tokens, and one ulp of the fp16/bf16 cast at the store)
#   vs_hf:    our logits vs HF transformers' logits for the same weights and tokens (logits
#             are O(1-5); bf16 allows a few bf16 ulps accumulated over the layers)
#   batching: our model vs itself (mixed batch vs each sequence alone, chunked vs one
#             prefill): same kernels, only reassociation differs
#   backends: Triton conv vs CUDA conv inside the same model (GPU)
#   reference: our model vs the per-token fp32 reference of tests (n_groups > 1)
TOLERANCES = {
    "scan": {
        FP32: dict(atol=2e-5, rtol=2e-5),
        FP16: dict(atol=2e-3, rtol=2e-3),
        BF16: dict(atol=1e-2, rtol=1e-2),
    },
    "vs_hf": {FP32: dict(atol=1e-4, rtol=1e-4), BF16: dict(atol=0.25, rtol=0.05)},
    "batching": {FP32: dict(atol=2e-5, rtol=2e-5), BF16: dict(atol=5e-2, rtol=2e-2)},
    "backends": {FP32: dict(atol=1e-5, rtol=1e-5), BF16: dict(atol=5e-2, rtol=2e-2)},
    "reference": {FP32: dict(atol=1e-4, rtol=1e-4)},
}
# bf16 vs HF: besides the bounds above, our largest logit error (against HF's fp32 logits)
# may be at most this multiple of HF's own bf16 model's largest error.
BF16_ERROR_VS_HF_BF16 = 2.0


def assert_close(actual, expected, what: str, dtype: torch.dtype = FP32, msg: str = "") -> None:
    """Compare in fp32 with the table's bounds for (what, dtype); dtype is the model's or
    op's compute input dtype (logits are fp32 whatever the model dtype)."""
    torch.testing.assert_close(
        actual.float(), expected.float(), **TOLERANCES[what][dtype], msg=msg or None
    )


def gen_for(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


# --------------------------------------------------------------------------------------
# Tiny HF models
# --------------------------------------------------------------------------------------

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    num_heads=4,
    head_dim=16,
    expand=2,
    state_size=8,
    num_hidden_layers=2,
    n_groups=1,
    conv_kernel=4,
    chunk_size=8,
)


def hf_config(**overrides):
    from transformers import Mamba2Config

    return Mamba2Config(**{**TINY, **overrides})


@torch.no_grad()
def make_hf_model(config, seed: int = 0):
    """An HF Mamba2ForCausalLM with every parameter random and non-trivial.

    HF initialises norms to 1, D to 1 and conv biases to 0; a test on those values
    could not see a swapped or dropped term, so all of them are perturbed.
    """
    from transformers import Mamba2ForCausalLM

    torch.manual_seed(seed)
    model = Mamba2ForCausalLM(config).eval()
    gen = gen_for("hf-weights", seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape).uniform_(0.0, 2.5, generator=gen))
        elif name.endswith("dt_bias"):
            p.copy_(0.5 * noise - 1.0)
        elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith(".D") or name.endswith("conv1d.bias"):
            p.copy_(0.5 * noise)
        elif name.endswith("conv1d.weight"):
            p.copy_(0.5 * noise)
        else:
            p.copy_(0.2 * noise)
    return model


def hf_norms_per_group() -> bool:
    """Whether the installed transformers' Mamba2 gated RMSNorm normalises per group.

    Newer releases do (``group_size``), as Mamba2 and our layer do; older ones normalise
    over the whole intermediate dimension, so with n_groups > 1 they are no oracle.
    """
    from transformers.models.mamba2 import modeling_mamba2

    # MambaRMSNormGated until 5.24, Mamba2RMSNormGated from 5.25.
    norm = getattr(modeling_mamba2, "Mamba2RMSNormGated", None)
    init = (norm or modeling_mamba2.MambaRMSNormGated).__init__
    return "group_size" in inspect.signature(init).parameters


def hf_oracle_groups() -> int:
    """n_groups for a test that compares with HF: 2 where HF normalises per group, else 1."""
    return 2 if hf_norms_per_group() else 1


class HFCache:
    """One view of HF's Mamba2 cache across transformers releases.

    Newer releases return ``out.cache`` (a ``Cache`` with ``get_conv_state`` /
    ``get_recurrent_state``) and take ``cache=``; older ones return ``out.cache_params`` (a
    ``Mamba2Cache`` with ``conv_states`` / ``ssm_states``, or in 5.17 a ``DynamicCache``
    whose ``layers`` hold them) and take ``cache_params=`` plus a ``cache_position`` whose
    first entry > 0 marks a decode step.
    """

    def __init__(self, hf_output):
        cache = getattr(hf_output, "cache", None)
        self.raw = cache if cache is not None else hf_output.cache_params

    def conv_state(self, layer: int) -> torch.Tensor:
        if hasattr(self.raw, "get_conv_state"):
            return self.raw.get_conv_state(layer)
        if hasattr(self.raw, "layers"):
            return self._layer_state(layer, "conv_states")
        return self.raw.conv_states[layer]

    def ssm_state(self, layer: int) -> torch.Tensor:
        if hasattr(self.raw, "get_recurrent_state"):
            return self.raw.get_recurrent_state(layer)
        if hasattr(self.raw, "layers"):
            return self._layer_state(layer, "recurrent_states")
        return self.raw.ssm_states[layer]

    def _layer_state(self, layer: int, name: str) -> torch.Tensor:
        # transformers 5.17: a DynamicCache whose layers (LinearAttentionLayer) keep their
        # states in dicts; a Mamba2 layer has one state of each kind.
        states = getattr(self.raw.layers[layer], name)
        if not isinstance(states, dict):
            return states
        if len(states) != 1:
            raise AssertionError(f"layer {layer} of the HF cache has {name} {list(states)}")
        return next(iter(states.values()))

    @staticmethod
    def decode_kwargs(hf, cache: HFCache, position: int) -> dict:
        params = inspect.signature(hf.forward).parameters
        if "cache" in params:
            return {"cache": cache.raw}
        kwargs = {"cache_params": cache.raw}
        if "cache_position" in params:
            kwargs["cache_position"] = torch.tensor([position])
        return kwargs


@torch.no_grad()
def hf_prefill_then_decode(hf, prompt: list[int], decode_tokens: list[int]):
    """HF logits: (len(prompt), vocab) for the prompt, then one row per decode token, and
    HF's cache after the last step (as an ``HFCache``)."""
    out = hf(torch.tensor([prompt]), use_cache=True)
    rows = [out.logits[0]]
    cache = HFCache(out)
    for i, tok in enumerate(decode_tokens):
        kwargs = HFCache.decode_kwargs(hf, cache, len(prompt) + i)
        out = hf(torch.tensor([[tok]]), use_cache=True, **kwargs)
        cache = HFCache(out)
        rows.append(out.logits[0])
    return torch.cat(rows), cache


# --------------------------------------------------------------------------------------
# Driving our model one step at a time
# --------------------------------------------------------------------------------------


@dataclass
class Row:
    """One row of a step: a sequence's slot (a pool line >= 1; NULL_BLOCK_ID or PAD_SLOT_ID
    for a padded row), its tokens, and whether it continues the state already in its slot."""

    slot: int
    tokens: list[int]
    has_init: bool = False


class Driver:
    """Our model with its metadata builder and state pool (bound to its layers), run one
    step at a time."""

    def __init__(self, model, num_slots: int = 8):
        self.model = model
        self.device = model.backbone.embeddings.weight.device
        self.builder = model.metadata_builder(self.device)
        self.pool = model.allocate_state_pool(num_slots)

    def build(self, rows: list[Row]):
        lens = [len(r.tokens) for r in rows]
        qsl = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        slots = torch.tensor([r.slot for r in rows], dtype=torch.int32)
        init = torch.tensor([r.has_init for r in rows], dtype=torch.bool)
        return self.builder.build(qsl, slots, init)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, md) -> torch.Tensor:
        """The model's forward over ``ids`` with ``md`` in the forward context, this
        driver's pool bound to the layers (drivers may share a model)."""
        bind_state_pool(self.model, self.pool)
        with set_forward_context(ForwardContext(mamba2_metadata=md)):
            return self.model(ids, None)

    @torch.no_grad()
    def step(self, rows: list[Row]) -> list[torch.Tensor]:
        """Per-row fp32 logits, (len(row.tokens), vocab) each, in the rows' order."""
        md = self.build(rows)
        ids = torch.tensor([t for r in rows for t in r.tokens], dtype=torch.long)
        hidden = self.forward(ids.to(self.device), md)
        logits = self.model.compute_logits(hidden).cpu()
        out, start = [], 0
        for r in rows:
            out.append(logits[start : start + len(r.tokens)])
            start += len(r.tokens)
        return out


def run_mixer(mixer, hidden: torch.Tensor, state, metadata) -> torch.Tensor:
    """One step of a bare mixer as a model runs it: ``state`` (conv_state, ssm_state) bound
    to ``kv_cache``, as the engine binds a layer's views, and ``metadata`` in the forward
    context."""
    mixer.kv_cache = tuple(state)
    with set_forward_context(ForwardContext(mamba2_metadata=metadata)):
        return mixer(hidden)


# --------------------------------------------------------------------------------------
# The CUDA conv ops, faked on CPU with the references (same assumed interface)
# --------------------------------------------------------------------------------------


def fake_cuda_ops(calls: list[str]) -> types.ModuleType:
    """A CPU stand-in of ``vllm._custom_ops`` with its signatures and layout checks."""
    mod = types.ModuleType("vllm._custom_ops")

    def causal_conv1d_fwd_cuda(
        x,
        weight,
        bias,
        conv_states,
        query_start_loc,
        cache_indices,
        has_initial_state,
        silu,
        pad_slot_id,
        *,
        out=None,
    ):
        assert conv_states.is_contiguous(), "the CUDA ops take width-contiguous states"
        assert x.stride(0) == 1 and isinstance(silu, bool) and out is None
        calls.append(f"fwd:{x.shape[1]}")
        return causal_conv1d_ref(
            x,
            weight,
            bias,
            conv_states,
            query_start_loc,
            cache_indices,
            has_initial_state,
            "silu" if silu else None,
            pad_slot_id,
        )

    def causal_conv1d_update_cuda(
        x, conv_state, weight, bias, silu, conv_state_indices, pad_slot_id, *, out=None
    ):
        assert conv_state.is_contiguous(), "the CUDA ops take width-contiguous states"
        assert x.stride(1) == 1 and isinstance(silu, bool) and out is None
        calls.append(f"update:{x.shape[0]}")
        return causal_conv1d_update_ref(
            x, conv_state, weight, bias, silu, conv_state_indices, pad_slot_id=pad_slot_id
        )

    mod.causal_conv1d_fwd_cuda = causal_conv1d_fwd_cuda
    mod.causal_conv1d_update_cuda = causal_conv1d_update_cuda
    mod.cuda_ops_available = lambda: True
    return mod


def install_custom_ops(monkeypatch: pytest.MonkeyPatch, module) -> None:
    """Make ``from vllm import _custom_ops`` give ``module`` (None: an ImportError)."""
    monkeypatch.setitem(sys.modules, "vllm._custom_ops", module)
    if module is None:
        monkeypatch.delattr(vllm, "_custom_ops", raising=False)
    else:
        monkeypatch.setattr(vllm, "_custom_ops", module, raising=False)


# --------------------------------------------------------------------------------------
# An independent fp32 reference of the whole model, one sequence at a time
# --------------------------------------------------------------------------------------


def _c(t):
    """A parameter as an fp32 CPU tensor (the reference runs on the CPU: no TF32 conv)."""
    return None if t is None else t.detach().float().cpu()


def _rms(x, weight, eps):
    return _c(weight) * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@torch.no_grad()
def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits (len(tokens), vocab) of one sequence from scratch, written plainly: F.conv1d
    for the conv, the per-token recurrence for the scan, an explicit loop over groups in
    the gated norm. Shares nothing with the model's forward but its parameters."""
    cfg = model.config
    eps = cfg.layer_norm_epsilon
    n = len(tokens)
    h = _c(model.backbone.embeddings.weight)[torch.tensor(tokens)]
    for layer in model.backbone.layers:
        mx = layer.mixer
        x = _rms(h, layer.norm.weight, eps)
        proj = F.linear(x, _c(mx.in_proj.weight), _c(mx.in_proj.bias))
        inter, gn = cfg.intermediate_size, cfg.n_groups * cfg.state_size
        z, xbc, dt = proj.split([inter, inter + 2 * gn, cfg.num_heads], dim=-1)
        w = _c(mx.conv1d.weight)
        conv = F.conv1d(
            F.pad(xbc.t()[None], (w.shape[1] - 1, 0)),
            w[:, None],
            _c(mx.conv1d.bias),
            groups=w.shape[0],
        )[0].t()
        xbc = F.silu(conv)
        xs, B, C = xbc.split([inter, gn, gn], dim=-1)
        states = torch.zeros(1, cfg.num_heads, cfg.head_dim, cfg.state_size)
        y = ssm_scan_ref(
            xs.reshape(n, cfg.num_heads, cfg.head_dim),
            dt,
            -torch.exp(_c(mx.A_log)),
            B.reshape(n, cfg.n_groups, cfg.state_size),
            C.reshape(n, cfg.n_groups, cfg.state_size),
            torch.tensor([0, n]),
            states,
            D=_c(mx.D),
            dt_bias=_c(mx.dt_bias),
            dt_softplus=True,
            dt_limit=cfg.time_step_limit,
        ).reshape(n, inter)
        gated = y * F.silu(z)
        size = inter // cfg.n_groups
        normed = torch.empty_like(gated)
        for g in range(cfg.n_groups):
            part = gated[:, g * size : (g + 1) * size]
            normed[:, g * size : (g + 1) * size] = part / torch.sqrt(
                part.pow(2).mean(-1, keepdim=True) + eps
            )
        normed = normed * _c(mx.norm.weight)
        h = h + F.linear(normed, _c(mx.out_proj.weight), _c(mx.out_proj.bias))
    h = _rms(h, model.backbone.norm_f.weight, eps)
    return F.linear(h, _c(model.lm_head.weight[: cfg.vocab_size]))
