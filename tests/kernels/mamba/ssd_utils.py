"""Cases, inputs and checks shared by the Triton SSD tests (test_ssd.py, test_ssd_gpu.py).

Inputs are drawn on the CPU from a generator seeded by the case id, then moved, so a case
has the same data on both boxes. The sequences sit at ABSOLUTE rows of a longer token axis
(``offset`` rows before them, as the decode rows precede the prefills in a step, and two
rows after), so the kernels must touch only the rows of their chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tests.models.mamba2_utils import BF16, FP16, FP32, assert_close, gen_for
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import PAD_SLOT_ID
from vllm.model_executor.layers.mamba.ops.mamba_ssm_ref import ssm_scan_ref
from vllm.model_executor.layers.mamba.ops.mamba_ssm_torch import (
    chunk_scan_varlen,
    plan_chunked_scan,
)
from vllm.model_executor.layers.mamba.ops.ssd_combined import (
    mamba_chunk_scan_combined_varlen,
    plan_ssd_chunks,
)

NAMES = {FP32: "fp32", FP16: "fp16", BF16: "bf16"}
NO_LIMIT = (0.0, math.inf)
TAIL_ROWS = 2


@dataclass(frozen=True)
class Case:
    lens: tuple[int, ...]
    heads: int = 4
    headdim: int = 8
    dstate: int = 16
    groups: int = 2
    chunk: int = 8
    dtype: torch.dtype = FP32  # x, dt, B, C and out
    state_dtype: torch.dtype = FP32
    init: str = "mixed"  # "mixed", "all", "off" (all False) or "none" (None is passed)
    pads: int = 0  # sequences on PAD_SLOT_ID
    D: bool = True
    dt_bias: bool = True
    softplus: bool = True
    limit: tuple[float, float] = NO_LIMIT
    strided: bool = False  # x | dt, B | C column slices of wider tensors, a strided pool
    idx64: bool = False
    offset: int = 3  # rows before the first sequence
    z: bool = False  # gating inside the scan: y * silu(z)
    D2: bool = False  # D per head and headdim: (nheads, headdim)

    @property
    def id(self) -> str:
        parts = [
            f"S{len(self.lens)}_T{sum(self.lens)}_H{self.heads}_P{self.headdim}_N{self.dstate}"
            f"_G{self.groups}_L{self.chunk}",
            NAMES[self.dtype],
        ]
        if self.state_dtype != FP32:
            parts.append(f"state{NAMES[self.state_dtype]}")
        parts.append(
            {"mixed": "init", "all": "initall", "off": "noinit", "none": "initNone"}[self.init]
        )
        if self.pads:
            parts.append(f"pad{self.pads}")
        parts += [n for n, off in (("noD", not self.D), ("nobias", not self.dt_bias)) if off]
        if not self.softplus:
            parts.append("nosoftplus")
        if self.limit != NO_LIMIT:
            parts.append("lim")
        if self.strided:
            parts.append("strided")
        if self.idx64:
            parts.append("idx64")
        parts += [n for n, on in (("z", self.z), ("Dhp", self.D2)) if on]
        return "_".join(parts)

    @property
    def num_rows(self) -> int:
        return self.offset + sum(self.lens) + TAIL_ROWS

    @property
    def num_lines(self) -> int:
        return len(self.lens) + 3  # lines that no sequence names stay as they were


@dataclass
class Inputs:
    qsl: torch.Tensor  # CPU int32 absolute rows
    pool: torch.Tensor
    lines: list[int]  # each sequence's line (PAD_SLOT_ID for a padded one)
    init: list[bool]
    kwargs: dict  # x, dt, A, B, C, state_indices, has_initial_state, D, dt_bias, ... out


def build(case: Case, device, key=None) -> Inputs:
    gen = gen_for("ssd", key or case.id)
    T, H, P, N, G = case.num_rows, case.heads, case.headdim, case.dstate, case.groups
    n = len(case.lens)

    def rnd(*shape, dtype=case.dtype, scale=1.0, shift=0.0):
        t = scale * torch.randn(*shape, generator=gen) + shift
        return t.to(dtype=dtype, device=device)

    if case.softplus:
        dt_args = dict(scale=0.5, shift=-1.5)  # dt ~ softplus(-1.5) = 0.2
    else:
        dt_args = dict(scale=0.0, shift=0.0)
    if case.strided:
        proj = rnd(T, H * P + H + 7)
        x = proj[:, : H * P].unflatten(-1, (H, P))
        dt = proj[:, H * P : H * P + H]
        dt.copy_(rnd(T, H, **dt_args))
        bc = rnd(T, 2 * G * N + 5)
        B = bc[:, : G * N].unflatten(-1, (G, N))
        C = bc[:, G * N + 5 :].unflatten(-1, (G, N))
        big = rnd(2, case.num_lines, H, N, P + 3, dtype=case.state_dtype)
        pool = big[1, ..., :P].transpose(-1, -2)
        out = torch.full((T, H, P + 2), math.nan, dtype=case.dtype, device=device)[..., :P]
    else:
        x, dt = rnd(T, H, P), rnd(T, H, **dt_args)
        B, C = rnd(T, G, N), rnd(T, G, N)
        pool = rnd(case.num_lines, H, P, N, dtype=case.state_dtype)
        out = torch.full((T, H, P), math.nan, dtype=case.dtype, device=device)
    if not case.softplus:  # dt is the step itself: positive
        dt.copy_((0.05 + 0.3 * torch.rand(T, H, generator=gen)).to(case.dtype))

    perm = torch.randperm(case.num_lines, generator=gen)
    lines = perm[perm != 0][:n]  # line 0 is the null line
    lines[torch.randperm(n, generator=gen)[: case.pads]] = PAD_SLOT_ID
    init = {
        "mixed": [i % 2 == 0 for i in range(n)],
        "all": [True] * n,
        "off": [False] * n,
        "none": [False] * n,
    }[case.init]
    qsl = (torch.tensor([0, *case.lens]).cumsum(0) + case.offset).to(torch.int32)
    f32 = dict(dtype=FP32, device=device)
    kwargs = dict(
        x=x,
        dt=dt,
        A=-torch.empty(H).uniform_(0.2, 2.0, generator=gen).to(**f32),
        B=B,
        C=C,
        state_indices=lines.to(dtype=torch.int64 if case.idx64 else torch.int32, device=device),
        has_initial_state=None
        if case.init == "none"
        else torch.tensor(init, dtype=torch.bool, device=device),
        D=(torch.randn(H, P, generator=gen) if case.D2 else torch.randn(H, generator=gen)).to(**f32)
        if case.D
        else None,
        dt_bias=(0.3 * torch.randn(H, generator=gen)).to(**f32) if case.dt_bias else None,
        dt_softplus=case.softplus,
        dt_limit=case.limit,
        out=out,
        z=None,
    )
    if case.z:
        if case.strided:  # a column slice of a wider projection, as the mixer's z is
            kwargs["z"] = rnd(T, H * P + 5)[:, 5:].unflatten(-1, (H, P))
        else:
            kwargs["z"] = rnd(T, H, P)
    return Inputs(qsl, pool, lines.tolist(), init, kwargs)


def run_ssd(case: Case, inp: Inputs, device, qsl=None, **overrides):
    """The Triton SSD on ``inp`` (rows ``qsl``, default all of the case's sequences)."""
    layout = plan_ssd_chunks(inp.qsl if qsl is None else qsl, case.chunk).to(device)
    kw = dict(inp.kwargs, **overrides)
    x, dt, A, B, C = (kw.pop(k) for k in ("x", "dt", "A", "B", "C"))
    pool = kw.pop("pool", inp.pool)
    return mamba_chunk_scan_combined_varlen(x, dt, A, B, C, layout, pool, **kw)


def run_ref(inp: Inputs, pool: torch.Tensor, qsl=None) -> torch.Tensor:
    """``ssm_scan_ref`` (fp32, token by token) on ``pool``; y of every row (0 elsewhere and
    for padded sequences), with D per head or per (head, headdim) and the z gate applied
    as the op applies them: ``y = (scan + D x) * silu(z)``."""
    kw = inp.kwargs
    qsl = inp.qsl if qsl is None else qsl
    y = ssm_scan_ref(
        kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], qsl, pool, kw["state_indices"],
        kw["has_initial_state"], D=None, dt_bias=kw["dt_bias"],
        dt_softplus=kw["dt_softplus"], dt_limit=kw["dt_limit"],
    )  # fmt: skip
    live = torch.zeros(y.shape[0], dtype=torch.bool, device=y.device)
    for i, line in enumerate(kw["state_indices"].tolist()):
        if line != PAD_SLOT_ID:
            live[int(qsl[i]) : int(qsl[i + 1])] = True
    D = kw["D"]
    if D is not None:
        D = D.float()[None] if D.dim() == 2 else D.float()[None, :, None]
        y = y + torch.where(live[:, None, None], D * kw["x"].float(), 0.0)
    if kw.get("z") is not None:
        z = kw["z"].float()
        y = y * z * torch.sigmoid(z)
    return y


