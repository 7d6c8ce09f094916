"""``PREFETCH`` (launch table key of the chunk scan): the off-diagonal source loop loads the
next block's CB, cs, dt and x into registers while the current block's dot runs.

It changes where the loads sit, not the arithmetic or its order, so outputs and pools must
be bit-identical to the plain loop, here under the interpreter and on the GPU box (the
device fixture), over ``SCAN_KEY_CASES`` (the loop's prologue, its last trip that reloads
its own block, and the trips between), and each test checks that the prefetching kernel
was the one launched.
"""

from __future__ import annotations

import pytest

from tests.kernels.mamba.ssd_utils import (
    SCAN_KEY_CASES,
    assert_scan_key_bit_identical,
    build,
    check_against_reference,
    forget_launches,
    launched,
    small_blocks,
)
from vllm.model_executor.layers.mamba.ops import ssd_chunk_scan

PREFETCH = dict(chunk_scan__PREFETCH=True)


def _launched_prefetch() -> bool:
    return True in launched(ssd_chunk_scan._LAUNCH, "PREFETCH")


@pytest.fixture
def fresh_launcher(monkeypatch):
    """The chunk scan's launcher forgets what it launched, so this test's launch shows."""
    forget_launches(monkeypatch, ssd_chunk_scan._LAUNCH)


@pytest.mark.parametrize("case", SCAN_KEY_CASES, ids=lambda c: c.id)
def test_prefetch_is_bit_identical(case, device, monkeypatch):
    assert_scan_key_bit_identical(case, device, monkeypatch, "PREFETCH", True)


def test_prefetch_matches_the_reference(device, monkeypatch, fresh_launcher, nan_poison):
    case = SCAN_KEY_CASES[1]
    small_blocks(monkeypatch, **PREFETCH)
    check_against_reference(case, build(case, device), device)
    assert _launched_prefetch()
