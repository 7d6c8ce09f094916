"""The replayed decode update (``ops/mamba_ssm_replay``) against the every-step update.

Over 2L+2 steps of fresh inputs (so the flush boundaries L-1, L, L+1 and a second flush are
crossed) every output equals the every-step PyTorch update's on an fp32 copy of the state,
and the state after ``replay_ssm_materialise`` equals its state; the counters are read
back after every step. The kernel (interpreter on CPU, CUDA on the GPU box) also matches
the fp32 reference op for op: rings and counters exactly, states and outputs to rounding.
Padded rows leave every line alone; materialising a fresh line only empties its ring.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import pytest
import torch

from vllm.model_executor.layers.mamba.ops import mamba_ssm_replay
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import NULL_BLOCK_ID, PAD_SLOT_ID
from vllm.model_executor.layers.mamba.ops.mamba_ssm_replay import (
    ReplayedSSMState,
    _replay_ssm_op,
    replay_ssm_materialise,
    replay_ssm_update,
)
from vllm.model_executor.layers.mamba.ops.mamba_ssm_replay_ref import (
    replay_materialise_ref,
    replay_update_ref,
)
from vllm.model_executor.layers.mamba.ops.mamba_ssm_torch import selective_state_update_torch

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
# rel-L2 bounds against the fp32-state every-step update, by state dtype: fp32 states differ
# by reassociation only; a 16-bit state is rounded every step there and every L-th here.
TOL = {FP32: 2e-5, FP16: 5e-3, BF16: 3e-2}


@dataclass(frozen=True)
class Case:
    batch: int = 3
    heads: int = 4
    headdim: int = 16
    dstate: int = 16
    groups: int = 2
    L: int = 4
    state: torch.dtype = FP32
    act: torch.dtype = FP32
    pads: int = 1
    limit: tuple[float, float] = (0.0, math.inf)
    idx64: bool = False

    @property
    def id(self) -> str:
        short = {FP32: "fp32", FP16: "fp16", BF16: "bf16"}
        return (
            f"B{self.batch}_H{self.heads}_P{self.headdim}_N{self.dstate}_G{self.groups}_"
            f"L{self.L}_{short[self.state]}state_{short[self.act]}"
            + ("_pad" * bool(self.pads))
            + ("_limit" * (self.limit[1] != math.inf))
            + ("_idx64" * self.idx64)
        )


CASES = [
    Case(),
    Case(L=2, pads=0),  # the shortest ring: a flush every other step
    Case(batch=2, heads=6, headdim=5, dstate=12, groups=3, L=5),  # tails, odd sizes
    Case(heads=4, groups=4, L=3, limit=(0.05, 0.3), idx64=True),
    Case(batch=2, state=FP16, act=FP16, L=6),
    Case(batch=3, headdim=32, dstate=32, groups=1, L=17),  # a ring past 16 entries
]
CUDA_CASES = [Case(state=BF16, act=BF16), Case(batch=5, heads=8, headdim=64, dstate=128, L=16)]


def make_rs(case: Case, lines: int, device, gen) -> ReplayedSSMState:
    H, P, N, G, R = case.heads, case.headdim, case.dstate, case.groups, case.L - 1
    state = torch.randn(lines, H, P, N, generator=gen).to(device, case.state)
    z = dict(device=device)
    return ReplayedSSMState(
        state,
        torch.zeros(lines, H, R, P, dtype=case.act, **z),
        torch.zeros(lines, G, R, N, dtype=case.act, **z),
        torch.zeros(lines, H, R, dtype=FP32, **z),
        torch.zeros(lines, H, P, dtype=torch.int8, **z),
    )


def params(case: Case, device, gen) -> dict:
    H = case.heads
    return dict(
        A=-(torch.rand(H, generator=gen) + 0.3).to(device),
        D=torch.randn(H, generator=gen).to(device),
        dt_bias=(torch.rand(H, generator=gen) - 1.5).to(device),
        dt_softplus=True,
        dt_limit=case.limit,
    )


def draw(case: Case, device, gen) -> tuple:
    b, H, P, N, G = case.batch, case.heads, case.headdim, case.dstate, case.groups
    # x as a non-contiguous view (every other head of a wider tensor).
    x = torch.randn(b, 2 * H, P, generator=gen)[:, ::2].to(device, case.act)
    dt = torch.randn(b, H, generator=gen).to(device, case.act)
    B = torch.randn(b, G, N, generator=gen).to(device, case.act)
    C = torch.randn(b, G, N, generator=gen).to(device, case.act)
    return x, dt, B, C


def seed(case: Case) -> int:
    """The same per case in every process (``hash`` of a str is salted per process)."""
    return zlib.crc32(case.id.encode())


def indices(case: Case, lines: int, device, gen, marker: int = PAD_SLOT_ID) -> torch.Tensor:
    # Real rows own any of lines 1 .. lines-1 (the last one included: no line is a sink).
    real = 1 + torch.randperm(lines - 1, generator=gen)[: case.batch - case.pads]  # 0: null
    idx = torch.cat([real, torch.full((case.pads,), marker)])
    idx = idx[torch.randperm(case.batch, generator=gen)]
    return idx.to(device, torch.int64 if case.idx64 else torch.int32)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def run_against_every_step(case: Case, device) -> None:
    gen = torch.Generator().manual_seed(seed(case))
    lines = case.batch + 3
    rs = make_rs(case, lines, device, gen)
    ref = rs.state.to(FP32, copy=True)
    p = params(case, device, gen)
    idx = indices(case, lines, device, gen)
    real = idx != PAD_SLOT_ID
    untouched = torch.ones(lines, dtype=torch.bool)
    untouched[idx[real].long().cpu()] = False
    before = rs.state[untouched.to(device)].clone()
    for step in range(2 * case.L + 2):
        x, dt, B, C = draw(case, device, gen)
        out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=device)
        y = replay_ssm_update(rs, x, dt, p["A"], B, C, **_kw(p), state_batch_indices=idx, out=out)
        want = selective_state_update_torch(
            ref, x, dt, p["A"], B, C, **_kw(p), state_batch_indices=idx
        )
        assert y is out and not y.isnan().any(), f"step {step}: an output was not written"
        assert (y[~real] == 0).all(), "padded rows get y = 0"
        assert rel(y[real], want[real]) < TOL[case.state], f"step {step}"
        n = rs.count[idx[real].long()]
        assert (n == (step + 1) % case.L).all(), f"step {step}: counters {n.unique().tolist()}"
    assert torch.equal(rs.state[untouched.to(device)], before), "padded rows wrote a line"
    # A line whose ring holds steps is materialised; a fresh one (no initial state) is not.
    lines_used = idx[real]
    fresh = torch.zeros_like(lines_used, dtype=torch.bool)
    fresh[0] = True
    kept = rs.state[lines_used[0].long()].clone()
    replay_ssm_materialise(rs, p["A"], lines_used, ~fresh)
    assert (rs.count[lines_used.long()] == 0).all()
    assert torch.equal(rs.state[lines_used[0].long()], kept), "a fresh line's state was written"
    got, want = rs.state[lines_used[1:].long()], ref[lines_used[1:].long()]
    assert rel(got, want) < TOL[case.state]


def _kw(p: dict) -> dict:
    return {k: v for k, v in p.items() if k != "A"}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_replayed_equals_every_step(case, device, nan_poison):
    run_against_every_step(case, device)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: c.id)
def test_replayed_equals_every_step_cuda(case):
    run_against_every_step(case, torch.device("cuda"))


# Launch configurations other than the default table's: several row blocks per head (with
# a tail), the state streamed in several dstate tiles (the last one partly masked), warps.
# The flush as one tl.dot ("tf32x3") where both tiles are >= 16; an 8-row tile with a dot
# flush falls back to the loop. The loop unrolled over the ring ("unroll"), any tile. A
# step split in two launches (split_flush: outputs and appends, then the full rings' flushes).
CONFIGS = [
    dict(BLOCK_P=8, BLOCK_N=16, num_warps=1),
    dict(BLOCK_P=16, BLOCK_N=32, num_warps=2),
    dict(BLOCK_P=64, BLOCK_N=64, num_warps=4),
    dict(BLOCK_P=16, BLOCK_N=16, num_warps=1, flush="tf32x3"),
    dict(BLOCK_P=32, BLOCK_N=32, num_warps=2, flush="tf32x3"),
    dict(BLOCK_P=8, BLOCK_N=32, num_warps=1, flush="tf32x3"),
    dict(BLOCK_P=8, BLOCK_N=16, num_warps=1, flush="unroll"),
    dict(BLOCK_P=32, BLOCK_N=32, num_warps=2, flush="unroll"),
    dict(BLOCK_P=8, BLOCK_N=16, num_warps=1, split_flush=True),
    dict(BLOCK_P=16, BLOCK_N=32, num_warps=2, flush="unroll", split_flush=True),
    dict(BLOCK_P=16, BLOCK_N=32, num_warps=2, flush="tf32x3", split_flush=True),
    dict(BLOCK_P=8, BLOCK_N=16, num_warps=1, flush="prefetch"),
    dict(BLOCK_P=32, BLOCK_N=32, num_warps=2, flush="prefetch", split_flush=True),
    dict(BLOCK_P=16, BLOCK_N=32, num_warps=2, flush="xsplit"),  # fp32 rings: as tf32x3
    dict(BLOCK_P=8, BLOCK_N=16, num_warps=1, one_pass=True),
    dict(BLOCK_P=32, BLOCK_N=32, num_warps=2, flush="xsplit", one_pass=True),
]


def _cfg_id(c: dict) -> str:
    split = "_split" if c.get("split_flush") else ""
    split += "_one" if c.get("one_pass") else ""
    return "P{BLOCK_P}_N{BLOCK_N}_w{num_warps}".format(**c) + f"_{c.get('flush', 'loop')}{split}"


def test_flush_choice_is_checked_and_falls_back_below_dot_tiles():
    blocks = mamba_ssm_replay._blocks
    assert blocks(dict(BLOCK_P=32, BLOCK_N=32, flush="tf32x3"), 64, 128)["FLUSH_DOT"]
    assert not blocks(dict(BLOCK_P=8, BLOCK_N=32, flush="tf32x3"), 64, 128)["FLUSH_DOT"]
    assert not blocks(dict(BLOCK_P=32, BLOCK_N=32), 64, 128)["FLUSH_DOT"]
    assert blocks(dict(BLOCK_P=8, BLOCK_N=16, flush="unroll"), 64, 128)["FLUSH_UNROLL"]
    # Each flush is its own at any tile: "unroll" and "prefetch" never take the dot (they
    # once did at tiles >= 16, so "unroll" measured as the dot, to the tenth of a us).
    for flush in ("unroll", "prefetch"):
        assert not blocks(dict(BLOCK_P=32, BLOCK_N=32, flush=flush), 64, 128)["FLUSH_DOT"]
    assert blocks(dict(BLOCK_P=32, BLOCK_N=32, flush="unroll"), 64, 128)["FLUSH_UNROLL"]
    assert not blocks(dict(BLOCK_P=32, BLOCK_N=32, flush="tf32x3"), 64, 128)["FLUSH_UNROLL"]
    assert blocks(dict(BLOCK_P=8, BLOCK_N=16, flush="prefetch"), 64, 128)["FLUSH_PREFETCH"]
    assert not blocks(dict(BLOCK_P=8, BLOCK_N=16), 64, 128)["FLUSH_PREFETCH"]
    xs = blocks(dict(BLOCK_P=32, BLOCK_N=32, flush="xsplit"), 64, 128)
    assert xs["FLUSH_DOT"] and xs["FLUSH_XSPLIT"]
    xs = blocks(dict(BLOCK_P=8, BLOCK_N=32, flush="xsplit"), 64, 128)  # below: the loop
    assert not xs["FLUSH_DOT"] and not xs["FLUSH_XSPLIT"]
    assert blocks(dict(BLOCK_P=8, split_flush=True), 64, 128)["SPLIT"]
    assert not blocks(dict(BLOCK_P=8), 64, 128)["SPLIT"]
    with pytest.raises(ValueError, match="flush"):
        blocks(dict(BLOCK_P=32, flush="ieee"), 64, 128)


@pytest.mark.parametrize("split", [False, True], ids=["one-launch", "split"])
def test_unrolled_flush_over_a_longer_ring(device, monkeypatch, split):
    """The unrolled flush with 5 ring entries: rows flush with every count of entries
    (staggered starts), each entry's weight its own decays (a wrong order or a missing
    entry fails against the every-step update); also as a split step's second launch."""
    cfg = dict(BLOCK_P=8, BLOCK_N=16, num_warps=1, flush="unroll", split_flush=split)
    monkeypatch.setattr(mamba_ssm_replay, "launch_config", lambda *a: dict(cfg))
    run_against_every_step(Case(batch=3, heads=2, headdim=8, dstate=16, groups=1, L=6), device)


