"""Shared cases and drivers of the replayed decode update's tests (test_replayssm.py,
test_replayssm_flushes.py): a state pool with rings, steps of fresh inputs, and the run of
2L+2 steps against the every-step update."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from vllm.model_executor.layers.mamba.ops import mamba_ssm_replay
from vllm.model_executor.layers.mamba.ops.causal_conv1d_ref import PAD_SLOT_ID
from vllm.model_executor.layers.mamba.ops.mamba_ssm_replay import (
    ReplayedSSMState,
    replay_ssm_materialise,
    replay_ssm_update,
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
        y = replay_ssm_update(
            rs, x, dt, p["A"], B, C, **step_kw(p), state_batch_indices=idx, out=out
        )
        want = selective_state_update_torch(
            ref, x, dt, p["A"], B, C, **step_kw(p), state_batch_indices=idx
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


def step_kw(p: dict) -> dict:
    return {k: v for k, v in p.items() if k != "A"}


def flush_run(case: Case, cfg: dict, device, monkeypatch):
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
        y = replay_ssm_update(rs, x, dt, p["A"], B, C, **step_kw(p), state_batch_indices=idx)
        ys.append(y.clone())
    real = idx[idx != PAD_SLOT_ID]
    assert (rs.count[real.long()] == 2).all()  # a flush at step L, then two appends
    replay_ssm_materialise(rs, p["A"], real, torch.ones_like(real, dtype=torch.bool))
    return torch.stack(ys), rs.state.clone(), rs.count.clone()