def chunk_end_states_ref(case: Case, inp: Inputs, pool: torch.Tensor) -> list:
    """The state at the end of each chunk of the layout (``plan_ssd_chunks``), by the
    per-token reference on the sequence's rows up to the chunk's end; None for a chunk of a
    padded sequence."""
    layout = plan_ssd_chunks(inp.qsl, case.chunk)
    kw = inp.kwargs
    states = []
    for c in range(layout.num_chunks):
        seq = int(layout.chunk_seqs[c])
        if inp.lines[seq] == PAD_SLOT_ID:
            states.append(None)
            continue
        scratch = pool.clone()
        sub = dict(kw, state_indices=kw["state_indices"][seq : seq + 1],
                   has_initial_state=None if kw["has_initial_state"] is None
                   else kw["has_initial_state"][seq : seq + 1])  # fmt: skip
        rows = torch.tensor([int(inp.qsl[seq]), int(layout.chunk_starts[c + 1])])
        ssm_scan_ref(
            sub["x"], sub["dt"], sub["A"], sub["B"], sub["C"], rows, scratch,
            sub["state_indices"], sub["has_initial_state"], dt_bias=sub["dt_bias"],
            dt_softplus=sub["dt_softplus"], dt_limit=sub["dt_limit"],
        )  # fmt: skip
        states.append(scratch[inp.lines[seq]].float())
    return states