def _flush_run(case: Case, cfg: dict, device, monkeypatch):
    """Outputs of L + 2 steps, then the states and counters after every line is folded:
    a flush of full rings (step L) and a materialise of partial ones, with ``cfg``."""
    monkeypatch.setattr(mamba_ssm_replay, "launch_config", lambda *a: dict(cfg))
    gen = torch.Generator().manual_seed(7)
    lines = case.batch + 3
    rs = make_rs(case, lines, device, gen)
    p = params(case, device, gen)
    idx = indices(case, lines, device, gen)
    ys = []
    for _ in range(case.L + 2):
        x, dt, B, C = draw(case, device, gen)
        y = replay_ssm_update(rs, x, dt, p["A"], B, C, **_kw(p), state_batch_indices=idx)
        ys.append(y.clone())
    real = idx[idx != PAD_SLOT_ID]
    assert (rs.count[real.long()] == 2).all()  # a flush at step L, then two appends
    replay_ssm_materialise(rs, p["A"], real, torch.ones_like(real, dtype=torch.bool))
    return torch.stack(ys), rs.state.clone(), rs.count.clone()


@pytest.mark.parametrize("split", [False, True], ids=["one-launch", "split"])
def test_prefetched_flush_equals_the_loop(device, monkeypatch, split):
    """The prefetching flush makes the loop's updates in the loop's order: outputs, states
    and counters equal bit for bit."""
    case = Case(batch=3, heads=4, headdim=20, dstate=40, groups=2, L=5)
    (ya, sa, ca), (yb, sb, cb) = (
        _flush_run(
            case,
            dict(BLOCK_P=8, BLOCK_N=16, num_warps=1, flush=f, split_flush=split),
            device,
            monkeypatch,
        )  # fmt: skip
        for f in ("loop", "prefetch")
    )
    assert torch.equal(ya, yb) and torch.equal(sa, sb) and torch.equal(ca, cb)


