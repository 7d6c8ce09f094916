"""Fixtures shared by the test modules of this folder."""

from __future__ import annotations

import pytest


@pytest.fixture
def fresh_plans():
    """Empty causal-conv1d launch-plan caches before and after the test (the host tests,
    test_causal_conv1d_host*.py, use it for every test)."""
    from vllm.model_executor.layers.mamba.ops import causal_conv1d as ops

    ops.clear_host_caches()
    yield
    ops.clear_host_caches()
