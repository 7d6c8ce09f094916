"""The null line: line 0 of a state pool, where padded rows point.

With the ops' default marker (``NULL_BLOCK_ID`` = 0, upstream's current convention) a row
on line 0 is a padded row: every op (conv update, conv forward, SSM update on both paths,
the SSD) gives it zero output and leaves line 0, and every line no real row names,
bit-identical, while the real rows get exactly what they get without the padded rows. An
explicit ``pad_slot_id=PAD_SLOT_ID`` (-1, upstream's 2025 convention) still works: line 0
is then a sequence's line like the others, and rows on -1 are the padded ones.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.mamba2_utils import gen_for
from vllm.model_executor.layers.mamba.ops import NULL_BLOCK_ID, PAD_SLOT_ID
from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
    causal_conv1d_fn,
    causal_conv1d_update,
)
from vllm.model_executor.layers.mamba.ops.mamba_ssm_torch import selective_state_update_torch
from vllm.model_executor.layers.mamba.ops.mamba_ssm_triton import selective_state_update_triton
from vllm.model_executor.layers.mamba.ops.ssd_combined import (
    mamba_chunk_scan_combined_varlen,
    use_ssd_kernel,
)
from vllm.model_executor.layers.mamba.ops.ssd_layout import plan_ssd_chunks

DIM, WIDTH, LINES = 24, 4, 6
HEADS, HEADDIM, DSTATE, GROUPS = 2, 8, 16, 1
# Real rows on lines 3, 1, 4; padded rows between them. Lines 0 (the null line), 2 and 5
# must come out bit-identical.
REAL = [3, 1, 4]
UNTOUCHED = [0, 2, 5]


def rnd(*shape, key):
    return torch.randn(*shape, generator=gen_for("null-line", *key))


def with_pads(marker: int) -> list[int]:
    return [REAL[0], marker, REAL[1], marker, REAL[2]]


def check_pool(after, before, real_lines, skip) -> None:
    for line in range(after.shape[0]):
        if line not in real_lines:
            assert torch.equal(after[line], before[line]), f"line {line} ({skip}) was written"


def conv_update(pool, x, w, b, idx, **kw):
    return causal_conv1d_update(x, pool, w, b, "silu", idx.to(torch.int32), **kw)


@pytest.mark.parametrize("marker", [NULL_BLOCK_ID, "explicit_pad_slot_id"])
def test_conv_update_padded_rows(marker):
    explicit = marker == "explicit_pad_slot_id"
    pad = PAD_SLOT_ID if explicit else NULL_BLOCK_ID
    # With -1 as the marker, line 0 is a real line: a row on it must be updated.
    real = [0, *REAL[1:]] if explicit else REAL
    kw = {"pad_slot_id": PAD_SLOT_ID} if explicit else {}
    idx = torch.tensor([real[0], pad, real[1], pad, real[2]])
    pool = rnd(LINES, WIDTH - 1, DIM, key=("pool",)).transpose(1, 2)  # feature-contiguous
    x, w, b = rnd(5, DIM, key=("x",)), rnd(DIM, WIDTH, key=("w",)), rnd(DIM, key=("b",))
    before = pool.clone()
    out = conv_update(pool, x, w, b, idx, **kw)
    assert not out[[1, 3]].any(), "padded rows give zeros"
    check_pool(pool, before, real, "not a real row's")
    # The real rows alone, on a fresh copy: the same outputs and lines, bit for bit.
    alone = before.clone()
    rows = [0, 2, 4]
    want = conv_update(alone, x[rows].contiguous(), w, b, torch.tensor(real), **kw)
    assert torch.equal(out[rows], want) and torch.equal(pool, alone)


@pytest.mark.parametrize("marker", [NULL_BLOCK_ID, "explicit_pad_slot_id"])
def test_conv_fn_padded_sequences(marker):
    explicit = marker == "explicit_pad_slot_id"
    pad = PAD_SLOT_ID if explicit else NULL_BLOCK_ID
    real = [0, *REAL[1:]] if explicit else REAL
    kw = {"pad_slot_id": PAD_SLOT_ID} if explicit else {}
    lens = [5, 1, 3, 2, 1]
    idx = torch.tensor([real[0], pad, real[1], pad, real[2]], dtype=torch.int32)
    init = torch.tensor([True, True, False, True, True])
    qsl = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    x = rnd(sum(lens), DIM, key=("xf",)).t()  # (dim, tokens), feature-contiguous
    w, b = rnd(DIM, WIDTH, key=("wf",)), rnd(DIM, key=("bf",))
    pool = rnd(LINES, WIDTH - 1, DIM, key=("poolf",)).transpose(1, 2)
    before = pool.clone()
    out = causal_conv1d_fn(x, w, b, pool, qsl, idx, init, "silu", **kw)
    for s in (1, 3):  # the padded sequences' tokens
        assert not out[:, qsl[s] : qsl[s + 1]].any()
    check_pool(pool, before, real, "not a real sequence's")
    keep = [0, 2, 4]
    rows = torch.cat([torch.arange(int(qsl[s]), int(qsl[s + 1])) for s in keep])
    alone = before.clone()
    qsl_alone = torch.tensor([0, *(lens[s] for s in keep)], dtype=torch.int32).cumsum(0)
    want = causal_conv1d_fn(
        x[:, rows].t().contiguous().t(), w, b, alone, qsl_alone.to(torch.int32),
        idx[keep].contiguous(), init[keep].contiguous(), "silu", **kw,
    )  # fmt: skip
    assert torch.equal(out[:, rows], want) and torch.equal(pool, alone)


def _ssm_inputs(batch, key):
    return dict(
        x=rnd(batch, HEADS, HEADDIM, key=("sx", key)),
        dt=rnd(batch, HEADS, key=("sdt", key)),
        A=-rnd(HEADS, key=("sA",)).abs() - 0.5,
        B=rnd(batch, GROUPS, DSTATE, key=("sB", key)),
        C=rnd(batch, GROUPS, DSTATE, key=("sC", key)),
        D=rnd(HEADS, key=("sD",)),
        dt_bias=rnd(HEADS, key=("sdb",)),
        dt_softplus=True,
    )


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("marker", [NULL_BLOCK_ID, "explicit_pad_slot_id"])
def test_ssm_update_padded_rows(marker, path):
    explicit = marker == "explicit_pad_slot_id"
    pad = PAD_SLOT_ID if explicit else NULL_BLOCK_ID
    real = [0, *REAL[1:]] if explicit else REAL
    kw = {"pad_slot_id": PAD_SLOT_ID} if explicit else {}
    update = selective_state_update_torch if path == "torch" else selective_state_update_triton
    idx = torch.tensor([real[0], pad, real[1], pad, real[2]], dtype=torch.int32)
    pool = rnd(LINES, HEADS, HEADDIM, DSTATE, key=("spool",))
    before = pool.clone()
    inp = _ssm_inputs(5, "all")
    y = update(pool, **inp, state_batch_indices=idx, **kw)
    assert not y[[1, 3]].any()
    check_pool(pool, before, real, "not a real row's")
    rows = [0, 2, 4]
    alone = before.clone()
    solo = {k: (v[rows].contiguous() if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
    want = update(alone, **solo, state_batch_indices=idx[rows].contiguous(), **kw)
    torch.testing.assert_close(y[rows], want, atol=0, rtol=0)
    torch.testing.assert_close(pool, alone, atol=0, rtol=0)


@pytest.mark.skipif(not use_ssd_kernel(torch.empty(0)), reason="the SSD needs the interpreter")
@pytest.mark.parametrize("marker", [NULL_BLOCK_ID, "explicit_pad_slot_id"])
def test_ssd_padded_sequences(marker):
    explicit = marker == "explicit_pad_slot_id"
    pad = PAD_SLOT_ID if explicit else NULL_BLOCK_ID
    real = [0, *REAL[1:]] if explicit else REAL
    kw = {"pad_slot_id": PAD_SLOT_ID} if explicit else {}
    lens = [9, 3, 5, 4, 2]
    qsl = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    idx = torch.tensor([real[0], pad, real[1], pad, real[2]], dtype=torch.int32)
    init = torch.tensor([True, True, False, True, True])
    inp = _ssm_inputs(sum(lens), "ssd")
    pool = rnd(LINES, HEADS, HEADDIM, DSTATE, key=("ssdpool",))
    before = pool.clone()
    out = torch.full(inp["x"].shape, float("nan"))
    mamba_chunk_scan_combined_varlen(
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], plan_ssd_chunks(qsl, 4), pool, idx,
        init, D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True, out=out, **kw,
    )  # fmt: skip
    for s in (1, 3):
        assert not out[qsl[s] : qsl[s + 1]].any(), "padded sequences give y = 0"
    check_pool(pool, before, real, "not a real sequence's")
    keep = [0, 2, 4]
    rows = torch.cat([torch.arange(int(qsl[s]), int(qsl[s + 1])) for s in keep])
    alone = before.clone()
    qsl_alone = torch.tensor([0, *(lens[s] for s in keep)]).cumsum(0).to(torch.int32)
    solo = {k: inp[k][rows].contiguous() for k in ("x", "dt", "B", "C")}
    want = mamba_chunk_scan_combined_varlen(
        solo["x"], solo["dt"], inp["A"], solo["B"], solo["C"], plan_ssd_chunks(qsl_alone, 4),
        alone, idx[keep].contiguous(), init[keep].contiguous(), D=inp["D"],
        dt_bias=inp["dt_bias"], dt_softplus=True, **kw,
    )  # fmt: skip
    torch.testing.assert_close(out[rows], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, alone, atol=1e-5, rtol=1e-5)


def test_a_negative_index_is_a_padded_row_whatever_the_marker():
    """Upstream's 2025 callers pad with -1 and pass no marker: their padded rows must
    not reach memory before the pool (an out-of-bounds line)."""
    idx = torch.tensor([3, PAD_SLOT_ID, 1], dtype=torch.int32)
    pool = rnd(LINES, WIDTH - 1, DIM, key=("neg",)).transpose(1, 2)
    before = pool.clone()
    x, w = rnd(3, DIM, key=("negx",)), rnd(DIM, WIDTH, key=("negw",))
    out = causal_conv1d_update(x, pool, w, None, "silu", idx)
    assert not out[1].any()
    check_pool(pool, before, [3, 1], "not a real row's")