def check_xsplit_flush(act: torch.dtype, device, monkeypatch) -> None:
    """The xsplit flush (three 16-bit tensor-core products: the weighted x split, the ring's
    B as stored) against the loop's fp32 FMAs: outputs and states to fp32 rounding, and
    the launches took it (dot tiles, a 16-bit ring)."""
    case = Case(batch=3, heads=4, headdim=32, dstate=32, groups=2, L=6, act=act)
    seen, real = [], mamba_ssm_replay._blocks
    monkeypatch.setattr(mamba_ssm_replay, "_blocks", lambda *a: seen.append(real(*a)) or seen[-1])
    (ya, sa, ca), (yb, sb, cb) = (
        _flush_run(case, dict(BLOCK_P=16, BLOCK_N=16, num_warps=1, flush=f), device, monkeypatch)
        for f in ("loop", "xsplit")
    )
    assert any(b["FLUSH_XSPLIT"] and b["FLUSH_DOT"] for b in seen), "xsplit never launched"
    assert rel(yb, ya) < 1e-6 and rel(sb, sa) < 1e-6 and torch.equal(ca, cb)


def test_xsplit_flush_is_fp32_exact(device, monkeypatch):
    check_xsplit_flush(FP16, device, monkeypatch)


# bf16 on the GPU only: Triton 3.6's interpreter computes bf16 tl.dot wrongly.
@pytest.mark.gpu
def test_xsplit_flush_is_fp32_exact_bf16(monkeypatch):
    check_xsplit_flush(BF16, torch.device("cuda"), monkeypatch)


