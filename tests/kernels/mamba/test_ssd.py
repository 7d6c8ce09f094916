"""The Triton SSD (``ops/ssd_combined``) vs the per-token reference and the PyTorch scan.

On CPU the kernels run under the Triton interpreter (tests/conftest.py sets it): small
fp32/fp16 cases. The same tests run on CUDA tensors on the GPU box; ``test_ssd_gpu.py``
adds bf16, the real model shapes and int64 addressing.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.mamba.ssd_utils import (
    Case,
    build,
    check_against_reference,
    check_against_torch,
    chunk_end_states_ref,
    run_ref,
    run_ssd,
    small_blocks,
)
from tests.models.mamba2_utils import FP16, assert_close
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import PAD_SLOT_ID
from vllm.model_executor.layers.mamba.ops.mamba_ssm_torch import (
    chunk_scan_varlen,
    plan_chunked_scan,
)
from vllm.model_executor.layers.mamba.ops.ssd_combined import plan_ssd_chunks

CASES = [
    Case((5,), init="off"),  # shorter than a chunk
    Case((16,), init="all"),  # two whole chunks
    Case((37,), heads=2, groups=1),  # several chunks and a tail
    # lengths 1, < chunk, 0, == 2 chunks, > several chunks; one sequence padded
    Case((1, 7, 0, 16, 29), pads=1),
    Case((9, 0, 4), init="none", groups=4),  # ngroups == nheads, no flags given
    Case((11, 3), heads=6, headdim=5, dstate=12, groups=3),  # non-power-of-2 sizes
    Case((13, 6), chunk=4, limit=(0.05, 0.3), idx64=True),
    Case((10, 8), D=False, dt_bias=False, softplus=False),
    Case((12, 5, 1), strided=True),
    Case((14, 9), dtype=FP16, headdim=16, dstate=8, init="all"),
    Case((7, 12), dtype=FP16, state_dtype=FP16, strided=True, pads=1),
    Case((9, 14), z=True),  # gating inside the scan
    Case((11, 5), D2=True, init="all"),  # D per (head, headdim)
    Case((6, 13, 2), z=True, D2=True, strided=True, pads=1),
    Case((12, 7), dtype=FP16, headdim=16, z=True, D2=True),
]
# Chunks longer than the launch blocks (small_blocks): several row blocks per chunk, so the
# chunk scan's factored off-diagonal blocks, the CB job's block rows and the chunk state's
# token blocks all run.
BLOCK_CASES = [
    Case((70, 33), chunk=32, groups=1),
    Case((64, 1, 45), chunk=32, init="all", pads=1, z=True, D2=True),
    Case((100,), heads=2, headdim=16, dstate=32, groups=1, chunk=64, init="off"),
    Case((50, 19), chunk=32, dtype=FP16, headdim=16, limit=(0.05, 0.3)),
]


@pytest.fixture
def blocks(monkeypatch):
    from vllm.model_executor.layers.mamba.ops.ssd_launch import PLANS

    small_blocks(monkeypatch)
    yield
    PLANS.clear()  # the plans made here keep the small blocks


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_ssd_matches_reference(case: Case, device, nan_poison):
    check_against_reference(case, build(case, device), device)


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: c.id)
def test_ssd_matches_reference_with_blocks_smaller_than_the_chunk(case, device, nan_poison, blocks):
    check_against_reference(case, build(case, device), device)


@pytest.mark.parametrize("case", BLOCK_CASES[1:3], ids=lambda c: c.id)
@pytest.mark.parametrize("state_blocks", [{}, dict(BLOCK_N=16, BLOCK_P=16)], ids=["one", "tiles"])
@pytest.mark.parametrize("reload", [True, False], ids=["reload_cs", "recompute"])
def test_chunk_state_cs_paths(case, state_blocks, reload, device, nan_poison, monkeypatch):
    """The chunk state's two ways to the token weights: ``RELOAD_CS`` (the tables' default)
    reads back the dt and cs its program stored, with several programs per (chunk, head)
    ("tiles": dstate and headdim blocks of 16) each storing the same values; off, each
    token block recomputes them from dt_raw."""
    from vllm.model_executor.layers.mamba.ops.ssd_launch import PLANS

    extra = {f"chunk_state__{k}": v for k, v in state_blocks.items()}
    small_blocks(monkeypatch, chunk_state__RELOAD_CS=reload, **extra)
    try:
        check_against_reference(case, build(case, device), device)
    finally:
        PLANS.clear()


@pytest.mark.parametrize(
    "case",
    [Case((13, 8, 0, 3), pads=1), Case((40, 17), chunk=16, init="all", groups=1)],
    ids=lambda c: c.id,
)
def test_chunk_end_states_into_given_lines(case, device, nan_poison, blocks):
    """``chunk_state_indices``: the state at the end of every chunk of the layout goes to
    its line (PAD_SLOT_ID: none); the sequences' final states and outputs are as without
    it, and lines nobody names stay bit-identical."""
    inp = build(case, device)
    layout = plan_ssd_chunks(inp.qsl, case.chunk)
    extra = layout.num_chunks + 1
    pool = torch.cat([inp.pool, torch.randn(extra, *inp.pool.shape[1:]).to(inp.pool)])
    lines = torch.arange(case.num_lines, case.num_lines + layout.num_chunks)
    lines[1::3] = PAD_SLOT_ID  # some chunks' states are not wanted
    expected = chunk_end_states_ref(case, inp, inp.pool)
    plain = build(case, device)
    y_plain = run_ssd(case, plain, device)
    before = pool.clone()
    y = run_ssd(case, inp, device, pool=pool, chunk_state_indices=lines.to(device, torch.int32))
    rows = slice(case.offset, case.offset + sum(case.lens))
    assert torch.equal(y[rows], y_plain[rows])
    assert torch.equal(pool[: case.num_lines], plain.pool)
    for c, line in enumerate(lines.tolist()):
        if line == PAD_SLOT_ID or expected[c] is None:
            continue
        assert_close(pool[line], expected[c], "scan", case.dtype)
    named = {line for line, s in zip(lines.tolist(), expected, strict=True) if s is not None}
    for line in range(case.num_lines, pool.shape[0]):
        if line not in named:
            assert torch.equal(pool[line], before[line]), f"line {line} was touched"


def test_ssd_matches_the_pytorch_scan(device, nan_poison):
    """Against ``chunk_scan_varlen`` fed as the mixer used to feed it: initial states
    gathered from the pool, final states scattered back."""
    case = Case((21, 1, 8, 0), groups=1, pads=1)
    check_against_torch(case, build(case, device), device)


def test_out_none_is_allocated_and_other_rows_are_not_written(device, nan_poison):
    case = Case((6, 3), offset=4)
    inp = build(case, device)
    y = run_ssd(case, inp, device, out=None)
    assert y.shape == inp.kwargs["x"].shape and y.dtype == case.dtype
    assert not torch.isnan(y[4:13]).any()
    assert torch.isnan(y[:4]).all() and torch.isnan(y[13:]).all()


def test_chunked_prefill_equals_one_prefill(device):
    """Two calls (the second continuing from the state the first wrote) equal one call."""
    case = Case((29,), init="off", offset=0)
    whole = build(case, device)
    parts = build(case, device)
    y_whole = run_ssd(case, whole, device)
    line = parts.lines[0]
    first = torch.tensor([0, 13], dtype=torch.int32)
    run_ssd(case, parts, device, qsl=first)
    y_parts = run_ssd(
        case,
        parts,
        device,
        qsl=torch.tensor([13, 29], dtype=torch.int32),
        has_initial_state=torch.tensor([True], device=device),
    )
    assert_close(y_parts[:29], y_whole[:29], "scan")
    assert_close(parts.pool[line], whole.pool[line], "scan")


def test_varlen_batch_equals_each_sequence_alone(device):
    case = Case((9, 1, 0, 17, 6), pads=0)
    batch = build(case, device)
    alone = build(case, device)
    y_batch = run_ssd(case, batch, device)
    kw = alone.kwargs
    for i in range(len(case.lens)):
        qsl = alone.qsl[i : i + 2].clone()
        run_ssd(
            case, alone, device, qsl=qsl, state_indices=kw["state_indices"][i : i + 1],
            has_initial_state=kw["has_initial_state"][i : i + 1],
        )  # fmt: skip
    rows = slice(case.offset, case.offset + sum(case.lens))
    assert_close(alone.kwargs["out"][rows], y_batch[rows], "scan")
    assert_close(alone.pool, batch.pool, "scan")


def test_chunk_size_does_not_change_the_result(device):
    case = Case((21, 5), groups=1)
    results = []
    for chunk in (4, 8, 32):
        inp = build(case, device)
        y = run_ssd(Case(case.lens, groups=1, chunk=chunk), inp, device)
        results.append((y, inp.pool))
    for y, pool in results[1:]:
        assert_close(y[3:29], results[0][0][3:29], "scan")
        assert_close(pool, results[0][1], "scan")


def test_split_dots_keep_fp32_accuracy(device):
    """16-bit operands, fp32 output and pool: the error against the fp32 per-token
    reference stays at the fp32 PyTorch scan's level. One cast of the fp32 operands to
    fp16 would make it about 2**-11 relative (~100x that)."""
    case = Case((40,), heads=2, headdim=16, dstate=16, groups=1, dtype=FP16, init="all")
    inp = build(case, device)
    out = torch.full(inp.kwargs["x"].shape, math.nan, device=device)
    ref_pool, torch_pool = inp.pool.clone(), inp.pool.clone()
    y_ref = run_ref(inp, ref_pool)
    y = run_ssd(case, inp, device, out=out)
    kw = inp.kwargs
    line = inp.lines[0]
    rows = slice(3, 43)
    y_torch, final = chunk_scan_varlen(
        kw["x"][rows], kw["dt"][rows], kw["A"], kw["B"][rows], kw["C"][rows],
        plan_chunked_scan(torch.tensor([40]), case.chunk).to(device), torch_pool[line][None],
        D=kw["D"], dt_bias=kw["dt_bias"], dt_softplus=True, out=out.clone()[rows],
    )  # fmt: skip

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    assert rel(y[rows], y_ref[rows]) <= 10 * rel(y_torch, y_ref[rows]) + 1e-6
    assert rel(inp.pool[line], ref_pool[line]) <= 10 * rel(final[0], ref_pool[line]) + 1e-6


def test_sequences_without_tokens(device):
    """No chunks at all: a line with an initial state keeps it, one without gets zeros,
    a padded one stays; nothing else runs."""
    case = Case((0, 0, 0), init="mixed", pads=1)
    inp = build(case, device)
    inp.kwargs["state_indices"][:] = torch.tensor([0, 1, PAD_SLOT_ID])
    inp.kwargs["has_initial_state"][:] = torch.tensor([True, False, True])
    before = inp.pool.clone()
    y = run_ssd(case, inp, device)
    assert torch.isnan(y).all()
    assert torch.equal(inp.pool[0], before[0]) and not inp.pool[1].any()
    assert torch.equal(inp.pool[2:], before[2:])


def test_plan_ssd_chunks_layout():
    qsl = torch.tensor([5, 12, 12, 28, 29, 38], dtype=torch.int32)
    lay = plan_ssd_chunks(qsl, 8)
    assert (lay.num_seqs, lay.num_chunks, lay.num_tokens) == (5, 6, 33)
    assert (lay.first_row, lay.end_row, lay.chunk_size) == (5, 38, 8)
    assert lay.chunk_starts.tolist() == [5, 12, 20, 28, 29, 37, 38]
    assert lay.chunk_seqs.tolist() == [0, 2, 2, 3, 4, 4]
    assert lay.seq_chunk_starts.tolist() == [0, 1, 1, 3, 4, 6]
    for name in lay.TENSOR_FIELDS:
        assert getattr(lay, name).dtype == torch.int32
    # Invariants: chunks tile the rows, none is longer than a chunk or mixes sequences.
    sizes = lay.chunk_starts.diff()
    assert (sizes >= 1).all() and (sizes <= 8).all()
    seq_of_row = torch.repeat_interleave(torch.arange(5), qsl.diff().long())
    for c in range(lay.num_chunks):
        seqs = seq_of_row[lay.chunk_starts[c] - 5 : lay.chunk_starts[c + 1] - 5]
        assert (seqs == lay.chunk_seqs[c]).all()
    empty = plan_ssd_chunks(torch.tensor([7], dtype=torch.int32), 8)
    assert (empty.num_seqs, empty.num_chunks, empty.chunk_starts.tolist()) == (0, 0, [7])


@pytest.mark.parametrize(
    "qsl,chunk,match",
    [
        ([0, 4, 2], 8, "non-decreasing"),
        ([-1, 4], 8, "non-decreasing"),
        ([0, 4], 0, "chunk_size"),
        ([], 8, "1-D integers"),
    ],
    ids=["decreasing", "negative", "chunk0", "empty"],
)
def test_plan_rejects_bad_input(qsl, chunk, match):
    with pytest.raises(ValueError, match=match):
        plan_ssd_chunks(torch.tensor(qsl, dtype=torch.int32), chunk)
    with pytest.raises(ValueError, match="CPU tensor"):
        plan_ssd_chunks([0, 4], 8)