def small_blocks(monkeypatch, **blocks) -> None:
    """Run the SSD with launch blocks smaller than the chunk (default 16: the smallest
    ``tl.dot`` takes), so that the interpreter's small chunks reach every path the model
    shapes reach on the GPU: several row blocks (the off-diagonal source blocks of the
    chunk scan), several CB block rows, several chunk-state token blocks."""
    from vllm.model_executor.layers.mamba.ops import ssd_combined
    from vllm.model_executor.layers.mamba.ops.ssd_launch import PLANS

    original = ssd_combined.ssd_configs
    sizes = dict(
        chunk_scan=dict(BLOCK_M=16, BLOCK_K=16),
        chunk_state=dict(BLOCK_T=16),
        state_passing=dict(BLOCK_T=16, BLOCK_SP=4, BLOCK_SN=8),
    )
    for name, value in blocks.items():
        kernel, key = name.split("__")
        sizes[kernel][key] = value

    def configs(*args):
        table = {k: dict(v) if isinstance(v, dict) else v for k, v in original(*args).items()}
        for kernel, changes in sizes.items():
            table[kernel].update(changes)
        return table

    monkeypatch.setattr(ssd_combined, "ssd_configs", configs)
    PLANS.clear()
    # Plans keep their configuration: none is reused here, and none made here outlives the
    # test (a later test of the same layout would run these blocks).
    monkeypatch.setattr(PLANS, "get", lambda key: None)
    monkeypatch.setattr(PLANS, "put", lambda key, plan: None)


def coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    order = [FP32, FP16, BF16]
    return max(a, b, key=order.index)


def check_against_reference(case: Case, inp: Inputs, device) -> None:
    """The SSD vs ``ssm_scan_ref``: y of the chunks' rows, every other row untouched (NaN),
    the sequences' lines, every other line bit-identical."""
    before, ref_pool = inp.pool.clone(), inp.pool.clone()
    y_ref = run_ref(inp, ref_pool)
    y = run_ssd(case, inp, device)
    assert y is inp.kwargs["out"]
    rows = slice(case.offset, case.offset + sum(case.lens))
    assert not torch.isnan(y[rows]).any(), "an output row of a chunk was not written"
    assert_close(y[rows], y_ref[rows], "scan", case.dtype)
    assert torch.isnan(y[: case.offset]).all() and torch.isnan(y[rows.stop :]).all(), (
        "rows outside the chunks were written"
    )
    live = [line for line in inp.lines if line != PAD_SLOT_ID]
    if live:
        tol = coarser(case.dtype, case.state_dtype)
        assert_close(inp.pool[live], ref_pool[live], "scan", tol)
    for line in sorted(set(range(case.num_lines)) - set(live)):
        assert torch.equal(inp.pool[line], before[line]), f"line {line} was touched"


def torch_reference(case: Case, inp: Inputs, chunk: int | None = None):
    """The PyTorch scan (fp32 math) on fp32 copies of the inputs, fed as the mixer used to
    feed it; returns (y of the sequences' rows, final states per sequence, fp32)."""
    kw = inp.kwargs
    rows = slice(case.offset, case.offset + sum(case.lens))
    dev = kw["x"].device
    lines = torch.tensor(inp.lines, device=dev)
    has = torch.tensor(inp.init, device=dev) & (lines != PAD_SLOT_ID)
    safe = torch.where(lines == PAD_SLOT_ID, 0, lines)
    initial = torch.where(has[:, None, None, None], inp.pool[safe].float(), 0.0)
    layout = plan_chunked_scan(torch.tensor(case.lens), chunk or case.chunk).to(dev)

    def f32(t):
        return None if t is None else t.float()

    y, final = chunk_scan_varlen(
        f32(kw["x"][rows]), f32(kw["dt"][rows]), kw["A"], f32(kw["B"][rows]),
        f32(kw["C"][rows]), layout, initial, dt_bias=kw["dt_bias"],
        dt_softplus=kw["dt_softplus"], dt_limit=kw["dt_limit"],
    )  # fmt: skip
    D = kw["D"]
    if D is not None:  # per head or per (head, headdim), then the gate: as the op does
        y = y + (D.float()[None] if D.dim() == 2 else D.float()[None, :, None]) * f32(kw["x"][rows])
    if kw.get("z") is not None:
        z = f32(kw["z"][rows])
        y = y * z * torch.sigmoid(z)
    # Padded sequences: y = 0 (the reference's rule), no final state.
    seq_of_row = torch.repeat_interleave(torch.arange(len(case.lens)), torch.tensor(case.lens))
    pad_rows = (lines.cpu() == PAD_SLOT_ID)[seq_of_row].to(dev)
    y = torch.where(pad_rows[:, None, None], 0.0, y)
    return y, final


