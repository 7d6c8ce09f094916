"""MambaMixer2 construction, the state pool it shares a spec with, backends, and the norms."""

from __future__ import annotations

import types

import pytest
import torch

from tests.models.mamba2_utils import fake_cuda_ops, gen_for, install_custom_ops, run_mixer
from vllm.model_executor.layers.layernorm import RMSNorm, RMSNormGated
from vllm.model_executor.layers.mamba.mamba2_metadata import Mamba2MetadataBuilder
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_utils import (
    ConvBackend,
    Mamba2Shape,
    MambaStatePool,
    mamba2_state_spec,
)
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import NULL_BLOCK_ID, PAD_SLOT_ID

MIXER = Mamba2Shape(
    hidden_size=32,
    num_heads=4,
    head_dim=16,
    n_groups=2,
    state_size=8,
    conv_kernel=4,
    chunk_size=4,
    use_bias=False,
    use_conv_bias=True,
    norm_eps=1e-5,
    time_step_limit=(0.0, float("inf")),
)


def test_state_spec_is_shared_by_layer_and_pool():
    mixer = MambaMixer2(MIXER)
    spec = mamba2_state_spec(num_heads=4, head_dim=16, state_size=8, n_groups=2, conv_kernel=4)
    assert mixer.spec == spec
    assert spec.conv_shape == (64 + 2 * 2 * 8, 3) and spec.ssm_shape == (4, 16, 8)
    # in_proj's conv slice is exactly the conv state's feature dim
    assert mixer.in_proj.weight.shape == (64 + spec.conv_dim + 4, 32)
    pool = MambaStatePool(
        spec, num_layers=3, num_slots=5, backend=ConvBackend.TRITON, conv_dtype=torch.float16
    )
    conv, ssm = pool.layer(1)
    assert conv.shape == (6, *spec.conv_shape) and ssm.shape == (6, *spec.ssm_shape)
    assert conv.stride(1) == 1, "Triton layout is feature-contiguous"
    assert conv.dtype == torch.float16 and ssm.dtype == torch.float32
    assert pool.pad_line == 0 and pool.slots == range(1, 6)


def test_cuda_layout_is_width_contiguous(monkeypatch):
    install_custom_ops(monkeypatch, fake_cuda_ops([]))
    monkeypatch.setenv("VLLM_USE_TRITON_CONV1D", "0")
    mixer = MambaMixer2(MIXER)
    assert mixer.backend is ConvBackend.CUDA
    pool = MambaStatePool(mixer.spec, 1, 2, ConvBackend.CUDA, torch.float32)
    assert pool.layer(0)[0].is_contiguous()


def test_cuda_backend_without_ops_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("VLLM_USE_TRITON_CONV1D", "0")
    install_custom_ops(monkeypatch, None)
    with pytest.raises(RuntimeError, match="VLLM_USE_TRITON_CONV1D=0.*cannot be imported"):
        MambaMixer2(MIXER)
    not_built = types.ModuleType("vllm._custom_ops")
    not_built.cuda_ops_available = lambda: False
    install_custom_ops(monkeypatch, not_built)
    with pytest.raises(RuntimeError, match="not built"):
        MambaMixer2(MIXER)


