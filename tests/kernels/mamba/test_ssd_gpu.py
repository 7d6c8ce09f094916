"""The Triton SSD on the GPU: real model shapes in bf16, random varlen batches, the
invariants at the Codestral shape, int64 addressing, and the precision of the split dots.

The oracle is the PyTorch scan in fp32 on fp32 copies of the inputs (``torch_reference``):
the per-token reference is too slow at these sizes.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.kernels.mamba.ssd_utils import (
    Case,
    build,
    check_against_torch,
    run_ssd,
    torch_reference,
)
from tests.models.mamba2_utils import BF16, FP16, FP32, assert_close, gen_for
from vllm.model_executor.layers.mamba.ops.ssd_combined import (
    mamba_chunk_scan_combined_varlen,
    plan_ssd_chunks,
)

pytestmark = pytest.mark.gpu

CODESTRAL = dict(heads=128, headdim=64, dstate=128, groups=8, chunk=256)
BAMBA = dict(heads=128, headdim=64, dstate=128, groups=1, chunk=256)
NEMOTRON_H = dict(heads=128, headdim=64, dstate=128, groups=8, chunk=128)
FALCON_H1 = dict(heads=32, headdim=128, dstate=256, groups=1, chunk=256)
ZAMBA2 = dict(heads=64, headdim=64, dstate=64, groups=1, chunk=256)

GPU_CASES = [
    Case((2048,), **CODESTRAL, dtype=BF16, init="off", offset=255),
    Case((1000, 37, 1, 512, 0, 499), **CODESTRAL, dtype=BF16, pads=1, strided=True),
    Case((512,) * 16, **CODESTRAL, dtype=BF16, init="all", offset=64),
    Case((700, 300), **CODESTRAL, dtype=BF16, state_dtype=BF16),
    Case((777, 64), **CODESTRAL, dtype=FP16, state_dtype=FP16, limit=(0.0, 0.1)),
    Case((600, 256), **CODESTRAL, dtype=FP32, idx64=True),
    Case((1300, 20), **BAMBA, dtype=BF16),
    Case((1000, 129), **NEMOTRON_H, dtype=BF16, init="none"),
    Case((900, 33), **FALCON_H1, dtype=BF16),
    Case((500, 1, 300), **ZAMBA2, dtype=BF16, D=False),
    Case((333, 90), heads=24, headdim=80, dstate=200, groups=3, chunk=100, dtype=BF16),
    Case((1000, 37, 300), **CODESTRAL, dtype=BF16, z=True, D2=True, pads=1, strided=True),
    Case((600, 129), **FALCON_H1, dtype=BF16, z=True, init="all"),
    Case((400, 90), **CODESTRAL, dtype=FP16, state_dtype=FP32, D2=True),
]
GRANITE = dict(heads=128, headdim=64, dstate=256, groups=1, chunk=256)


@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_ssd_matches_torch(case: Case, nan_poison):
    device = torch.device("cuda")
    check_against_torch(case, build(case, device), device)


@pytest.mark.parametrize("seed", range(12), ids=lambda s: f"seed{s}")
def test_gpu_random_batches(seed, nan_poison):
    g = gen_for("ssd-gpu-random", seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    n = pick([1, 2, 5, 17])
    lens = tuple(int(v) for v in torch.randint(0, pick([8, 300, 1500]), (n,), generator=g))
    groups = pick([1, 2, 8])
    case = Case(
        lens,
        heads=groups * pick([1, 4, 16]),
        headdim=pick([32, 50, 64, 128]),
        dstate=pick([16, 64, 128, 256]),
        groups=groups,
        chunk=pick([64, 128, 256]),
        dtype=pick([BF16, BF16, FP16, FP32]),
        state_dtype=pick([FP32, FP32, BF16]),
        init=pick(["mixed", "all", "off", "none"]),
        pads=pick([0, n // 2]),
        D=pick([True, False]),
        dt_bias=pick([True, False]),
        limit=pick([(0.0, math.inf), (0.01, 0.3)]),
        strided=pick([True, False]),
        offset=pick([0, 3, 255]),
    )
    device = torch.device("cuda")
    check_against_torch(case, build(case, device), device)


def test_gpu_split_dots_keep_fp32_accuracy():
    """Codestral shape, bf16 activations, fp32 output: within 1e-4 (relative to the largest
    output) of the fp32 PyTorch scan, where one bf16 cast of the fp32 operands (as
    mamba_ssm's kernels do) gives about 2e-3. The final states likewise."""
    case = Case((1500, 548), **CODESTRAL, dtype=BF16, init="all")
    device = torch.device("cuda")
    inp = build(case, device)
    y_ref, final = torch_reference(case, inp)
    out = torch.empty(inp.kwargs["x"].shape, dtype=FP32, device=device)
    y = run_ssd(case, inp, device, out=out)[3:2051]

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    assert rel(y, y_ref) < 1e-4
    assert rel(inp.pool[inp.lines], final) < 1e-4


def test_gpu_chunked_prefill_equals_one_prefill():
    case = Case((2048,), **CODESTRAL, dtype=BF16, init="all", offset=0)
    device = torch.device("cuda")
    whole, parts = build(case, device), build(case, device)
    y_whole = run_ssd(case, whole, device)
    for lo, hi in ((0, 1000), (1000, 1001), (1001, 2048)):
        run_ssd(case, parts, device, qsl=torch.tensor([lo, hi], dtype=torch.int32))
    line = whole.lines[0]
    assert_close(parts.kwargs["out"][:2048], y_whole[:2048], "batching", BF16)
    scale = whole.pool[line].abs().max()  # errors relative to the state's magnitude
    assert_close(parts.pool[line] / scale, whole.pool[line] / scale, "batching", FP32)


def test_gpu_varlen_equals_each_sequence_alone():
    case = Case((700, 0, 1, 256, 300), **CODESTRAL, dtype=BF16)
    device = torch.device("cuda")
    batch, alone = build(case, device), build(case, device)
    y = run_ssd(case, batch, device)
    kw = alone.kwargs
    for i in range(len(case.lens)):
        run_ssd(
            case, alone, device, qsl=alone.qsl[i : i + 2].clone(),
            state_indices=kw["state_indices"][i : i + 1],
            has_initial_state=kw["has_initial_state"][i : i + 1],
        )  # fmt: skip
    rows = slice(3, 3 + sum(case.lens))
    assert torch.equal(kw["out"][rows], y[rows]), "a chunk's result depends on its batch"
    assert torch.equal(alone.pool, batch.pool)


@pytest.mark.gpu_big_memory
def test_gpu_int64_offsets():
    """Rows past 2**31 elements of x, out, B and C, and pool lines past 2**31 elements."""
    device = torch.device("cuda")
    H, P, N, G, L = 8, 64, 128, 1, 256
    gen = gen_for("ssd-int64")
    rows = 2**31 // (H * P) + 300  # x and out: 4 GiB each in bf16
    start = rows - 290
    x = torch.zeros(rows, H, P, dtype=BF16, device=device)
    out = torch.full((rows, H, P), math.nan, dtype=BF16, device=device)
    bc = torch.zeros(rows, 2, G, N, dtype=BF16, device=device)  # B | C: 2 GiB
    dt = torch.zeros(rows, H, dtype=BF16, device=device)
    num_lines = 2**31 // (H * P * N) + 4  # 4 GiB in bf16
    pool = torch.zeros(num_lines, H, P, N, dtype=BF16, device=device)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(BF16).to(device)

    x[start : start + 280] = rnd(280, H, P)
    bc[start : start + 280] = rnd(280, 2, G, N)
    dt[start : start + 280] = rnd(280, H) * 0.5 - 1.5
    lines = [num_lines - 1, num_lines - 3]
    pool[lines] = rnd(2, H, P, N)
    A = -torch.linspace(0.2, 2.0, H, device=device)
    init = torch.tensor([True, True], device=device)
    idx = torch.tensor(lines, dtype=torch.int32, device=device)
    qsl = torch.tensor([start, start + 200, start + 280], dtype=torch.int32)
    seq = slice(start, start + 280)
    small = dict(x=x[seq].clone(), dt=dt[seq].clone(), B=bc[seq, 0].clone(), C=bc[seq, 1].clone())
    # the reference's own pool: line 0 the null line (the default pad marker), then the
    # two sequences' lines
    ref_pool = torch.cat([torch.zeros_like(pool[:1]), pool[lines]])
    y_small = mamba_chunk_scan_combined_varlen(
        **small, A=A, layout=plan_ssd_chunks(qsl - start, L).to(device), ssm_states=ref_pool,
        state_indices=torch.tensor([1, 2], dtype=torch.int32, device=device),
        has_initial_state=init, dt_softplus=True,
    )  # fmt: skip
    chunk_lines = torch.tensor([num_lines - 2, -1], dtype=torch.int32, device=device)
    mamba_chunk_scan_combined_varlen(
        x, dt, A, bc[:, 0], bc[:, 1], plan_ssd_chunks(qsl, L).to(device), pool, idx, init,
        dt_softplus=True, out=out, chunk_state_indices=chunk_lines,
    )  # fmt: skip
    assert_close(out[start : start + 280], y_small, "batching", BF16)
    assert_close(pool[num_lines - 2], ref_pool[1], "batching", BF16)  # seq 0 is one chunk
    assert torch.isnan(out[start - 1]).all() and torch.isnan(out[start + 280]).all()
    assert_close(pool[lines], ref_pool[1:], "batching", BF16)
    assert not pool[num_lines - 4].any()  # named by no sequence and no chunk


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_gpu_no_compile_for_a_new_step_shape(dtype):
    """After the warm-up's recording of one small call (the engine's start-up), steps of
    other token, sequence and chunk counts reuse the compiled kernels: with a table's
    many-chunks chunk state (the H200's, from 16 chunks) the recording compiled both."""
    from vllm.triton_utils.launch import launch_misses, precompile

    device = torch.device("cuda")
    first = Case((300,), **CODESTRAL, dtype=dtype)
    with precompile():
        run_ssd(first, build(first, device), device)
    before = dict(launch_misses())
    for lens in ((1,), (17, 2), (256, 512, 1), (1000,) * 3, (2100, 2100)):
        case = Case(lens, **CODESTRAL, dtype=dtype, offset=len(lens) * 7)
        run_ssd(case, build(case, device), device)
    after = launch_misses()
    ssd = [k for k in after if "ssd" in k]
    assert len(ssd) == 3 and all(after[k] == before.get(k, 0) for k in ssd), (before, after)


def test_gpu_plans_launch_directly_and_agree_with_the_general_path(monkeypatch, nan_poison):
    """From a plan's second call on, the three kernels are launched directly: bit for bit
    what the CachedLauncher path wrote, and right at another step shape of the same layout;
    a pointer that is not 16-byte aligned (the strided case's C) takes the general path."""
    from vllm.model_executor.layers.mamba.ops import ssd_launch

    direct = []
    original = ssd_launch.SSDPlan._launch_direct

    def counted(self, ptrs, num_chunks, num_seqs):
        direct.append((num_chunks, num_seqs))
        return original(self, ptrs, num_chunks, num_seqs)  # False: the general path runs

    monkeypatch.setattr(ssd_launch.SSDPlan, "_launch_direct", counted)
    ssd_launch.PLANS.clear()
    device = torch.device("cuda")
    case = Case((700, 1, 300, 0), **CODESTRAL, dtype=BF16, pads=1)
    inp = build(case, device)
    runs = []
    for _ in range(2):
        pool = inp.pool.clone()
        y = run_ssd(case, inp, device, pool=pool, out=inp.kwargs["out"].clone())
        runs.append((y, pool))
    assert direct == [(6, 4)]  # chunks 3 + 1 + 2 + 0, four sequences
    (y0, pool0), (y1, pool1) = runs
    torch.testing.assert_close(y1, y0, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(pool1, pool0)
    other = Case((3, 900, 0, 64), **CODESTRAL, dtype=BF16, init="all", offset=40)
    check_against_torch(other, build(other, device), device)
    assert direct[1:] == [(6, 4)] and len(ssd_launch.PLANS) == 1  # 1 + 4 + 0 + 1 chunks
    strided = Case((300, 20), **CODESTRAL, dtype=BF16, strided=True)
    for _ in range(2):
        check_against_torch(strided, build(strided, device), device)
    assert len(direct) == 2


def test_gpu_granite_shape(nan_poison):
    """Granite-4.0-H's layer (state 256, one group): two state blocks per dot."""
    case = Case((1500, 512, 3), **GRANITE, dtype=BF16, init="all", z=True)
    device = torch.device("cuda")
    check_against_torch(case, build(case, device), device)


def test_gpu_chunk_end_states_into_given_lines(nan_poison):
    """Codestral shape: every chunk's end state into its line, pads skipped; the lines
    match the per-chunk prefixes scanned by the PyTorch scan."""
    device = torch.device("cuda")
    case = Case((600, 256, 45), **CODESTRAL, dtype=BF16, init="all")
    inp = build(case, device)
    layout = plan_ssd_chunks(inp.qsl, case.chunk)
    extra = torch.randn(layout.num_chunks, *inp.pool.shape[1:], device=device)
    pool = torch.cat([inp.pool, extra])
    lines = torch.arange(case.num_lines, case.num_lines + layout.num_chunks)
    lines[1] = -1  # PAD_SLOT_ID: not wanted
    before = pool.clone()
    run_ssd(case, inp, device, pool=pool,
            chunk_state_indices=lines.to(device, torch.int32))  # fmt: skip
    expected = chunk_end_states_ref_torch(case, inp, before[: case.num_lines])
    for c, line in enumerate(lines.tolist()):
        if line < 0:
            assert torch.equal(pool[case.num_lines + c], before[case.num_lines + c])
            continue
        scale = expected[c].abs().max()
        assert_close(pool[line] / scale, expected[c] / scale, "batching", FP32)


def chunk_end_states_ref_torch(case: Case, inp, pool):
    """Each chunk's end state: the PyTorch scan of its sequence up to the chunk's end."""
    layout = plan_ssd_chunks(inp.qsl, case.chunk)
    out = []
    for c in range(layout.num_chunks):
        seq = int(layout.chunk_seqs[c])
        first = int(inp.qsl[seq])
        sub_case = dataclasses.replace(
            case, lens=(int(layout.chunk_starts[c + 1]) - first,), offset=first, pads=0
        )
        sub = dataclasses.replace(inp, lines=[inp.lines[seq]], init=[inp.init[seq]], pool=pool)
        out.append(torch_reference(sub_case, sub)[1][0])
    return out


def _tune_module():
    from benchmarks.kernels import tune_ssd

    return tune_ssd


# Collected everywhere (the module's GPU mark skips them off the box with its reason; an
# empty list here made pytest skip with only "got empty parameter set").
TUNE = _tune_module()
SWEPT = list(TUNE.VARIANTS)


@pytest.mark.parametrize(
    "variant", SWEPT, ids=lambda v: f"{v[0]}-" + "-".join(f"{k}{x}" for k, x in v[1].items())
)
def test_gpu_every_configuration_agrees(variant, nan_poison):
    """Every configuration the tune script sweeps (and so every table entry it can write):
    a fresh plan's call over a workspace of NaN bytes and the plan's direct launch over a
    zeroed one write the same bits (a kernel that read workspace it did not write, a race,
    or a direct launch unlike the general one would differ), and match the PyTorch scan."""
    from vllm.model_executor.layers.mamba.ops.ssd_launch import PLANS

    kernel, changes = variant
    device = torch.device("cuda")
    case = Case((700, 1, 300, 0), **CODESTRAL, dtype=BF16, pads=1, z=True)
    rows = slice(3, 3 + sum(case.lens))

    def two_runs():
        runs = []
        for byte in (255, 0):
            inp = build(case, device)
            with TUNE.poisoned_workspace(byte):
                y = run_ssd(case, inp, device)
            runs.append((y[rows].clone(), inp.pool.clone()))
        return runs

    (y0, p0), (y1, p1) = TUNE.run_variant(kernel, changes, two_runs)
    PLANS.clear()
    assert torch.equal(y0, y1) and torch.equal(p0, p1), "general and direct calls differ"
    y_ref, final = torch_reference(case, build(case, device))
    live = [i for i, line in enumerate(build(case, device).lines) if line != -1]
    scale = y_ref.abs().max()
    assert_close(y0 / scale, y_ref / scale, "scan", BF16)
    lines = [build(case, device).lines[i] for i in live]
    fscale = final[live].abs().max()
    assert_close(p0[lines] / fscale, final[live] / fscale, "scan", BF16)