def check_against_torch(case: Case, inp: Inputs, device) -> None:
    """``check_against_reference`` with ``torch_reference`` as the oracle (fast at model
    shapes, where the per-token reference is not).

    At model shapes an output sums thousands of terms, so two fp32 implementations that
    associate differently part by a few 1e-6 of the output's magnitude, more than the
    table's fp32 atol on small elements: both sides are divided by the oracle's largest
    magnitude first, so the table's bounds apply to errors relative to that."""
    before = inp.pool.clone()
    y_ref, final = torch_reference(case, inp)
    y = run_ssd(case, inp, device)
    rows = slice(case.offset, case.offset + sum(case.lens))
    assert not torch.isnan(y[rows]).any(), "an output row of a chunk was not written"
    scale = y_ref.abs().max().clamp(min=1.0) if y_ref.numel() else 1.0
    assert_close(y[rows] / scale, y_ref / scale, "scan", case.dtype)
    assert torch.isnan(y[: case.offset]).all() and torch.isnan(y[rows.stop :]).all(), (
        "rows outside the chunks were written"
    )
    live = [i for i, line in enumerate(inp.lines) if line != PAD_SLOT_ID]
    if live:
        lines = [inp.lines[i] for i in live]
        tol = coarser(case.dtype, case.state_dtype)
        scale = final[live].abs().max().clamp(min=1.0)
        assert_close(inp.pool[lines].float() / scale, final[live] / scale, "scan", tol)
    for line in sorted(set(range(case.num_lines)) - {inp.lines[i] for i in live}):
        assert torch.equal(inp.pool[line], before[line]), f"line {line} was touched"


# Chunk-scan cases for a launch-table key that must not change a bit (PREFETCH, HEADS): with
# small_blocks' 16-row and 16-source blocks over chunks of 32 and 64, row blocks with 0, 1
# and several off-diagonal source blocks, chunks shorter than a row block, initial states
# (the carried dot), z and a per-headdim D (the epilogue), padded sequences, 16-bit inputs.
SCAN_KEY_CASES = [
    Case((70,), chunk=64, heads=2, groups=1),  # 4 row blocks: 0-3 source blocks each
    Case((1, 33, 0, 64, 5), chunk=32, pads=1),  # a 1-row chunk, a chunk of 1, lengths 0
    Case((40, 90), chunk=64, heads=8, groups=2, init="all", z=True, D2=True),
    Case((50, 17), chunk=32, dtype=FP16, headdim=16, dstate=32, init="mixed"),
    Case((45,), chunk=32, dtype=FP16, state_dtype=FP16, strided=True, pads=1),
]


def forget_launches(monkeypatch, launcher) -> None:
    """``launcher`` (a ``CachedLauncher``) forgets what it launched, so what a test launches
    next shows in ``launched``."""
    monkeypatch.setattr(launcher, "seen", set())
    monkeypatch.setattr(launcher, "cache", {})


def launched(launcher, key: str) -> set:
    """The values of constexpr ``key`` in what ``launcher`` launched (None: not given)."""
    keys = set(launcher.seen) | set(launcher.cache)
    return {dict(k[2]).get(key) for k in keys}


def assert_scan_key_bit_identical(case: Case, device, monkeypatch, key: str, value) -> None:
    """The SSD of ``case`` with the chunk scan's launch-table ``key`` at ``value`` (and
    small_blocks) writes the same bits, outputs and pool, as with the table's own value, and
    each run launched the value it was given."""
    from vllm.model_executor.layers.mamba.ops import ssd_chunk_scan

    launcher = ssd_chunk_scan._LAUNCH
    forget_launches(monkeypatch, launcher)
    small_blocks(monkeypatch)
    ref = build(case, device)
    y0 = run_ssd(case, ref, device)
    (default,) = launched(launcher, key)
    assert default != value, f"the table already sets {key} to {value!r}"
    forget_launches(monkeypatch, launcher)
    small_blocks(monkeypatch, **{f"chunk_scan__{key}": value})
    got = build(case, device)
    y1 = run_ssd(case, got, device)
    assert launched(launcher, key) == {value}, f"the chunk scan with {key} {value} did not run"
    rows = slice(case.offset, case.offset + sum(case.lens))
    assert torch.equal(y1[rows], y0[rows])
    assert torch.equal(got.pool, ref.pool)
