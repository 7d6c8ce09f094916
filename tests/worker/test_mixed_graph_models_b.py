"""Whole engines through the padded mixed path against eager: NemotronH, Granite-4.0-H with
experts, LFM2, Jamba. The other models are in
test_mixed_graph_models_a.py (mixed_graph_engine.py says why two files)."""

from __future__ import annotations

import pytest

from tests.worker.mixed_graph_engine import check_padded_path_equals_eager


@pytest.mark.parametrize("name", ["nemotron_h", "granite_moe", "lfm2", "jamba"])
def test_engine_through_the_padded_path_equals_eager(name, device, tmp_path):
    check_padded_path_equals_eager(name, device, tmp_path)