def test_mixer_rejects_a_pool_of_the_other_layout(monkeypatch):
    mixer = MambaMixer2(MIXER)
    builder = Mamba2MetadataBuilder(chunk_size=4, device="cpu")
    md = builder.build(
        torch.tensor([0, 3], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([False]),
    )
    hidden = torch.randn(3, 32, generator=gen_for("h"))
    cuda_pool = MambaStatePool(mixer.spec, 1, 2, ConvBackend.CUDA, torch.float32)
    with pytest.raises(ValueError, match="feature-contiguous"):
        run_mixer(mixer, hidden, cuda_pool.layer(0), md)
    pool = MambaStatePool(mixer.spec, 1, 2, ConvBackend.TRITON, torch.float32)
    conv, ssm = pool.layer(0)
    with pytest.raises(ValueError, match="ssm_state must be"):
        run_mixer(mixer, hidden, (conv, ssm[:, :, :, :4]), md)
    with pytest.raises(ValueError, match="built for 3 tokens"):
        run_mixer(mixer, hidden[:2], (conv, ssm), md)
    mixer.kv_cache = None
    with pytest.raises(RuntimeError, match="no state is bound"):
        mixer(hidden)


def test_bad_backend_variable_is_an_error(monkeypatch):
    monkeypatch.setenv("VLLM_USE_TRITON_CONV1D", "maybe")
    with pytest.raises(ValueError, match="VLLM_USE_TRITON_CONV1D"):
        MambaMixer2(MIXER)


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


def _mixed_step_through_both_scans(device):
    """One mixed step (decodes, a padded decode row, prefills with and without initial
    states, a chunked-prefill continuation, a trailing pad) through the mixer twice: with
    the Triton SSD's layout and with the PyTorch scan's; the null line and a line no row
    names keep every bit. Returns both (y, pool) pairs."""
    mixer = MambaMixer2(MIXER).to(device)
    gen = gen_for("mixer-ssd")
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        mixer.A_log.copy_(torch.empty(4).uniform_(-1.0, 1.0, generator=gen))
    lens = [1, 1, 1, 9, 5, 13, 2]
    slots = [3, 5, NULL_BLOCK_ID, 1, 4, 2, PAD_SLOT_ID]
    init = [True, True, False, False, True, True, False]
    qsl = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    hidden = torch.randn(int(qsl[-1]), 32, generator=gen).to(device)
    base = MambaStatePool(mixer.spec, 1, 6, ConvBackend.TRITON, torch.float32, device=device)
    with torch.no_grad():
        base.conv_state.copy_(torch.randn(base.conv_state.shape, generator=gen))
        base.ssm_state.copy_(torch.randn(base.ssm_state.shape, generator=gen))
    results = []
    for triton_ssd in (True, False):
        builder = Mamba2MetadataBuilder(chunk_size=4, device=device, triton_ssd=triton_ssd)
        md = builder.build(
            qsl, torch.tensor(slots, dtype=torch.int32), torch.tensor(init, dtype=torch.bool)
        )
        assert (md.ssd is not None) == triton_ssd and (md.scan is None) == triton_ssd
        pool = MambaStatePool(mixer.spec, 1, 6, ConvBackend.TRITON, torch.float32, device=device)
        pool.conv_state.copy_(base.conv_state)
        pool.ssm_state.copy_(base.ssm_state)
        with torch.no_grad():
            y = run_mixer(mixer, hidden, pool.layer(0), md)
        for line in (NULL_BLOCK_ID, 6):  # the null line, and a line no row names
            assert torch.equal(pool.conv_state[:, line], base.conv_state[:, line])
            assert torch.equal(pool.ssm_state[:, line], base.ssm_state[:, line])
        results.append((y, pool.ssm_state))
    return results


def test_mixer_triton_ssd_equals_pytorch_scan():
    """On CPU the mixer takes the PyTorch scan by default; forced (interpreter), the Triton
    SSD gives the same outputs and states."""
    (y_ssd, ssm_ssd), (y_torch, ssm_torch) = _mixed_step_through_both_scans(torch.device("cpu"))
    torch.testing.assert_close(y_ssd, y_torch, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ssm_ssd, ssm_torch, atol=2e-5, rtol=2e-5)


def test_builder_picks_the_scan_by_device():
    assert not Mamba2MetadataBuilder(chunk_size=4, device="cpu").triton_ssd
    assert Mamba2MetadataBuilder(chunk_size=4, device="cpu", triton_ssd=True).triton_ssd


@pytest.mark.gpu
def test_gpu_mixer_uses_the_triton_ssd_by_default():
    assert Mamba2MetadataBuilder(chunk_size=4, device="cuda").triton_ssd
    (y_ssd, ssm_ssd), (y_torch, ssm_torch) = _mixed_step_through_both_scans(torch.device("cuda"))
    torch.testing.assert_close(y_ssd, y_torch, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ssm_ssd, ssm_torch, atol=1e-4, rtol=1e-4)