@pytest.mark.parametrize("flush", ["loop", "xsplit"])
def test_one_pass_flush_equals_two_passes(flush, device, monkeypatch):
    """A flushing row's y taken from the state it writes (one_pass) against the output
    pass's formula: the same states and counters bit for bit, outputs within an ulp of their
    dtype (step L flushes every row), and the launches took it."""
    case = Case(batch=3, heads=4, headdim=32, dstate=48, groups=2, L=5, act=FP16)
    seen, real = [], mamba_ssm_replay._blocks
    monkeypatch.setattr(mamba_ssm_replay, "_blocks", lambda *a: seen.append(real(*a)) or seen[-1])
    (ya, sa, ca), (yb, sb, cb) = (
        _flush_run(
            case,
            dict(BLOCK_P=16, BLOCK_N=16, num_warps=1, flush=flush, one_pass=one),
            device,
            monkeypatch,
        )  # fmt: skip
        for one in (False, True)
    )
    assert any(b["ONE_PASS"] for b in seen), "one_pass never launched"
    assert torch.equal(sa, sb) and torch.equal(ca, cb)
    # fp16 outputs: equal but for a rounding of the output dtype (one ulp, 2**-10 relative)
    ya, yb = ya.float(), yb.float()
    assert ((yb - ya).abs() <= ya.abs() * 2**-10 + 1e-6).all() and ya[case.L].abs().amax() > 0


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cfg_id)
def test_launch_configs_agree(cfg, device, monkeypatch):
    """Every tiling computes the same steps, flushes and materialisation."""
    monkeypatch.setattr(mamba_ssm_replay, "launch_config", lambda *a: dict(cfg))
    run_against_every_step(Case(batch=3, heads=4, headdim=20, dstate=40, groups=2, L=3), device)


