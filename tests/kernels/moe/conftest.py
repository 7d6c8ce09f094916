"""Fixtures of the fused-MoE kernel tests."""

import pytest
import torch

from vllm.model_executor.layers.fused_moe import fused_moe as fm


@pytest.fixture
def kernels(device):
    """The device, when the Triton kernels can run there (CUDA, or the CPU interpreter)."""
    if device.type == "cpu" and not fm.use_moe_kernel(torch.empty(1)):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 set before the kernels were imported")
    return device
