"""Mamba1's Triton selective scan and decode update against the fp32 references.

On a machine without CUDA these run the kernels through the Triton interpreter on CPU
tensors (conftest sets TRITON_INTERPRET=1), so each case checks the kernels, not the
reference against itself. The kernels use no tl.dot, so bf16 cases run on CPU too.
Shapes are tiny; the chunk length is forced to CHUNK so that sequences of 1, CHUNK-1,
CHUNK, CHUNK+1 and 2*CHUNK+1 tokens cross every boundary kind.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.mamba.selective_scan_utils import (
    ScanCase,
    check_against_reference,
    params,
    real_lines,
    rnd,
    scan_inputs,
)
from tests.models.mamba2_utils import BF16, FP16, FP32, assert_close
from vllm.model_executor.layers.mamba.ops import PAD_SLOT_ID, selective_scan
from vllm.model_executor.layers.mamba.ops.selective_scan import (
    CONFIG_DIR,
    chunk_plan,
    selective_scan_fn,
    selective_state_update_mamba1,
    use_selective_scan_kernel,
)
from vllm.model_executor.layers.mamba.ops.selective_scan_kernels import LAUNCH_CHUNK
from vllm.model_executor.layers.mamba.ops.selective_scan_ref import (
    selective_scan_ref,
    selective_state_update_ref,
)
from vllm.triton_utils.configs import lookup
from vllm.triton_utils.launch import launch_misses, precompile

CHUNK = 4
# 1, CHUNK-1, a padded row (line 0), CHUNK, CHUNK+1, 2*CHUNK+1, an empty sequence.
LENS = (1, 3, 2, 4, 5, 9, 0)
LINES = (3, 6, 0, 1, 7, 2, 4)
INIT = (True, False, True, True, False, True, True)
BASE = ScanCase(LENS, LINES, INIT)

SCAN_CASES = [
    BASE,
    dataclasses.replace(BASE, dtype=FP16, strided=True),
    dataclasses.replace(BASE, state_dtype=BF16, z=False, D=False, bias=False),
    dataclasses.replace(BASE, dtype=FP16, state_dtype=FP16, softplus=False, z=False),
    # No tl.dot here, so the interpreter runs bf16 faithfully.
    dataclasses.replace(BASE, dtype=BF16, state_dtype=BF16, strided=True),
    # An explicit -1 marker: line 0 is then a sequence's like any other.
    dataclasses.replace(BASE, lines=(3, 6, -1, 1, 7, 0, 4), pad_slot_id=PAD_SLOT_ID),
    dataclasses.replace(BASE, lens=(5, 1, 9), lines=(0, 1, 2), init=(True, False, True),
                        no_indices=True, strided=True),
]  # fmt: skip


def _touched(case: ScanCase) -> set[int]:
    lines = range(len(case.lens)) if case.no_indices else case.lines
    marker = -1 if case.no_indices else case.marker
    return real_lines([ln for ln, n in zip(lines, case.lens, strict=True) if n > 0], marker)


# The prefill scan's latency knobs (launch table: ``chunk`` for launch 1, ``rescan`` over
# it for launch 3): every variant runs the same per-token math in the same order. UNROLL 4
# with CHUNK 4 runs whole groups and the remainder loop (sequences of 1-3, 5 and 9 tokens),
# UNROLL 2 both as well. Pairs: (launch 1's knobs, launch 3's).
KNOBS = [dict(PREFETCH=p, UNROLL=u) for u in (1, 2, 4) for p in (False, True)]
PAIRS = [(k, k) for k in KNOBS] + [
    (dict(PREFETCH=False, UNROLL=1), dict(PREFETCH=True, UNROLL=1)),  # default.json's
    (dict(PREFETCH=False, UNROLL=4), dict(PREFETCH=True, UNROLL=2)),
]


def _knob_id(k: dict) -> str:
    return f"unroll{k['UNROLL']}" + ("-prefetch" if k["PREFETCH"] else "")


def _pair_id(pair) -> str:
    first, rescan = map(_knob_id, pair)
    return first if first == rescan else f"{first}+rescan-{rescan}"


def _with_knobs(monkeypatch, first: dict, rescan: dict) -> None:
    table = selective_scan.scan_config

    def patched(*args):
        cfg = table(*args)
        return dict(cfg, chunk=dict(cfg["chunk"], **first), rescan=dict(rescan))

    monkeypatch.setattr(selective_scan, "scan_config", patched)


@pytest.fixture(params=PAIRS, ids=_pair_id)
def knobs(request, monkeypatch) -> tuple[dict, dict]:
    """The launch table with these knobs for launches 1 and 3 (the rest as it has it)."""
    _with_knobs(monkeypatch, *request.param)
    return request.param


@pytest.mark.parametrize("case", SCAN_CASES, ids=lambda c: c.id)
def test_scan_matches_reference(case: ScanCase, knobs, device, nan_poison):
    kw, pool = scan_inputs(case, device)
    if device.type == "cpu":
        assert use_selective_scan_kernel(kw["u"]), "the interpreter should run the kernels"
    y = check_against_reference(selective_scan_fn, selective_scan_ref, kw, pool, case.dtype,
                                _touched(case), chunk_len=CHUNK)  # fmt: skip
    if not case.no_indices:  # padded rows: zero outputs
        qsl = kw["query_start_loc"].tolist()
        for b, line in enumerate(case.lines):
            if line == case.marker or line < 0:
                assert not y[qsl[b] : qsl[b + 1]].any()


@pytest.mark.parametrize("chunk_len", [None, 3])
def test_scan_other_plans_and_no_initial_state(chunk_len, knobs, device, nan_poison):
    kw, pool = scan_inputs(BASE, device)
    kw["has_initial_state"] = None
    check_against_reference(selective_scan_fn, selective_scan_ref, kw, pool, FP32,
                            _touched(BASE), chunk_len=chunk_len)  # fmt: skip


@pytest.mark.parametrize("chunk_len", [None, 3, CHUNK])
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
def test_every_knob_is_bit_identical_to_the_plain_loop(chunk_len, dtype, device, monkeypatch):
    """Same chunk plan, same per-token math in the same order: outputs and every pool line
    equal bit for bit across PREFETCH and UNROLL (a tail or prefetch bug shows as a
    difference even where it stays within the reference's tolerance)."""
    case = dataclasses.replace(BASE, dtype=dtype, state_dtype=dtype, strided=True)
    kw, pool = scan_inputs(case, device)
    runs = []
    for k in KNOBS:
        _with_knobs(monkeypatch, k, k)
        mine = pool.clone()
        runs.append((selective_scan_fn(ssm_states=mine, **kw, chunk_len=chunk_len), mine))
    for k, (y, lines) in zip(KNOBS[1:], runs[1:], strict=True):
        assert torch.equal(y, runs[0][0]) and torch.equal(lines, runs[0][1]), _knob_id(k)


BAD_KNOBS = [
    (dict(UNROLL=3), {}, "chunk UNROLL must be"),
    (dict(UNROLL=True), {}, "chunk UNROLL must be"),
    (dict(PREFETCH=1), {}, "chunk PREFETCH must be"),
    ({}, dict(UNROLL=8), "chunk UNROLL must be"),  # the rescan's, checked as launch 3 is
    ({}, dict(num_warps=4), "rescan may set only PREFETCH and UNROLL"),
]


@pytest.mark.parametrize("first,rescan,match", BAD_KNOBS,
                         ids=["unroll3", "unroll-bool", "prefetch-int", "rescan-unroll8",
                              "rescan-warps"])  # fmt: skip
def test_a_bad_knob_in_the_table_is_named(first, rescan, match, device, monkeypatch):
    table = selective_scan.scan_config
    monkeypatch.setattr(selective_scan, "scan_config",
                        lambda *a: dict(table(*a), chunk=dict(table(*a)["chunk"], **first),
                                        rescan=rescan))  # fmt: skip
    kw, pool = scan_inputs(BASE, device)
    with pytest.raises(ValueError, match=match):
        selective_scan_fn(ssm_states=pool, **kw, chunk_len=CHUNK)


def test_scan_writes_out_and_zeroes_rows_outside_the_batch(device, nan_poison):
    """Rows before query_start_loc[0] and past query_start_loc[batch] come out zero, as the
    reference leaves them; ``out`` is the tensor returned."""
    kw, pool = scan_inputs(BASE, device)
    # Slot 0 is nobody's (the first sequence's first slot is 5 // CHUNK = 1).
    kw["query_start_loc"] = torch.tensor([5, 7, 9, 9, 15, 16, 18, 21], dtype=torch.int32).to(device)
    out = torch.empty_like(kw["u"])
    lens = dataclasses.replace(BASE, lens=(2, 2, 0, 6, 1, 2, 3))
    y = check_against_reference(selective_scan_fn, selective_scan_ref, kw, pool, FP32,
                                _touched(lens), chunk_len=CHUNK, out=out)  # fmt: skip
    assert y is out
    assert not y[:5].any() and not y[21:].any()


def test_chunk_plan_follows_the_table():
    cfg = lookup(CONFIG_DIR, "*")
    target, least = cfg["target_programs"], cfg["min_chunk_len"]
    # falcon-mamba-7b's layer: one sequence of 8192 tokens needs chunks over time ...
    chunk_len, n_chunks = chunk_plan(8192, 1, 8192, 16, BF16)
    blocks = 8192 // min(cfg["chunk"]["BLOCK_D"], 4096 // 16)
    assert least <= chunk_len < 8192 and n_chunks * blocks >= target
    # ... 16 sequences of 512 fill the device without them (no state pass, no rescan).
    assert chunk_plan(8192, 16, 8192, 16, BF16) == (8192, 1)
    assert chunk_plan(40, 1, 8, 16, FP32) == (40, 1)  # never below min_chunk_len
    assert chunk_plan(10, 2, 8, 16, FP32, chunk_len=3) == (3, 4)
    with pytest.raises(ValueError, match="chunk_len must be a positive int"):
        chunk_plan(10, 2, 8, 16, FP32, chunk_len=0)


# --------------------------------------------------------------------------
# Decode update
# --------------------------------------------------------------------------

DIM, DSTATE, LINES_N = 6, 5, 7


def _update_inputs(dtype, strided: bool, key, device, batch: int = 5) -> dict:
    """Rows sliced on the device (moving a strided slice would make it contiguous)."""
    wide = rnd(batch, 4 * DIM + 2 * DSTATE + 1, key=(key, "rows")).to(dtype).to(device)
    cols = {}
    at = 1
    for name, w in (("u", DIM), ("delta", DIM), ("z", DIM), ("B", DSTATE), ("C", DSTATE)):
        cols[name] = wide[:, at : at + w] if strided else wide[:, at : at + w].contiguous()
        at += w
    p = params(DIM, DSTATE, dtype, key)
    p = {k: v.to(device) for k, v in p.items()}
    A = p["A"].t().contiguous().t() if strided else p["A"]  # column-major A when strided
    return dict(cols, A=A, D=p["D"], delta_bias=p["delta_bias"], delta_softplus=True)


UPDATE_CASES = [
    # (dtype, pool dtype, strided, indices, marker)
    (FP32, FP32, False, (3, 0, 5, 1, 6), None),
    (FP16, FP32, True, (3, 0, 5, 1, 6), None),
    (FP32, BF16, True, (2, -1, 0, 4, 1), PAD_SLOT_ID),
    (FP16, FP16, False, None, None),
    (BF16, BF16, True, (3, 0, 5, 1, 6), None),
]


UPDATE_IDS = ["fp32", "fp16-strided", "bf16pool-pad-1", "fp16-no-indices", "bf16-strided"]


@pytest.mark.parametrize("dtype,pool_dtype,strided,indices,marker", UPDATE_CASES, ids=UPDATE_IDS)
def test_update_matches_reference(dtype, pool_dtype, strided, indices, marker, device,
                                  nan_poison):  # fmt: skip
    kw = _update_inputs(dtype, strided, (str(dtype), strided, indices), device)
    batch = kw["u"].shape[0]
    if indices is not None:
        kw["state_batch_indices"] = torch.tensor(indices, dtype=torch.int32, device=device)
    if marker is not None:
        kw["pad_slot_id"] = marker
    pool = rnd(LINES_N, DIM, DSTATE, key=("update-pool", str(dtype))).to(pool_dtype).to(device)
    lines = indices if indices is not None else range(batch)
    touched = real_lines(lines, 0 if marker is None or indices is None else marker)
    if indices is None:
        touched = set(range(batch))
    y = check_against_reference(selective_state_update_mamba1, selective_state_update_ref, kw,
                                pool, dtype, touched)  # fmt: skip
    pad = 0 if marker is None else marker
    for i, line in enumerate(lines):
        if indices is not None and (line == pad or line < 0):
            assert not y[i].any()


def test_update_without_optionals_into_out(device, nan_poison):
    kw = _update_inputs(FP32, False, "bare", device)
    for name in ("z", "D", "delta_bias"):
        kw[name] = None
    kw["state_batch_indices"] = torch.tensor([1, 2, 0, 3, 5], dtype=torch.int64, device=device)
    pool = rnd(LINES_N, DIM, DSTATE, key=("update-pool", "bare")).to(device)
    out = torch.empty_like(kw["u"])
    y = check_against_reference(selective_state_update_mamba1, selective_state_update_ref, kw,
                                pool, FP32, {1, 2, 3, 5}, out=out)  # fmt: skip
    assert y is out


def test_decode_steps_continue_a_scan(device):
    """A prefill of 6 tokens then 3 decode steps equals one scan of the 9 tokens."""
    case = ScanCase((9,), (2,), (True,), dtype=FP32)
    kw, pool = scan_inputs(case, device)
    whole = pool.clone()
    y_all = selective_scan_fn(ssm_states=whole, **kw, chunk_len=CHUNK)
    split = pool.clone()
    head = {k: (v[:6] if k in ("u", "delta", "z", "B", "C") else v) for k, v in kw.items()}
    head["query_start_loc"] = torch.tensor([0, 6], dtype=torch.int32, device=device)
    ys = [selective_scan_fn(ssm_states=split, **head, chunk_len=CHUNK)]
    idx = torch.tensor([2], dtype=torch.int32, device=device)
    for t in range(6, 9):
        step = {k: kw[k][t : t + 1] for k in ("u", "delta", "z", "B", "C")}
        params_kw = dict(A=kw["A"], D=kw["D"], delta_bias=kw["delta_bias"], delta_softplus=True)
        ys.append(
            selective_state_update_mamba1(split, **step, **params_kw, state_batch_indices=idx)
        )
    assert_close(torch.cat(ys), y_all, "scan", FP32)
    assert_close(split, whole, "scan", FP32)


def test_precompile_records_every_launch_of_a_one_chunk_step(knobs, device, monkeypatch):
    """Start-up's dummy prefill may fit in one chunk; it still registers the state pass and
    the rescan, which a longer prompt launches later, and runs nothing; both chunk launches
    with the table's knobs (the remainder loop of UNROLL is inside the same kernel)."""
    kw, pool = scan_inputs(BASE, device)
    before = pool.clone()
    asked = []

    def chunk_launch(grid, args, constexprs, *rest):
        asked.append(constexprs)
        return LAUNCH_CHUNK(grid, args, constexprs, *rest)

    chunk_launch.runs_cpu_tensors = LAUNCH_CHUNK.runs_cpu_tensors
    monkeypatch.setattr(selective_scan, "LAUNCH_CHUNK", chunk_launch)
    with precompile() as report:
        selective_scan_fn(ssm_states=pool, **kw)
        rows = {k: kw[k][:2] for k in ("u", "delta", "B", "C")}
        selective_state_update_mamba1(
            pool, **rows, A=kw["A"], state_batch_indices=kw["cache_indices"][:2]
        )
    names = {"_selective_scan_chunk_kernel": 2, "_selective_scan_state_passing_kernel": 1,
             "_selective_state_update_mamba1_kernel": 1}  # fmt: skip
    assert {k: report.variants.get(k) for k in names} == names
    assert torch.equal(pool, before)
    assert sorted(c["FINAL"] for c in asked) == [False, True]
    for c in asked:
        assert c.items() >= knobs[c["FINAL"]].items(), asked


def test_a_longer_step_after_the_warmup_compiles_nothing(knobs, device):
    """Per-step counts (tokens, sequences, chunk length, slots) select no new variant: after
    start-up's one-chunk dummy step, a step of other lengths cut into chunks misses none."""
    kw, pool = scan_inputs(
        dataclasses.replace(BASE, lens=(2, 1, 1, 1, 1, 1, 9)), device
    )  # 16 tokens
    with precompile():
        selective_scan_fn(ssm_states=pool, **kw)
    before = launch_misses()
    kw, pool = scan_inputs(BASE, device)
    selective_scan_fn(ssm_states=pool, **kw, chunk_len=CHUNK)
    assert launch_misses() == before