@pytest.mark.parametrize("marker", [PAD_SLOT_ID, NULL_BLOCK_ID], ids=["pad-1", "null0"])
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.id)
def test_kernel_matches_reference(case, marker, device):
    """Kernel vs ``replay_update_ref``: rings and counters equal, outputs and states to
    rounding (the reference forms every row's state; the kernel only the flushing ones).
    Padded rows (the engine's null line 0, or -1) write no line in either: every line of the
    pool is compared, the last one too (real rows may own it)."""
    gen = torch.Generator().manual_seed(1 + seed(case))
    lines = case.batch + 3
    rs = make_rs(case, lines, device, gen)
    twin = ReplayedSSMState(*(t.clone() for t in rs.tensors()))
    before = ReplayedSSMState(*(t.clone() for t in rs.tensors()))
    p = params(case, device, gen)
    idx = indices(case, lines, device, gen, marker)
    real_lines = idx[idx != marker].long()
    for step in range(case.L + 1):
        x, dt, B, C = draw(case, device, gen)
        y = replay_ssm_update(rs, x, dt, p["A"], B, C, **_kw(p), state_batch_indices=idx,
                              pad_slot_id=marker)  # fmt: skip
        y_ref = torch.empty_like(y)
        replay_update_ref(twin, x, dt, p["A"], B, C, p["D"], p["dt_bias"], True, case.limit,
                          idx, marker, y_ref)  # fmt: skip
        torch.testing.assert_close(y, y_ref, atol=2e-5, rtol=2e-5, msg=f"step {step}")
        for name in ("ring_x", "ring_B", "count"):
            got, want = getattr(rs, name), getattr(twin, name)
            assert torch.equal(got, want), f"step {step}: {name}"
        torch.testing.assert_close(rs.ring_dt, twin.ring_dt)
        torch.testing.assert_close(rs.state, twin.state)
    untouched = torch.ones(lines, dtype=torch.bool, device=device)
    untouched[real_lines] = False
    for got, was in zip(twin.tensors(), before.tensors(), strict=True):
        assert torch.equal(got[untouched], was[untouched]), "the reference wrote a line no row owns"
    # The step's own indices materialised, its padded entries (a CUDA graph's padded
    # prefills) among them: those are skipped by both, the real lines folded and reset.
    replay_ssm_materialise(rs, p["A"], idx, pad_slot_id=marker)
    replay_materialise_ref(twin, p["A"], idx, None, marker)
    torch.testing.assert_close(rs.state[real_lines], twin.state[real_lines])
    assert not rs.count[real_lines].any() and not twin.count[real_lines].any()
    for t in (rs, twin):
        for got, was in zip(t.tensors(), before.tensors(), strict=True):
            assert torch.equal(got[untouched], was[untouched]), "a padded entry was written"


def test_checks_name_the_argument(device):
    case = Case()
    gen = torch.Generator().manual_seed(0)
    rs = make_rs(case, 6, device, gen)
    p = params(case, device, gen)
    x, dt, B, C = draw(case, device, gen)
    idx = torch.arange(case.batch, dtype=torch.int32, device=device)
    bad = ReplayedSSMState(rs.state, rs.ring_x, rs.ring_B, rs.ring_dt, rs.count.int())
    with pytest.raises(ValueError, match="count"):
        replay_ssm_update(bad, x, dt, p["A"], B, C, state_batch_indices=idx)
    short = ReplayedSSMState(rs.state, rs.ring_x[:, :, :1], rs.ring_B, rs.ring_dt, rs.count)
    with pytest.raises(ValueError, match="ring_B"):
        replay_ssm_update(short, x, dt, p["A"], B, C, state_batch_indices=idx)
    with pytest.raises(ValueError, match="A must be"):
        replay_ssm_materialise(rs, p["A"][:2], idx)


def test_opcheck(device):
    case = Case()
    gen = torch.Generator().manual_seed(3)
    rs = make_rs(case, 6, device, gen)
    p = params(case, device, gen)
    x, dt, B, C = draw(case, device, gen)
    idx = torch.tensor([4, PAD_SLOT_ID, 1], dtype=torch.int32, device=device)
    out = torch.empty_like(x)
    step = (*rs.tensors(), x, dt, p["A"], B, C, p["D"], p["dt_bias"], True, 0.0, math.inf,
            idx, None, PAD_SLOT_ID, out)  # fmt: skip
    materialise = (*rs.tensors(), None, None, p["A"], None, None, None, None, False, 0.0,
                   math.inf, idx[[0, 2]], torch.tensor([True, False], device=device),
                   PAD_SLOT_ID, None)  # fmt: skip
    for args in (step, materialise):
        torch.library.opcheck(_replay_ssm_op, args, test_utils=("test_schema", "test_faketensor"))
