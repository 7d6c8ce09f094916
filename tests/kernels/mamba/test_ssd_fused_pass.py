"""``FUSED_PASS`` (launch table key of the chunk state): launch 1 chains the states itself
(a decoupled look-back: each chunk's program waits for the previous chunk's published state
of its tile), and launch 2 only passes sequences without chunks. ``FOLD_CB`` on top: launch 1
also runs launch 2's jobs (CB, the sequences without chunks), and launch 2 is not made.

The arithmetic is launch 2's in the same order, so outputs and pools must be bit-identical
to the three-launch path, here under the interpreter and on the GPU box (the device
fixture). Each test also checks that the fused path ran (the sync buffer was taken) and
left the sync buffer all zeros, which every later call relies on, and that with
``FOLD_CB`` launch 2 was not made.
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
from vllm.model_executor.layers.mamba.ops import ssd_chunk_state, ssd_launch
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import PAD_SLOT_ID
from vllm.model_executor.layers.mamba.ops.ssd_combined import plan_ssd_chunks

CASES = [
    Case((37,), heads=2, groups=1),  # several chunks and a tail, no initial state
    Case((1, 7, 0, 16, 29), pads=1),  # lengths 1, < chunk, 0, == 2 chunks, several; a pad
    Case((16,), init="all"),
    Case((9, 0, 4), init="none", groups=4),
    Case((11, 3), heads=6, headdim=5, dstate=12, groups=3),  # non-power-of-2 sizes
    Case((14, 9), dtype=FP16, headdim=16, dstate=8, init="all"),
    Case((7, 12), dtype=FP16, state_dtype=FP16, strided=True, pads=1),
    Case((64, 1, 45), chunk=32, init="all", pads=1, z=True, D2=True),
    Case((100,), heads=2, headdim=16, dstate=32, groups=1, chunk=16, init="off"),
]
# One program per (chunk, head), or several: headdim and dstate blocks of 16, so each
# (chunk, head) has several tiles, each with its own flag.
TILES = {"one": {}, "tiles": dict(chunk_state__BLOCK_N=16, chunk_state__BLOCK_P=16)}


MODES = {
    "fused": dict(chunk_state__FUSED_PASS=True),
    "fold": dict(chunk_state__FUSED_PASS=True, chunk_state__FOLD_CB=True),
}


def _run(case, device, monkeypatch, mode: dict, tiles: dict, **overrides):
    small_blocks(monkeypatch, **mode, **tiles)
    inp = build(case, device)
    y = run_ssd(case, inp, device, **overrides)
    return y, inp


def _sync_used_and_clean(device) -> None:
    buf = ssd_chunk_state.existing_sync_buffer(device)
    assert buf is not None, "the fused path did not run (no sync buffer was taken)"
    assert not buf.any(), "the fused chunk state left flags or its counter set"


@pytest.fixture
def launch2(monkeypatch):
    """How many calls made launch 2 (state passing and CB)."""
    calls = []
    original = ssd_launch.launch_state_passing

    def counted(*args, **kwargs):
        done = original(*args, **kwargs)
        calls.append(done is not None)
        return done

    monkeypatch.setattr(ssd_launch, "launch_state_passing", counted)
    return calls


@pytest.fixture
def fresh_sync():
    """Each test takes a new sync buffer, so that its use is seen."""
    saved = dict(ssd_chunk_state._SYNC)
    ssd_chunk_state._SYNC.clear()
    yield
    ssd_chunk_state._SYNC.clear()
    ssd_chunk_state._SYNC.update(saved)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("tiles", list(TILES), ids=list(TILES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fused_pass_is_bit_identical(case, tiles, mode, device, monkeypatch, fresh_sync, launch2):
    y0, ref = _run(case, device, monkeypatch, {}, TILES[tiles])
    assert not ssd_chunk_state._SYNC, "the three-launch path took a sync buffer"
    assert launch2 == [True]
    y1, got = _run(case, device, monkeypatch, MODES[mode], TILES[tiles])
    assert launch2 == ([True, True] if mode == "fused" else [True])  # fold: no launch 2
    rows = slice(case.offset, case.offset + sum(case.lens))
    assert torch.equal(y1[rows], y0[rows])
    assert torch.equal(got.pool, ref.pool)
    _sync_used_and_clean(device)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", CASES[1:2] + CASES[7:8], ids=lambda c: c.id)
def test_fused_pass_matches_the_reference(case, mode, device, monkeypatch, fresh_sync, nan_poison):
    small_blocks(monkeypatch, **MODES[mode], **TILES["tiles"])
    check_against_reference(case, build(case, device), device)
    _sync_used_and_clean(device)


@pytest.mark.parametrize("mode", list(MODES))
def test_fused_pass_writes_chunk_end_states(mode, device, monkeypatch, fresh_sync):
    """``chunk_state_indices`` (prefix caching's chunk-end states) from the chained
    program, as launch 2 writes them."""
    case = Case((40, 17), chunk=16, init="all", groups=1)
    layout = plan_ssd_chunks(build(case, device).qsl, case.chunk)
    results = []
    for changes in ({}, MODES[mode]):
        inp = build(case, device)
        extra = torch.zeros(layout.num_chunks, *inp.pool.shape[1:]).to(inp.pool)
        pool = torch.cat([inp.pool, extra])
        lines = torch.arange(case.num_lines, case.num_lines + layout.num_chunks)
        lines[1::2] = PAD_SLOT_ID
        small_blocks(monkeypatch, **changes, **TILES["tiles"])
        y = run_ssd(case, inp, device, pool=pool,
                    chunk_state_indices=lines.to(device, torch.int32))  # fmt: skip
        results.append((y, pool))
    rows = slice(case.offset, case.offset + sum(case.lens))
    assert torch.equal(results[1][0][rows], results[0][0][rows])
    assert torch.equal(results[1][1], results[0][1])
    assert results[1][1][case.num_lines :].any()  # the wanted chunk ends were written
    _sync_used_and_clean(device)


@pytest.mark.parametrize("mode", list(MODES))
def test_fused_pass_handles_sequences_without_chunks(mode, device, monkeypatch, fresh_sync):
    """A sequence without tokens has no chunk program: launch 2 (with FOLD_CB, launch 1's
    passing programs) keeps its initial state or zeroes its line, as without the fusion;
    the others are chained by launch 1. A call whose sequences all lack tokens still makes
    launch 2, folded or not."""
    case = Case((0, 9, 5, 0), init="mixed")  # sequence 0 has an initial state, 3 none
    y0, ref = _run(case, device, monkeypatch, {}, {})
    y1, got = _run(case, device, monkeypatch, MODES[mode], {})
    before = build(case, device).pool
    assert torch.equal(got.pool[got.lines[0]], before[got.lines[0]])
    assert not got.pool[got.lines[3]].any()
    assert torch.equal(got.pool, ref.pool)
    assert torch.equal(y1[3:17], y0[3:17])
    _sync_used_and_clean(device)
    empty = Case((0, 0), init="all")
    _, ref = _run(empty, device, monkeypatch, {}, {})
    _, got = _run(empty, device, monkeypatch, MODES[mode], {})
    assert torch.equal(got.pool, ref.pool)


def test_fold_without_fused_pass_is_refused(device, monkeypatch):
    small_blocks(monkeypatch, chunk_state__FOLD_CB=True)
    case = Case((5,))
    with pytest.raises(ValueError, match="FOLD_CB needs FUSED_PASS"):
        run_ssd(case, build(case, device), device)


def test_sync_buffer_grows_and_is_shared(device, fresh_sync):
    a = ssd_chunk_state.sync_buffer(device, 10)
    assert a.numel() == 1 << 16 and a.dtype == torch.int32 and not a.any()
    assert ssd_chunk_state.sync_buffer(device, 1 << 16) is a
    b = ssd_chunk_state.sync_buffer(device, (1 << 16) + 1)
    assert b.numel() == 1 << 17 and not b.any()
    assert ssd_chunk_state.sync_buffer(device, 5) is b
    # One buffer whether the device is named with its index (a tensor's) or without.
    assert ssd_chunk_state.existing_sync_buffer(torch.empty(0, device=device).device) is b
