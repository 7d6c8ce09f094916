"""MambaMixer2 construction, the state pool it shares a spec with, backends, and the norms."""

from __future__ import annotations

import types

import pytest
import torch

from tests.models.mamba2_utils import fake_cuda_ops, gen_for, install_custom_ops
from vllm.model_executor.layers.layernorm import RMSNorm, RMSNormGated
from vllm.model_executor.layers.mamba.mamba2_metadata import Mamba2MetadataBuilder
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_utils import (
    ConvBackend,
    MambaStatePool,
    mamba2_state_spec,
)

MIXER = dict(
    hidden_size=32,
    num_heads=4,
    head_dim=16,
    state_size=8,
    n_groups=2,
    conv_kernel=4,
    use_bias=False,
    use_conv_bias=True,
    rms_norm_eps=1e-5,
    time_step_limit=(0.0, float("inf")),
)


def test_state_spec_is_shared_by_layer_and_pool():
    mixer = MambaMixer2(**MIXER)
    spec = mamba2_state_spec(num_heads=4, head_dim=16, state_size=8, n_groups=2, conv_kernel=4)
    assert mixer.spec == spec
    assert spec.conv_shape == (64 + 2 * 2 * 8, 3) and spec.ssm_shape == (4, 16, 8)
    # in_proj's conv slice is exactly the conv state's feature dim
    assert mixer.in_proj.out_features == 64 + spec.conv_dim + 4
    pool = MambaStatePool(
        spec, num_layers=3, num_slots=5, backend=ConvBackend.TRITON, conv_dtype=torch.float16
    )
    conv, ssm = pool.layer(1)
    assert conv.shape == (6, *spec.conv_shape) and ssm.shape == (6, *spec.ssm_shape)
    assert conv.stride(1) == 1, "Triton layout is feature-contiguous"
    assert conv.dtype == torch.float16 and ssm.dtype == torch.float32
    assert pool.pad_line == 5


def test_cuda_layout_is_width_contiguous(monkeypatch):
    install_custom_ops(monkeypatch, fake_cuda_ops([]))
    monkeypatch.setenv("VLLM_USE_TRITON_CONV1D", "0")
    mixer = MambaMixer2(**MIXER)
    assert mixer.backend is ConvBackend.CUDA
    pool = MambaStatePool(mixer.spec, 1, 2, ConvBackend.CUDA, torch.float32)
    assert pool.layer(0)[0].is_contiguous()


def test_cuda_backend_without_ops_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("VLLM_USE_TRITON_CONV1D", "0")
    install_custom_ops(monkeypatch, None)
    with pytest.raises(RuntimeError, match="VLLM_USE_TRITON_CONV1D=0.*cannot be imported"):
        MambaMixer2(**MIXER)
    not_built = types.ModuleType("vllm._custom_ops")
    not_built.cuda_ops_available = lambda: False
    install_custom_ops(monkeypatch, not_built)
    with pytest.raises(RuntimeError, match="not built"):
        MambaMixer2(**MIXER)


def test_mixer_rejects_a_pool_of_the_other_layout(monkeypatch):
    mixer = MambaMixer2(**MIXER)
    builder = Mamba2MetadataBuilder(chunk_size=4, device="cpu")
    md = builder.build(
        torch.tensor([0, 3], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32),
        torch.tensor([False]),
    )
    hidden = torch.randn(3, 32, generator=gen_for("h"))
    cuda_pool = MambaStatePool(mixer.spec, 1, 2, ConvBackend.CUDA, torch.float32)
    with pytest.raises(ValueError, match="feature-contiguous"):
        mixer(hidden, *cuda_pool.layer(0), md)
    pool = MambaStatePool(mixer.spec, 1, 2, ConvBackend.TRITON, torch.float32)
    conv, ssm = pool.layer(0)
    with pytest.raises(ValueError, match="ssm_state must be"):
        mixer(hidden, conv, ssm[:, :, :, :4], md)
    with pytest.raises(ValueError, match="built for 3 tokens"):
        mixer(hidden[:2], conv, ssm, md)


def test_bad_backend_variable_is_an_error(monkeypatch):
    monkeypatch.setenv("VLLM_USE_TRITON_CONV1D", "maybe")
    with pytest.raises(ValueError, match="VLLM_USE_TRITON_CONV1D"):
        MambaMixer2(**MIXER)


def test_gated_norm_normalises_each_group_separately():
    gen = gen_for("norm")
    norm = RMSNormGated(12, group_size=4, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(12, generator=gen))
    x, z = torch.randn(5, 12, generator=gen), torch.randn(5, 12, generator=gen)
    g = x * torch.nn.functional.silu(z)
    expected = (
        torch.cat(
            [
                g[:, i : i + 4] / torch.sqrt(g[:, i : i + 4].pow(2).mean(-1, keepdim=True) + 1e-5)
                for i in (0, 4, 8)
            ],
            dim=-1,
        )
        * norm.weight
    )
    torch.testing.assert_close(norm(x, z), expected, atol=1e-6, rtol=1e-6)
    # scaling one group leaves the other groups' outputs alone
    x2 = x.clone()
    x2[:, :4] *= 7.0
    torch.testing.assert_close(norm(x2, z)[:, 4:], expected[:, 4:], atol=1e-6, rtol=1e-6)


def test_rms_norm_casts_once_to_the_weight_dtype():
    norm = RMSNorm(8, eps=1e-6, dtype=torch.float16)
    x = torch.randn(3, 8, generator=gen_for("rms"))
    out = norm(x)
    assert out.dtype == torch.float16
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out, expected.half(), atol=0, rtol=0)
