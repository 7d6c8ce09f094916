"""Whole engines through the padded mixed path against eager: NemotronH, Granite-4.0-H with
experts, LFM2, Jamba. The other models are in
test_mixed_graph_models_a.py (mixed_graph_engine.py says why two files)."""

from __future__ import annotations

import pytest

from tests.worker.mixed_graph_engine import check_padded_path_equals_eager

# NemotronH without experts runs on the GPU box only: it is the same model class as
# test_mixed_graph_models_a.py's nemotron_h_moe, whose pattern (Mamba2, MoE, attention,
# MLP) holds every layer kind of this one (Mamba2, attention, MLP), so on the CPU it would
# run the padded path of the same layers a second time.
NEMOTRON_H = pytest.param("nemotron_h", marks=pytest.mark.gpu)


@pytest.mark.parametrize("name", [NEMOTRON_H, "granite_moe", "lfm2", "jamba"])
def test_engine_through_the_padded_path_equals_eager(name, device, tmp_path):
    check_padded_path_equals_eager(name, device, tmp_path)
