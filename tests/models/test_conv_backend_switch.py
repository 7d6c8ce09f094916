"""One model, both conv backends: ``set_conv_backend`` switches every layer, the pool layout
follows, and the logits do not change (the step benchmark relies on this to load a 7B model
once). The CUDA backend runs through the reference stand-in of ``vllm._custom_ops``."""

from __future__ import annotations

import pytest
import torch

from tests.models.mamba2_utils import (
    TINY,
    Driver,
    Row,
    assert_close,
    fake_cuda_ops,
    gen_for,
    install_custom_ops,
)
from vllm.model_executor.layers.mamba.mamba_utils import ConvBackend
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig


def test_switch_backend_on_one_model(monkeypatch):
    monkeypatch.setenv("VLLM_USE_TRITON_CONV1D", "1")
    model = get_model(Mamba2ModelConfig(**TINY), load_format="dummy", seed=3)
    assert model.conv_backend is ConvBackend.TRITON

    def toks(n, key):
        return torch.randint(0, TINY["vocab_size"], (n,), generator=gen_for(key)).tolist()

    prefill = [Row(3, toks(11, "p0")), Row(1, toks(6, "p1"))]
    mixed = [Row(1, toks(1, "d1"), True), Row(3, toks(5, "c0"), True), Row(2, toks(9, "p2"))]

    triton = Driver(model, num_slots=4)
    expected = [triton.step(prefill), triton.step(mixed)]

    calls: list[str] = []
    install_custom_ops(monkeypatch, fake_cuda_ops(calls))
    model.set_conv_backend(ConvBackend.CUDA)
    assert model.conv_backend is ConvBackend.CUDA
    assert all(layer.mixer.backend is ConvBackend.CUDA for layer in model.backbone.layers)
    cuda = Driver(model, num_slots=4)
    assert cuda.pool.backend is ConvBackend.CUDA and cuda.pool.conv_state.is_contiguous()
    got = [cuda.step(prefill), cuda.step(mixed)]
    assert "update:1" in calls and "fwd:14" in calls, calls
    for step_got, step_expected in zip(got, expected, strict=True):
        for a, b in zip(step_got, step_expected, strict=True):
            assert_close(a, b, "backends")

    with pytest.raises(ValueError, match="width-contiguous"):
        triton.step(mixed)
    model.set_conv_backend(ConvBackend.TRITON)
    assert all(torch.isfinite(t).all() for t in triton.step([Row(2, toks(1, "d2"), True)]))
