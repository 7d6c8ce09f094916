"""``PREFETCH`` (launch table key of the chunk scan): the off-diagonal source loop loads the
next block's CB, cs, dt and x into registers while the current block's dot runs.

It changes where the loads sit, not the arithmetic or its order, so outputs and pools must
be bit-identical to the plain loop, here under the interpreter and on the GPU box (the
device fixture). Blocks of 16 rows and 16 sources over chunks of 32 and 64 give row blocks
with 0, 1 and several off-diagonal source blocks (the loop's prologue, its last trip that
reloads its own block, and the trips between), chunks shorter than one row block, and
each test checks that the prefetching kernel was the one launched.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.mamba.ssd_utils import (
    Case,
    build,
    check_against_reference,
    run_ssd,
    small_blocks,
)
from tests.models.mamba2_utils import FP16
from vllm.model_executor.layers.mamba.ops import ssd_chunk_scan

CASES = [
    Case((70,), chunk=64, heads=2, groups=1),  # 4 row blocks: 0-3 source blocks each
    Case((1, 33, 0, 64, 5), chunk=32, pads=1),  # a 1-row chunk, a chunk of 1, lengths 0
    Case((40, 90), chunk=64, init="all", z=True, D2=True),
    Case((50, 17), chunk=32, dtype=FP16, headdim=16, dstate=32, init="mixed"),
    Case((45,), chunk=32, dtype=FP16, state_dtype=FP16, strided=True, pads=1),
]
PREFETCH = dict(chunk_scan__PREFETCH=True)


def _launched_prefetch() -> bool:
    keys = set(ssd_chunk_scan._LAUNCH.seen) | set(ssd_chunk_scan._LAUNCH.cache)
    return any(("PREFETCH", True) in key[2] for key in keys)


@pytest.fixture
def fresh_launcher(monkeypatch):
    """The chunk scan's launcher forgets what it launched, so this test's launch shows."""
    monkeypatch.setattr(ssd_chunk_scan._LAUNCH, "seen", set())
    monkeypatch.setattr(ssd_chunk_scan._LAUNCH, "cache", {})


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_prefetch_is_bit_identical(case, device, monkeypatch, fresh_launcher):
    small_blocks(monkeypatch)
    ref = build(case, device)
    y0 = run_ssd(case, ref, device)
    assert not _launched_prefetch()
    small_blocks(monkeypatch, **PREFETCH)
    got = build(case, device)
    y1 = run_ssd(case, got, device)
    assert _launched_prefetch(), "the prefetching chunk scan did not run"
    rows = slice(case.offset, case.offset + sum(case.lens))
    assert torch.equal(y1[rows], y0[rows])
    assert torch.equal(got.pool, ref.pool)


def test_prefetch_matches_the_reference(device, monkeypatch, fresh_launcher, nan_poison):
    case = CASES[1]
    small_blocks(monkeypatch, **PREFETCH)
    check_against_reference(case, build(case, device), device)
    assert _launched_prefetch()
