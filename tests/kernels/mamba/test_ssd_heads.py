"""``HEADS`` (launch table key of the chunk scan): a program takes two neighbouring heads of
one group and loads each CB and C block once for both.

Each head's arithmetic and its order are a one-head program's, so outputs and pools must be
bit-identical to ``HEADS`` 1, here under the interpreter and on the GPU box (the device
fixture), over ``SCAN_KEY_CASES`` (initial states: the carried dot per head; z and a
per-headdim D: the per-head epilogue). Each test checks which variant was launched.
"""

from __future__ import annotations

import pytest

from tests.kernels.mamba.ssd_utils import (
    SCAN_KEY_CASES,
    Case,
    assert_scan_key_bit_identical,
    build,
    check_against_reference,
    forget_launches,
    launched,
    small_blocks,
)
from tests.models.mamba2_utils import FP16
from vllm.model_executor.layers.mamba.ops import ssd_chunk_scan, ssd_combined
from vllm.model_executor.layers.mamba.ops.ssd_launch import PLANS

TWO = dict(chunk_scan__HEADS=2)


def _launched_heads() -> set:
    return launched(ssd_chunk_scan._LAUNCH, "HEADS")


@pytest.fixture
def fresh_launcher(monkeypatch):
    """The chunk scan's launcher forgets what it launched, so this test's launch shows."""
    forget_launches(monkeypatch, ssd_chunk_scan._LAUNCH)


@pytest.mark.parametrize("case", SCAN_KEY_CASES, ids=lambda c: c.id)
def test_two_heads_are_bit_identical(case, device, monkeypatch):
    assert_scan_key_bit_identical(case, device, monkeypatch, "HEADS", 2)


def test_two_heads_match_the_reference(device, monkeypatch, fresh_launcher, nan_poison):
    case = SCAN_KEY_CASES[2]
    small_blocks(monkeypatch, **TWO)
    check_against_reference(case, build(case, device), device)
    assert _launched_heads() == {2}


def _table_with(monkeypatch, **changes):
    """The launch tables' chunk_scan entry with ``changes``, before ``ssd_configs`` reads it."""
    original = ssd_combined.configs.lookup_first

    def lookup(folder, keys):
        entry = original(folder, keys)
        return {**entry, "chunk_scan": {**entry["chunk_scan"], **changes}}

    monkeypatch.setattr(ssd_combined.configs, "lookup_first", lookup)
    ssd_combined.ssd_configs.cache_clear()  # the configs are cached by shape, plans by layout
    monkeypatch.setattr(ssd_combined, "ssd_configs", ssd_combined.ssd_configs.__wrapped__)
    monkeypatch.setattr(PLANS, "get", lambda key: None)
    monkeypatch.setattr(PLANS, "put", lambda key, plan: None)


def test_one_head_a_group_takes_one_head_a_program(device, monkeypatch, fresh_launcher):
    """Groups of one head cannot pair heads: the configuration falls back to HEADS 1."""
    case = Case((40,), chunk=32, heads=2, groups=2)
    _table_with(monkeypatch, HEADS=2)
    assert ssd_combined.ssd_configs(2, 8, 16, 2, 32, FP16, FP16)["chunk_scan"]["HEADS"] == 1
    assert ssd_combined.ssd_configs(4, 8, 16, 2, 32, FP16, FP16)["chunk_scan"]["HEADS"] == 2
    check_against_reference(case, build(case, device), device)
    assert _launched_heads() == {1}


@pytest.mark.parametrize("bad", [dict(HEADS=3), dict(HEADS=True), dict(HEADS=2, PREFETCH=True)])
def test_bad_heads_name_the_entry(monkeypatch, bad):
    _table_with(monkeypatch, **bad)
    with pytest.raises(ValueError, match="chunk_scan (HEADS|PREFETCH)"):
        ssd_combined.ssd_configs(4, 8, 16, 2, 32, FP16, FP16)
