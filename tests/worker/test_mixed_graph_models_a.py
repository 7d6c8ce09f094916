"""Whole engines through the padded mixed path against eager: Mamba2 alone, Bamba, Zamba2,
NemotronH with experts, FalconMamba. The other models are in
test_mixed_graph_models_b.py (mixed_graph_engine.py says why two files)."""

from __future__ import annotations

import pytest

from tests.worker.mixed_graph_engine import check_padded_path_equals_eager


@pytest.mark.parametrize("name", ["mamba2", "bamba", "zamba2", "nemotron_h_moe", "falcon_mamba"])
def test_engine_through_the_padded_path_equals_eager(name, device, tmp_path):
    check_padded_path_equals_eager(name, device, tmp_path)
